"""Where a decode step's time goes, eager torch ops vs the fused CPU ops, next to its limit.

Loads the model into a ModelRunner in this process, builds one decode step (every sequence one
token at `--context` cached positions) at each batch size, and for the eager ops
(`cpu_ops.enabled = False`) and the fused ones: the plain step time (forward + LM head, best of
`--repeats`), then the same steps with every Linear, RMSNorm, Attention, MLP and the attention
kernel wrapped in timers, which gives each one's exclusive time per step:

- linear: the projections and the LM head (weight streaming);
- attention kernel: paged attention over the KV cache;
- norm + residual: RMSNorm with the residual add;
- attention glue: the rest of Attention.forward (q/k/v views, rotary, the KV-cache store);
- mlp glue: SiLU * up;
- other: embedding, the layer loop, the wrappers' own cost (total minus the above);

and, without the timers, the step with every Linear returning zeros at once: the time that is not
weight streaming. A third column, `layer`, is the step with `common.kernels.cpu_layer` on (each
decoder layer of a quantized model's decode step in one C call; nothing to time inside it, so
only the step); the first two columns turn it off.

The step's limit (common.bench.limits, measured in this process; common.bench.step_cost) is the
larger of its read floor (the bytes it reads: every linear's weight once, the LM head once, each
sequence's K/V, over the read-only memory bandwidth) and its compute floor (each linear's FLOPs
over the best measured rate of the dtype it computes in at that batch); "% of limit" = limit /
step time. Beside it, the step's cores' floor (what the threads need at least when each reads at
one thread's rate and computes at one thread's rate: where that is above the limit, reading takes
the cores and the floors add up) and, where higher, the step's % of it. `--clock cpu` times with
the process's CPU time instead of the wall clock: on a machine shared with other jobs, use it
with `--threads 1` (time spent waiting for a core is then not counted). Run:
`python benchmarks/step_profile.py [--model default] [--dtype bfloat16]
[--quantization auto] [--batches 1,8] [--context 256] [--iters 20] [--repeats 3] [--threads N]
[--clock wall|cpu] [--verify-tokens 3,5,8] [--kv-cache-dtype auto|int8|fp8]
[--kernel-choice auto|table|PATH] [--dense-weight-memory auto|SIZE]` (`--kv-cache-dtype`: the
cache's element type, as the engine's flag, its bytes in the read floor; `--kernel-choice` and
`--dense-weight-memory`: the engine's flags, a quantized layer's kernel and the budget of the
dense copies some kernels multiply). `--verify-tokens`: after each batch's table, the step with
k + 1 query tokens per sequence (a speculative verify step) against the decode step, both with
the C decode layers on, timed in turns, and the verify step's limit (its floors as
above, every linear on all batch x (k + 1) rows) over the measured decode step: above 1.5x, a
verify step of 1.5x a decode step is out of reach on this machine whatever the kernels do.
Result: the limits' table, then per batch size a line with its floors and a Markdown table (ms
per step by part, eager, fused and layer, and the step's % of its limit).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from common.bench import limits as machine_limits
from common.bench.step_cost import decode_read_bytes, step_floor
from common.config import EngineConfig
from common.kernels import cpu_layer, cpu_ops
from common.model import llama
from common.model.model_files import resolve_model
from common.model.model_runner import ModelRunner, kv_bytes_per_block
from common.model.quant import QuantLinear
from common.model.weights import iter_weights

clock = time.perf_counter  # --clock cpu: time.process_time
PARTS = ["linear", "attention kernel", "norm + residual", "attention glue", "mlp glue", "other"]


class PartTimer:
    """Exclusive wall time per part: a part's time excludes the timed parts called inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # time spent in timed children, per open frame

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.stack.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                children = self.stack.pop()
                self.totals[part] += elapsed - children
                if self.stack:
                    self.stack[-1] += elapsed

        return timed


def instrument(timer: PartTimer) -> Callable[[], None]:
    """Wrap the model's building blocks in `timer`; returns the function that unwraps them."""
    patches = [
        (llama.Linear, "forward", "linear"),
        (QuantLinear, "forward", "linear"),  # int8/int4 projections (and a quantized LM head)
        (llama.RMSNorm, "forward", "norm + residual"),
        (llama.Attention, "forward", "attention glue"),
        (llama.MLP, "forward", "mlp glue"),
        (llama.ATTENTION_BACKENDS, "torch", "attention kernel"),
    ]
    saved = [(owner, name, _get(owner, name)) for owner, name, _ in patches]
    for owner, name, part in patches:
        _set(owner, name, timer.wrap(part, _get(owner, name)))

    def undo() -> None:
        for owner, name, fn in saved:
            _set(owner, name, fn)

    return undo


