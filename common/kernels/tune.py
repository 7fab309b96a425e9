"""Kernel choice by measurement on the machine that serves: which cpu_quant path runs which batch.

At an engine's start on the CPU (`prepare`, called by the model runner once the weights are loaded,
with the model's quantized matmuls as `quant_weight.QuantWeight`s named by module:
common.model.quant.kernel_weights) or with `pdserve tune` (common.cli loads the model), every path
cpu_quant has for a quantized layer that the activation mode allows is timed at M = `M_POINTS` rows
on the model's own layers: one of each format among them (the fused QKV, O, fused gate/up, down and
the LM head of a Llama), each cut to at most `MAX_ROWS` output rows (a slice of rows runs at the
whole's rate; its time is scaled back up by the layer's rows) and summed per weight width (bits).
Each figure is the best of a few calls after one warm-up, the calls of all paths and layers
interleaved (round after round, so a busy moment of a shared machine hits every path alike); a path
slower at some M than the fastest at that M times 256 / M is not timed at larger M (a kernel's time
does not drop as M grows, the fastest's at most grows with M) and ranks after those that were. Sums
where a path does not apply to one of the layers count that layer at its fastest path's time. The C
decode layers (common.kernels.cpu_layer) run a whole decoder layer in one C call only where all its
projections take c, a8, amxbf16 or amx4, saving the torch calls between them that a matmul's
timing does not see: where they are on, those paths' sums for the projections' width are credited
with `LAYER_OPS` small torch calls, timed here. A few seconds on a 2-core host for the default
model. A measurement where more than `MAX_UNSURE` of the timings stayed unconfirmed (a machine busy
with other work) serves its process but is not cached (`pdserve tune` writes it anyway, with that
share in the file).

The result, per bits, is each point's paths ordered fastest first; a batch of M rows uses the
order of the first point >= M (the last beyond 256), so point m_i serves M in (m_{i-1}, m_i].
It is written as JSON (atomically; the first writer wins, so processes that tuned at once agree)
to the kernel cache directory (common.kernels.cbuild.cache_dir), in a file named by a hash of
the key: CPU flags, the C kernels' libraries (their ISA level and build key), torch threads and
version, the layers' formats and shapes, the activation mode, whether the dense path may keep its
copies and from how many rows it may serve, and x's dtype. A later start with the same key reads
it instead of measuring; any change makes another key, so another file.
Then `choose_prefetch` has common.kernels.prefetch choose where the a8 kernel prefetches the
weights it streams at one row (measured at every start: the cache-warm timings here cannot see it).
`cpu_quant.choose` reads the orders from `cpu_quant.tuned`; a layer that meets a (bits, dtype,
mode) no engine tuned for (a test, a benchmark) is tuned on its own shape at its first matmul.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from common.kernels import cpu_qgemm, cpu_quant, isa
from common.kernels.cbuild import cache_dir
from common.kernels.quant_weight import QuantWeight

log = logging.getLogger(__name__)

VERSION = 6  # of the method and the file: part of the key (2: a8 credited like c; 3: dense;
# 4: amxbf16; 5: amxbf16 from 17 rows; 6: amx4)
M_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_ROWS = 2048
# the C decode layers (common.kernels.cpu_layer) fold about this many torch calls of a decoder
# layer into one C call where its four projections all take c, a8, amxbf16 or amx4: their sums are
# credited
LAYER_OPS = 12
FUSED_PATHS = ("c", "a8", "amxbf16", "amx4")
_DECODER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# best of, at M <= 16 and above (longer calls, smaller spread); then more of the unconfirmed
ROUNDS, ROUNDS_LARGE, EXTRA_ROUNDS = 5, 3, 3
# above this share of timings whose best no second call confirmed, the tables are not cached
MAX_UNSURE = 0.25
# (path, weight, x) -> seconds of one call through that path: tests inject a fake
TimeCall = Callable[[str, QuantWeight, torch.Tensor], float]
# (module name, weight) of each quantized matmul of a model: common.model.quant.kernel_weights
NamedWeights = Iterable[tuple[str, QuantWeight]]
Table = list[tuple[int, list[str], dict[str, float]]]  # (M, paths fastest first, ms per path)


def time_call(path: str, w: QuantWeight, x: torch.Tensor) -> float:
    """Seconds of one call of `path`, after a warm-up at the weight's first call of it (packing,
    building, first touch)."""
    warm = w.derived.setdefault("tune_warm", set())
    if path not in warm:
        warm.add(path)
        cpu_quant.run_path(path, x, w)
    t0 = time.perf_counter()
    cpu_quant.run_path(path, x, w)
    return time.perf_counter() - t0


def dispatch_s(hidden: int = 576, calls: int = 50) -> float:
    """Seconds of one small torch call at batch 1 (what the C decode layers save per op)."""
    a, b = torch.randn(1, hidden), torch.randn(1, hidden)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        torch.add(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def representative_layers(weights: NamedWeights) -> list[QuantWeight]:
    """One weight of each (format, shape) among a model's quantized matmuls."""
    found: dict[tuple, QuantWeight] = {}
    for _, w in weights:
        found.setdefault(layer_format(w), w)
    return list(found.values())


