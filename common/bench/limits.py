"""The machine's limits, measured once per process: the only place that measures the machine.

Owns three figures and the arithmetic that turns them into floors (DESIGN.md section 9):
- read bandwidth: bytes per second a multi-threaded read-only sum (`torch.sum` over float32, on
  `torch.get_num_threads()` threads) streams from a buffer of at least 8x the last-level cache
  (default 1 GiB), best of a few passes;
- copy bandwidth: the first half of that buffer copied into the second half (`copy_`), counted as
  read + write bytes per second (the STREAM convention), best of a few passes: reported for
  comparison only, never a floor (a floor over it would be ~2x too lenient);
- matmul rate (FLOP/s, 2 * M * N * K per call) of each compute dtype the kernels use: float32 and
  bfloat16 (`F.linear`) and int8 dot products (`torch._int_mm`, int8 x int8 -> int32; reported as
  unavailable with torch's reason where it does not run), at M = 1, 8, 64, 512 on the model's own
  linear shapes (fused QKV, O, fused gate/up, down, LM head, read from its config). Weights and
  inputs are hot in the caches (memory is the read floor's part; at small M the figure is still
  bound by reading the weight from the caches). N is cut so one call is at most `MAX_CALL_FLOP`
  (the LM head's rows at large M: a slice of rows runs at the whole's rate); each figure is the
  best call of at least `repeats` (and `MIN_TIME_S`) after one warm-up.
The read floor of a step is its bytes read / read bandwidth, its compute floor its FLOPs / the
best rate of the dtype it computes in measured at M >= its rows (`Limits.rate`), its limit the
larger; "% of limit" in the benchmarks = limit / measured time.

The same read and the matmuls at the largest M are also measured on one thread (`one_core_*`).
They give a step's **cores' floor** (`Limits.core_floor_s`): every byte is read and every FLOP
computed by some core, each core reads at most the one-thread rate and computes at most the
one-thread rate, so the threads together need at least (bytes / one-thread read + FLOPs /
one-thread rate) / threads. The limit (the larger floor) assumes reading and computing overlap;
where one core cannot stream memory by itself (a 2-core VM: one thread reads about half of what
two do), reading at the read floor takes every core and the cores' floor, about the read floor
plus the compute floor, is the higher bound. Benchmarks print it beside the limit.

Figures are cached in this process only (a session's machine is not the next one's): never
written to disk. 5-10 s on a 2-core host, the longer the more loaded it is.

Called by the benchmarks (benchmarks/quantization.py, step_profile.py, offline_throughput.py,
gpu_quant.py: its device's read bandwidth), through common.bench.step_cost, and by `pdserve
limits` (common/cli.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model import row_passes

DTYPES = ("float32", "bfloat16", "int8")
BATCH_ROWS = (1, 8, 64, 512)  # the M each rate is measured at
MAX_CALL_FLOP = 2e9
MIN_TIME_S = 0.02  # per (dtype, M, shape): small calls repeat for this long, best call counts
_CACHE: dict[tuple, object] = {}  # in-process only, by design


def default_buffer_bytes() -> int:
    """At least 8x the last-level cache (row_passes reads its size from sysfs), 1 GiB at least."""
    return max(1 << 30, 8 * row_passes.last_level_cache_bytes())


def _best_s(fn, repeats: int, sync=lambda: None, min_time_s: float = 0.0) -> float:
    """The fastest of at least `repeats` calls (and as many more as fit in `min_time_s`: on a
    shared machine, more tries at a quiet moment) after one warm-up call."""
    fn()  # warm-up: page faults, one-time kernel setup
    sync()
    best, calls, begin = float("inf"), 0, time.perf_counter()
    while calls < repeats or time.perf_counter() - begin < min_time_s:
        start = time.perf_counter()
        fn()
        sync()
        best, calls = min(best, time.perf_counter() - start), calls + 1
    return best


def _buffer(nbytes: int | None, device: str = "cpu") -> torch.Tensor:
    """A float32 buffer of `nbytes` (default >= 8x the LLC), every page touched."""
    return torch.ones((nbytes or default_buffer_bytes()) // 4, dtype=torch.float32, device=device)


def read_bandwidth(
    nbytes: int | None = None,
    repeats: int = 5,
    device: str = "cpu",
    buf: torch.Tensor | None = None,
) -> float:
    """Read-only bytes per second: a float32 sum over `nbytes` (default >= 8x the LLC, 1 GiB).
    `device="cuda"` measures a GPU the same way (for the CUDA benchmarks)."""
    key = ("read", nbytes, device, torch.get_num_threads())
    if key not in _CACHE:
        buf = _buffer(nbytes, device) if buf is None else buf
        _CACHE[key] = read_bandwidth_now(buf, repeats)
    return _CACHE[key]  # type: ignore[return-value]


def read_buffer(nbytes: int | None = None) -> torch.Tensor:
    """The buffer `read_bandwidth` sums (default >= 8x the LLC, 1 GiB), every page touched: to
    keep for `read_bandwidth_now`."""
    return _buffer(nbytes)


def read_bandwidth_now(buf: torch.Tensor, repeats: int = 3) -> float:
    """Read-only bytes per second over `buf` (a `read_buffer`), measured now, never cached: for
    a limit taken beside what is judged against it, where the bandwidth drifts within minutes
    (a shared host's: 33-57 GB/s in one hour on one 2-core VM)."""
    sync = torch.cuda.synchronize if buf.device.type == "cuda" else (lambda: None)
    return buf.nbytes / _best_s(buf.sum, repeats, sync)


def copy_bandwidth(
    nbytes: int | None = None, repeats: int = 5, buf: torch.Tensor | None = None
) -> float:
    """Read + write bytes per second of a `copy_` between the two halves of an `nbytes` buffer."""
    key = ("copy", nbytes, torch.get_num_threads())
    if key not in _CACHE:
        buf = _buffer(nbytes) if buf is None else buf
        half = buf.numel() // 2
        src, dst = buf[:half], buf[half : 2 * half]
        _CACHE[key] = 2 * src.nbytes / _best_s(lambda: dst.copy_(src), repeats)
    return _CACHE[key]  # type: ignore[return-value]


def int8_unavailable() -> str | None:
    """Why int8 x int8 -> int32 matmuls cannot be measured here (None: they can)."""
    try:
        a = torch.ones(8, 64, dtype=torch.int8)
        torch._int_mm(a, torch.ones(64, 32, dtype=torch.int8))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"torch._int_mm on CPU: {str(e).splitlines()[0]}"
    return None


def _weight(dtype: str, n: int, k: int, source: torch.Tensor | None = None) -> torch.Tensor:
    """A [n, k] weight in `dtype` (values in [-1, 1), int8 scaled to [-127, 127]); rows of
    `source` (float32) when given, so one random draw serves every dtype and M."""
    w = source[:n] if source is not None else torch.rand(n, k) * 2 - 1
    return (w * 127).to(torch.int8) if dtype == "int8" else w.to(getattr(torch, dtype))


def matmul_rate(
    dtype: str, m: int, k: int, n: int, repeats: int = 3, source: torch.Tensor | None = None
) -> float:
    """FLOP/s of x [m, k] @ W.T, W [n, k], both in `dtype` (int8: int32 out), caches hot.
    `source`: a float32 [n, k] weight to take W from (saves drawing one per call)."""
    n = max(1, min(n, int(MAX_CALL_FLOP // (2 * m * k))))
    key = ("matmul", dtype, m, k, n, torch.get_num_threads())
    if key not in _CACHE:
        if dtype == "int8" and (why := int8_unavailable()):
            raise RuntimeError(why)
        x, w = _weight(dtype, m, k), _weight(dtype, n, k, source)
        if dtype == "int8":
            w_t = w.t()
            call = lambda: torch._int_mm(x, w_t)  # noqa: E731
        else:
            call = lambda: F.linear(x, w)  # noqa: E731
        with torch.inference_mode():
            _CACHE[key] = 2 * m * k * n / _best_s(call, repeats, min_time_s=MIN_TIME_S)
    return _CACHE[key]  # type: ignore[return-value]


def linear_shapes(hf_config) -> list[tuple[str, int, int]]:
    """(name, N, K) of the model's linears as pdserve builds them: fused QKV, O, fused gate/up,
    down, LM head."""
    from common.model.llama import head_dim_of

    hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
    q = hf_config.num_attention_heads * head_dim
    kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    inter = hf_config.intermediate_size
    return [
        ("qkv", q + 2 * kv * head_dim, hidden),
        ("o", hidden, q),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
        ("lm_head", hf_config.vocab_size, hidden),
    ]


@dataclass
class Limits:
    """Measured figures: bytes/s and, per (dtype, M), the best FLOP/s over the model's shapes."""

    read_bytes_per_s: float
    copy_bytes_per_s: float = 0.0
    rates: dict[tuple[str, int], float] = field(default_factory=dict)
    shape_rates: dict[tuple[str, int, str], float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # dtype -> why not measured
    threads: int = 0
    seconds: float = 0.0  # how long measuring took
    # one thread's figures (0 / empty: not measured): read bytes/s, and FLOP/s per dtype at the
    # largest M measured (the most one core computes)
    one_core_read_bytes_per_s: float = 0.0
    one_core_rates: dict[str, float] = field(default_factory=dict)

    def rate(self, dtype: str | torch.dtype, m: int) -> float:
        """Best FLOP/s of `dtype` for M = m rows: the best measured at any M >= m (more rows only
        add reuse, so m rows run no faster than that: the floor it gives stays a lower bound;
        past the largest M measured, that M's). At M = 1 this is the dtype's peak, not the
        measured M = 1 figure, which is bound by reading the weight from the caches."""
        name = str(dtype).removeprefix("torch.")
        if name in self.unavailable:
            raise ValueError(f"no {name} matmul rate: {self.unavailable[name]}")
        measured = sorted(mm for d, mm in self.rates if d == name)
        if not measured:
            raise ValueError(f"no {name} matmul rate measured")
        return max(self.rates[(name, mm)] for mm in measured if mm >= min(m, measured[-1]))

    def read_floor_s(self, bytes_read: float) -> float:
        """Seconds to read `bytes_read` (a decode step's bytes per token at batch 1)."""
        return bytes_read / self.read_bytes_per_s

    def compute_floor_s(self, flops: float, dtype: str | torch.dtype, m: int) -> float:
        """Seconds for `flops` at the best rate of `dtype`, the dtype actually computed in."""
        return flops / self.rate(dtype, m)

    def step_floor_s(self, bytes_read: float, flops: float, dtype: str | torch.dtype, m: int):
        """A step's limit: the larger of its read floor and its compute floor."""
        return max(self.read_floor_s(bytes_read), self.compute_floor_s(flops, dtype, m))

    def core_floor_s(self, bytes_read: float, flops_by_dtype: dict[str, float]) -> float:
        """The cores' floor of a step that reads `bytes_read` and computes `flops_by_dtype`
        (FLOPs per dtype): (bytes / one thread's read rate + each dtype's FLOPs / one thread's
        rate) / threads; 0.0 where the one-thread figures were not measured. Each one-thread
        figure counts as at least 1 / threads of the threads' own (they reached that together,
        so one of them did: a busy moment while measuring one thread cannot raise the floor
        past the read floor plus the compute floor)."""
        if self.one_core_read_bytes_per_s <= 0 or self.threads <= 0:
            return 0.0
        n = self.threads
        core_s = bytes_read / max(self.one_core_read_bytes_per_s, self.read_bytes_per_s / n)
        for dtype, flops in flops_by_dtype.items():
            name = str(dtype).removeprefix("torch.")
            if not flops:
                continue
            if name not in self.one_core_rates:
                return 0.0
            together = max((r for (d, _), r in self.rates.items() if d == name), default=0.0)
            core_s += flops / max(self.one_core_rates[name], together / n)
        return core_s / n

    def read_share(self) -> float:
        """The share of the threads' time that reading at the read bandwidth takes, each
        reading at one thread's rate (0.0 where that was not measured)."""
        one = self.one_core_read_bytes_per_s
        return self.read_bytes_per_s / (one * max(self.threads, 1)) if one > 0 else 0.0

    def reads_take_the_cores(self) -> bool:
        """True where reading at the read bandwidth takes at least 80% of the threads' time:
        it leaves (almost) no core free to compute beside it."""
        return self.read_share() >= 0.8

    def ceiling_tokens_per_s(
        self, bytes_per_step: float, flops_per_token: float, dtype: str | torch.dtype, batch: int
    ) -> float:
        """Tokens/s at best for steps of `batch` tokens that each read `bytes_per_step`."""
        return batch / self.step_floor_s(bytes_per_step, flops_per_token * batch, dtype, batch)

    def as_dict(self) -> dict:
        """The figures for a benchmark's JSON: GB/s, and GFLOP/s by dtype then M."""
        gflops: dict[str, dict[int, float]] = {}
        for (dtype, m), rate in sorted(self.rates.items()):
            gflops.setdefault(dtype, {})[m] = rate / 1e9
        return {
            "threads": self.threads,
            "read_GB_s": self.read_bytes_per_s / 1e9,
            "copy_GB_s": self.copy_bytes_per_s / 1e9,
            "matmul_GFLOP_s": gflops,
            "unavailable": self.unavailable,
            "one_core": {
                "read_GB_s": self.one_core_read_bytes_per_s / 1e9,
                "matmul_GFLOP_s": {d: r / 1e9 for d, r in sorted(self.one_core_rates.items())},
            },
        }

    def describe(self) -> str:
        """The figures as a short line and a Markdown table of GFLOP/s by dtype and M."""
        ms = sorted({m for _, m in self.rates})
        lines = [
            f"limits ({self.threads} threads, measured in {self.seconds:.1f} s): read "
            f"{self.read_bytes_per_s / 1e9:.2f} GB/s, copy {self.copy_bytes_per_s / 1e9:.2f} GB/s "
            "(read + write); matmul GFLOP/s, best over the model's linear shapes:",
            "",
            "| dtype | " + " | ".join(f"M={m}" for m in ms) + " |",
            "|---|" + "---:|" * len(ms),
        ]
        for dtype in DTYPES:
            if dtype in self.unavailable:
                lines.append(f"| {dtype} | unavailable: {self.unavailable[dtype]} |")
            elif any(d == dtype for d, _ in self.rates):
                cells = [f"{self.rates[(dtype, m)] / 1e9:.1f}" for m in ms]
                lines.append(f"| {dtype} | " + " | ".join(cells) + " |")
        if self.one_core_read_bytes_per_s > 0:
            rates = ", ".join(f"{d} {r / 1e9:.1f}" for d, r in self.one_core_rates.items())
            lines += [
                "",
                f"one thread: read {self.one_core_read_bytes_per_s / 1e9:.2f} GB/s "
                f"({self.read_share():.0%} of "
                f"the threads' time at the read bandwidth: "
                f"{'reading takes the cores' if self.reads_take_the_cores() else 'cores left free'}"
                f"); matmul GFLOP/s at M={ms[-1]}: {rates}",
            ]
        return "\n".join(lines)


def measure(
    hf_config=None,
    nbytes: int | None = None,
    batch_rows: tuple[int, ...] = BATCH_ROWS,
    dtypes: tuple[str, ...] = DTYPES,
    repeats: int = 3,
) -> Limits:
    """All figures for this machine and model (default: the default model's config), measured
    once per process and argument set."""
    if hf_config is None:
        from common.model.model_files import resolve_model

        hf_config = resolve_model("default").hf_config
    shapes = linear_shapes(hf_config)
    key = ("limits", tuple(shapes), nbytes, batch_rows, dtypes, torch.get_num_threads())
    if key not in _CACHE:
        start = time.perf_counter()
        buf = _buffer(nbytes)  # one buffer for both, freed before the matmuls
        limits = Limits(
            read_bytes_per_s=read_bandwidth(nbytes, buf=buf),
            copy_bytes_per_s=copy_bandwidth(nbytes, buf=buf),
            threads=torch.get_num_threads(),
        )
        with _one_thread():
            limits.one_core_read_bytes_per_s = read_bandwidth(nbytes, buf=buf)
        del buf
        if "int8" in dtypes and (why := int8_unavailable()):
            limits.unavailable["int8"] = why
        for name, n, k in shapes:
            source = _weight("float32", n, k)  # one draw per shape
            for dtype in (d for d in dtypes if d not in limits.unavailable):
                for m in batch_rows:
                    rate = matmul_rate(dtype, m, k, n, repeats, source)
                    limits.shape_rates[(dtype, m, name)] = rate
                    limits.rates[(dtype, m)] = max(limits.rates.get((dtype, m), 0.0), rate)
        _measure_one_core(limits, shapes, max(batch_rows), dtypes, repeats)
        limits.seconds = time.perf_counter() - start
        _CACHE[key] = limits
    return _CACHE[key]  # type: ignore[return-value]


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch (and the kernels it calls) on one thread inside, the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _measure_one_core(
    limits: Limits,
    shapes: list[tuple[str, int, int]],
    m: int,
    dtypes: tuple[str, ...],
    repeats: int,
) -> None:
    """One thread's matmul rates at M = `m` (the best over `shapes`, per dtype) into `limits`."""
    with _one_thread():
        for _name, n, k in shapes:
            source = _weight("float32", n, k)
            for dtype in (d for d in dtypes if d not in limits.unavailable):
                rate = matmul_rate(dtype, m, k, n, repeats, source)
                limits.one_core_rates[dtype] = max(limits.one_core_rates.get(dtype, 0.0), rate)