def _get(owner, name: str):
    return owner[name] if isinstance(owner, dict) else getattr(owner, name)


def _set(owner, name: str, value) -> None:
    if isinstance(owner, dict):  # the attention backends are looked up in a dict per call
        owner[name] = value
    else:
        setattr(owner, name, value)


def decode_inputs(runner: ModelRunner, batch: int, context: int, tokens: int = 1):
    """`tokens` query tokens per sequence from position `context` (1: a decode step; k + 1: a
    speculative verify step of k drafts), each sequence in its own blocks."""
    blocks = (context + tokens - 1) // runner.block_size + 1
    rows = [([7] * tokens, context, list(range(i * blocks, (i + 1) * blocks)))
            for i in range(batch)]  # fmt: skip
    return runner.prepare_rows(rows)


@torch.inference_mode()
def step_ms(runner: ModelRunner, inputs, iters: int) -> float:
    ids, pos, meta = inputs
    model = runner.model
    model.compute_logits(model(ids, pos, meta))  # warm-up (and the kernel build)
    start = clock()
    for _ in range(iters):
        model.compute_logits(model(ids, pos, meta))
    return (clock() - start) / iters * 1e3


def profile_ms(runner: ModelRunner, inputs, iters: int) -> dict[str, float]:
    timer = PartTimer()
    undo = instrument(timer)
    try:
        total = step_ms(runner, inputs, iters)
    finally:
        undo()
    # the warm-up step was timed by the wrappers too: iters + 1 steps
    parts = {p: timer.totals[p] / (iters + 1) * 1e3 for p in PARTS[:-1]}
    parts["other"] = max(total - sum(parts.values()), 0.0)
    parts["step (instrumented)"] = total
    return parts


def step_without_linear_ms(runner: ModelRunner, inputs, iters: int) -> float:
    """The step with every Linear returning a cached zero tensor: all that is not the projections'
    weight streaming (the overhead this benchmark is about), measured without per-part timers."""
    zeros: dict[int, torch.Tensor] = {}
    originals = llama.Linear.forward, QuantLinear.forward

    def no_matmul(self, x: torch.Tensor) -> torch.Tensor:
        key = id(self)
        if key not in zeros or zeros[key].shape[0] != x.shape[0]:
            zeros[key] = x.new_zeros(x.shape[0], self.out_features)
        return zeros[key]

    llama.Linear.forward = QuantLinear.forward = no_matmul
    try:
        return step_ms(runner, inputs, iters)
    finally:
        llama.Linear.forward, QuantLinear.forward = originals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="auto", help="auto | none | int8 | int4")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | int8 | fp8 ...")
    parser.add_argument(
        "--kernel-choice", default="auto", help="the engine's flag: auto | table | a cpu_quant path"
    )
    parser.add_argument(
        "--dense-weight-memory", default="auto", help="the engine's flag: auto, or a size (0: none)"
    )
    parser.add_argument(
        "--verify-tokens", default="", help="comma list of k + 1: also time verify steps"
    )
    args = parser.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    batches = [int(b) for b in args.batches.split(",")]
    source = resolve_model(args.model)
    verify = [int(t) for t in args.verify_tokens.split(",") if t]
    blocks_needed = max(batches) * ((args.context + max(verify, default=1)) // 16 + 1)
    dtype = EngineConfig(dtype=args.dtype).resolved_dtype()
    kv_config = EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    kv_dtype = kv_config.resolved_kv_dtype()
    kv_bytes = blocks_needed * kv_bytes_per_block(source.hf_config, 16, kv_dtype)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=16,
        max_model_len=args.context + 16 + max(verify, default=1),
        kv_cache_memory=f"{kv_bytes // (1 << 20) + 16}MiB",
        kv_cache_dtype=args.kv_cache_dtype,
        kernel_choice=args.kernel_choice,
        dense_weight_memory=args.dense_weight_memory,
        num_threads=args.threads,
    )
    runner = ModelRunner(config, source.hf_config, iter_weights(source))
    if not cpu_ops.available():
        raise SystemExit("the fused CPU ops could not be built (no C compiler?)")
    limits = machine_limits.measure(source.hf_config)  # after the runner set the threads
    print(
        f"model {args.model}, {args.dtype}, weights {args.quantization}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, context {args.context}\n\n"
        f"{limits.describe()}"
    )
    for batch in batches:
        read = decode_read_bytes(runner.model, source.hf_config, batch, args.context, kv_dtype)
        floor = step_floor(limits, runner.model, batch, dtype, read)
        print(
            f"\nbatch {batch}: reads {read / 1e6:.1f} MB per step, read floor "
            f"{floor.read_s * 1e3:.2f} ms, compute floor {floor.compute_s * 1e3:.2f} ms "
            f"(in {'/'.join(floor.dtypes)}), limit {floor.limit_s * 1e3:.2f} ms; the cores' "
            f"floor {floor.core_s * 1e3:.2f} ms"
        )
        inputs = decode_inputs(runner, batch, args.context)
        results: dict[str, dict[str, float]] = {}
        cpu_layer.enabled = False  # the per-part timers need the per-op path
        for mode in ("eager", "fused"):
            cpu_ops.enabled = mode == "fused"
            best = min(step_ms(runner, inputs, args.iters) for _ in range(args.repeats))
            results[mode] = {"step": best, **profile_ms(runner, inputs, args.iters)}
            results[mode]["step without linear work"] = min(
                step_without_linear_ms(runner, inputs, args.iters) for _ in range(args.repeats)
            )
        cpu_ops.enabled = cpu_layer.enabled = True
        # one C call per layer: no parts to time, only the step
        best = min(step_ms(runner, inputs, args.iters) for _ in range(args.repeats))
        results["layer"] = {"step": best}
        modes = ("eager", "fused", "layer")
        print(f"\nbatch {batch} (ms per step)\n")
        print("| part | eager | fused | layer |\n|---|---:|---:|---:|")
        for part in ["step", *PARTS, "step (instrumented)", "step without linear work"]:
            cells = [f"{results[m][part]:.2f}" if part in results[m] else "-" for m in modes]
            print(f"| {part} | {' | '.join(cells)} |")
        print(f"| % of limit | {shares(floor.limit_s, results, modes)} |")
        if floor.core_s > floor.limit_s:  # reading takes the cores: the floors add up
            print(f"| % of the cores' floor | {shares(floor.core_s, results, modes)} |")
        if verify:
            floors = {t: step_floor(limits, runner.model, batch * t, dtype, read) for t in verify}
            verify_table(runner, batch, args, results["layer"]["step"], verify, floors)