def layer_format(w: QuantWeight) -> tuple:
    return (w.bits, w.group_size, w.n, w.k, w.zero is not None,
            str(w.scale.dtype).removeprefix("torch."))  # fmt: skip


def tuning_key(layers: list[QuantWeight], dtype: torch.dtype) -> dict:
    """What the measurement depends on besides the load of the machine."""
    libs = {}
    for name, lib in (("quant_matmul", cpu_quant._LIB), ("quant_gemm", cpu_qgemm._LIB)):
        lib.available()
        libs[name] = Path(lib.lib._name).name if lib.lib is not None else None
    flags = " ".join(sorted(isa.cpu_flags()))
    return {
        "version": VERSION,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "libraries": libs,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "activations": cpu_quant.activations,
        "dense_weights": cpu_quant.dense_weights,
        "dense_min_rows": cpu_quant.dense_min_rows,
        "dtype": str(dtype).removeprefix("torch."),
        "layers": sorted(layer_format(layer) for layer in layers),
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"tune-{digest}.json"


def allowed_paths(dtype: torch.dtype) -> list[str]:
    """The paths the activation mode lets run (a8 only where int8 activations may; dense and
    amxbf16 only where their copies were allowed)."""
    a8_ok, dense_ok = cpu_quant.int8_activations(), cpu_quant.dense_weights
    return [
        p for p in cpu_quant.PATHS
        if (p != "a8" or a8_ok) and (p not in ("dense", "amxbf16") or dense_ok)
    ]  # fmt: skip


def measure(
    layers: list[QuantWeight], dtype: torch.dtype, timer: TimeCall = time_call,
    c_credit_s: dict[int, float] | None = None, stats: dict | None = None,
) -> dict[int, Table]:  # fmt: skip
    """Each bits' table (see the module docstring), timing `layers` with x in `dtype`;
    `c_credit_s[bits]` is taken off the sums of FUSED_PATHS for those bits (what the C decode
    layers save when they run them)."""
    tables: dict[int, Table] = {}
    gen = torch.Generator().manual_seed(0)
    for bits in sorted({layer.bits for layer in layers}):
        group = [_slice(layer) for layer in layers if layer.bits == bits]
        xs = {m: torch.randn(m, max(lay.k for lay, _ in group), generator=gen)
              for m in M_POINTS}  # fmt: skip
        live = [
            p for p in allowed_paths(dtype)
            if any(_applies(p, lay, dtype, M_POINTS[-1]) for lay, _ in group)
        ]  # fmt: skip
        raw: list[dict[str, float]] = []  # per M: ms per path timed there
        for m in M_POINTS:
            xm = [xs[m][:, : lay.k].to(dtype) for lay, _ in group]
            runs = [
                (p, i) for p in live for i, (lay, _) in enumerate(group)
                if _applies(p, lay, dtype, m)
            ]  # fmt: skip
            call = lambda p, i, g=group, x=xm: timer(p, g[i][0], x[i]) * g[i][1]  # noqa: E731
            best_s = _best_of(runs, call, m, stats if stats is not None else {})
            fastest = [min((t for (_, j), t in best_s.items() if j == i), default=0.0)
                       for i in range(len(group))]  # fmt: skip
            timed_here = {p for p, _ in runs}  # dense is not timed below its least rows
            ms = {p: 1e3 * sum(best_s.get((p, i), fastest[i]) for i in range(len(group)))
                  for p in live if p in timed_here}  # fmt: skip
            for path in FUSED_PATHS:  # the paths the C decode layers run inside one call
                if path in ms:
                    ms[path] = max(ms[path] - 1e3 * (c_credit_s or {}).get(bits, 0.0), 1e-6)
            raw.append(ms)
            live = [p for p in live if p not in ms or ms[p] <= min(ms.values()) * M_POINTS[-1] / m]
        # a call on more rows never takes less time: a point above a later one was a busy moment
        for k in range(len(raw) - 2, -1, -1):
            for p, t in raw[k].items():
                raw[k][p] = min(t, raw[k + 1].get(p, t))
        last: dict[str, float] = {}  # each path's time at the last M it was timed at
        table: Table = []
        for m, ms in zip(M_POINTS, raw):
            last.update(ms)
            timed = sorted(ms, key=ms.__getitem__)
            dropped = sorted((p for p in last if p not in ms), key=last.__getitem__)
            table.append((m, timed + dropped, {p: round(ms[p], 4) for p in timed}))
        tables[bits] = table
    return tables


def _best_of(runs: list, call: Callable, m: int, stats: dict) -> dict:
    """Each run's best time over interleaved rounds (a busy moment of a shared machine hits
    every run alike), then up to EXTRA_ROUNDS more of those whose best no second call came
    within 25% of (a best that is itself a lucky outlier is rarer than a slow one)."""
    samples: dict = {run: [] for run in runs}
    for _ in range(ROUNDS if m <= 16 else ROUNDS_LARGE):
        for run in runs:
            samples[run].append(call(*run))
    for _ in range(EXTRA_ROUNDS):
        unsure = [r for r, ts in samples.items() if sorted(ts)[1] > 1.25 * min(ts)]
        for run in unsure:
            samples[run].append(call(*run))
    unsure = sum(sorted(ts)[1] > 1.25 * min(ts) for ts in samples.values())
    stats["runs"] = stats.get("runs", 0) + len(samples)
    stats["unsure"] = stats.get("unsure", 0) + unsure
    return {run: min(ts) for run, ts in samples.items()}


def _applies(path: str, w: QuantWeight, dtype: torch.dtype, m: int) -> bool:
    """Whether `path` takes an [m, K] input in `dtype` (a broadcast row: no [m, K] buffer)."""
    return cpu_quant.applies(path, w, torch.empty(1, w.k, dtype=dtype).expand(m, -1))


def _slice(w: QuantWeight) -> tuple[QuantWeight, float]:
    """A weight over at most MAX_ROWS of `w`'s rows (views: no copy) and the factor that
    scales its times back to the whole; a new one, so what the kernels keep while it is timed
    (packed copies) goes with it."""
    rows = min(w.n, MAX_ROWS)
    zero = None if w.zero is None else w.zero[:rows]
    part = QuantWeight(w.bits, w.group_size, w.qweight[:rows], w.scale[:rows], zero, rows, w.k)
    return part, w.n / rows


def load_or_measure(
    layers: list[QuantWeight], dtype: torch.dtype, timer: TimeCall = time_call,
    force: bool = False, layer_bits: Iterable[int] = (),
) -> tuple[dict[int, Table], Path, bool]:  # fmt: skip
    """The tables for these layers from the cache, else measured and written (always measured
    with `force`); the file, and whether it was measured now. `layer_bits`: the widths whose
    decoder layers the C decode layers can run (see `layer_kernel_bits`)."""
    layer_bits = sorted(set(layer_bits))
    key = {**tuning_key(layers, dtype), "layer_kernel_bits": layer_bits}
    path = cache_path(key)
    if not force:
        tables = _read(path, key)
        if tables is not None:
            return tables, path, False
    t0 = time.perf_counter()
    credit = dict.fromkeys(layer_bits, LAYER_OPS * dispatch_s()) if layer_bits else None
    stats: dict = {}
    tables = measure(layers, dtype, timer, credit, stats)
    unsure = stats.get("unsure", 0) / max(stats.get("runs", 1), 1)
    if unsure > MAX_UNSURE and not force:  # a busy machine: keep it for this process only
        log.warning("kernel timings too noisy to cache (%.0f%% of them unconfirmed): measuring "
                    "again at the next start", 100 * unsure)  # fmt: skip
        return tables, path, True
    body = {"key": key, "seconds": round(time.perf_counter() - t0, 2), "unsure": round(unsure, 3),
            "tables": {str(b): [{"m": m, "order": o, "ms": t} for m, o, t in table]
                       for b, table in tables.items()}}  # fmt: skip
    _write(path, body, replace=force)
    if not force:  # another process may have written first: everyone serves its table
        tables = _read(path, key) or tables
    return tables, path, True


def _read(path: Path, key: dict) -> dict[int, Table] | None:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if body.get("key") != json.loads(json.dumps(key)):  # a hash collision or a damaged file
        return None
    return {int(b): [(p["m"], p["order"], p["ms"]) for p in points]
            for b, points in body["tables"].items()}  # fmt: skip


def _write(path: Path, body: dict, replace: bool) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(body, f, indent=1)
        try:
            if replace:
                os.replace(f.name, path)
            else:
                os.link(f.name, path)  # fails if it exists: the first writer wins
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: the last writer wins instead
            os.replace(f.name, path)
        finally:
            if os.path.exists(f.name):
                os.unlink(f.name)
    except OSError as exc:  # a read-only cache: serve what was measured, measure again next time
        log.warning("could not write the kernel tuning cache %s: %s", path, exc)


def install(tables: dict[int, Table], dtype: torch.dtype) -> None:
    """Make cpu_quant.choose use these tables for x in `dtype` under the current mode."""
    for bits, table in tables.items():
        cpu_quant.tuned[(bits, dtype, cpu_quant.activations)] = (
            [m for m, _, _ in table],
            [order for _, order, _ in table],
        )


def order_for(bits: int, dtype: torch.dtype, m: int) -> list[str] | None:
    """The tuned paths for M rows, fastest first, or None when nothing was tuned for them."""
    entry = cpu_quant.tuned.get((bits, dtype, cpu_quant.activations))
    if entry is None:
        return None
    ms, orders = entry
    return orders[min(bisect.bisect_left(ms, m), len(ms) - 1)]


def describe(tables: dict[int, Table], dtype: torch.dtype) -> list[str]:
    """One line per bits and range of M that one path serves, with the times at its ends."""
    lines = []
    for bits, table in sorted(tables.items()):
        start = 0
        for i, (m, order, _) in enumerate(table):
            if i + 1 < len(table) and table[i + 1][1][0] == order[0]:
                continue
            lo = table[start - 1][0] + 1 if start else 1
            span = f"{lo}+" if i == len(table) - 1 else (f"{lo}" if lo == m else f"{lo}-{m}")
            ends = [table[start]] if start == i else [table[start], table[i]]
            times = "; ".join(
                f"M={pm}: " + ", ".join(f"{p} {t[p]:.3g}" for p in po[:3] if p in t) + " ms"
                for pm, po, t in ends
            )
            lines.append(f"int{bits} x {str(dtype).removeprefix('torch.')} M {span}: "
                         f"{order[0]} ({times})")  # fmt: skip
            start = i + 1
    return lines


def layer_kernel_bits(weights: NamedWeights) -> set[int]:
    """The widths of the decoder projections when the C decode layers are on (they run a layer
    in one call only where all four take c)."""
    from common.kernels import cpu_layer

    if not (cpu_layer.enabled and cpu_layer.available()):
        return set()
    return {w.bits for name, w in weights if name.rpartition(".")[2] in _DECODER_PROJECTIONS}


def prepare(
    kernel_choice: str, dtype: torch.dtype, weights: NamedWeights,
    timer: TimeCall = time_call, force: bool = False,
) -> dict[int, Table]:  # fmt: skip
    """Set cpu_quant's kernel choice; for `auto`, tune for a model's quantized matmuls (`weights`,
    as common.model.quant.kernel_weights lists them; or read the cached tables) and log which
    path serves which range. Returns the tables ({} otherwise)."""
    cpu_quant.set_kernel_choice(kernel_choice)
    weights = list(weights)
    layers = representative_layers(weights)
    if kernel_choice != "auto" or not layers:
        choose_prefetch(weights, dtype)
        return {}
    bits = layer_kernel_bits(weights)
    tables, path, measured = load_or_measure(layers, dtype, timer, force, bits)
    install(tables, dtype)
    how = "measured" if measured else "cached"
    log.info("kernel choice (%s, activations %s, %s):", how, cpu_quant.activations, path)
    for line in describe(tables, dtype):
        log.info("  %s", line)
    choose_prefetch(weights, dtype)
    return tables


def choose_prefetch(weights: NamedWeights, dtype: torch.dtype) -> int:
    """common.kernels.prefetch's level, measured over the weights the a8 path serves one row of,
    set and logged; with none, nothing is measured or set (L1 returned). Returns the level."""
    from common.kernels import prefetch

    if dtype not in (torch.float32, torch.bfloat16):
        return prefetch.L1
    # an engine's single rows take the 2-row order (cpu_quant.uniform_rows, which the engine
    # sets once its runner, and so this, is done): the weights a8 then serves one row of
    packed = [
        cpu_quant.a8_weights(w)
        for _, w in weights
        if cpu_quant.choose(w, torch.zeros(2, w.k, dtype=dtype)) == "a8"
    ]
    if not packed:  # a8 serves no single rows here: its library need not even be built
        return prefetch.L1
    level, medians = prefetch.choose(packed, dtype)
    log.info("%s", prefetch.describe(level, medians, packed))
    return level


def tune_layer(w: QuantWeight, dtype: torch.dtype) -> None:
    """Tables for a layer no engine tuned for, from its own shape (cached like an engine's)."""
    tables, _, measured = load_or_measure([w], dtype)
    install(tables, dtype)
    if measured:
        log.info("kernel choice for %s (%s):", w, "; ".join(describe(tables, dtype)))


def run_tune_command(weights: NamedWeights, dtype: torch.dtype) -> int:
    """`pdserve tune` once common.cli has loaded the model (its quantized matmuls, `weights`):
    measure again, rewrite the cache entry, print the table."""
    weights = list(weights)
    layers = representative_layers(weights)
    if not layers:
        print("no quantized layers: nothing to tune (see --quantization)")
        return 0
    t0 = time.perf_counter()
    bits = layer_kernel_bits(weights)
    tables, path, _ = load_or_measure(layers, dtype, force=True, layer_bits=bits)
    print(f"kernel choice, {torch.get_num_threads()} threads, activations "
          f"{cpu_quant.activations}, measured in {time.perf_counter() - t0:.1f} s:")  # fmt: skip
    print("\n".join(describe(tables, dtype)))
    print(f"written to {path}")
    return 0