def shares(floor_s: float, results: dict, modes: tuple[str, ...]) -> str:
    """A floor as % of each mode's step, as table cells (a tiny model's step is a fraction of a
    percent of its limit: decimals below 10%)."""
    values = [100 * floor_s * 1e3 / results[m]["step"] for m in modes]
    return " | ".join(f"{v:.2f}%" if v < 10 else f"{v:.0f}%" for v in values)


def verify_table(
    runner: ModelRunner, batch: int, args, decode_ms: float, verify: list, floors: dict
) -> None:
    """A verify step of k + 1 tokens per sequence against the decode step (both as served: the C
    decode layers on), timed alternately so that a busy moment hits both alike; beside them the
    verify step's own limit (`floors[tokens]`: its weights and K/V read once, every linear, the
    LM head included, on all its rows at the best measured rate of the dtype it computes in) as
    a multiple of the measured decode step: where that exceeds 1.5x, no kernel reaches a verify
    step of 1.5x a decode step on this machine; and its cores' floor (common.bench.limits) the
    same way."""
    one = decode_inputs(runner, batch, args.context)
    print(f"\nbatch {batch}: verify steps (k + 1 tokens per sequence) vs the decode step\n")
    print(
        "| tokens | verify ms | decode ms | ratio | verify limit ms (in) | limit / decode "
        "| cores' floor / decode |\n|---:|---:|---:|---:|---:|---:|---:|"
    )
    for tokens in verify:
        many = decode_inputs(runner, batch, args.context, tokens)
        t_many, t_one = float("inf"), decode_ms
        for _ in range(args.repeats):
            t_many = min(t_many, step_ms(runner, many, args.iters))
            t_one = min(t_one, step_ms(runner, one, args.iters))
        floor = floors[tokens]
        print(
            f"| {tokens} | {t_many:.2f} | {t_one:.2f} | {t_many / t_one:.2f}x "
            f"| {floor.limit_s * 1e3:.2f} ({'/'.join(floor.dtypes)}) "
            f"| {floor.limit_s * 1e3 / t_one:.2f}x | {floor.core_s * 1e3 / t_one:.2f}x |"
        )


if __name__ == "__main__":
    main()
