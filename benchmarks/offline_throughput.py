"""Offline throughput and single-stream latency: pdserve's in-process engine vs HF transformers.

Runs, for each dtype and in the same process, the same random prompts through
  - pdserve's `Engine.generate` (continuous batching, all requests at once),
  - transformers `generate` with static batches of 8 prompts,
  - transformers `generate` one prompt at a time (on `--hf-requests` of the prompts: it is slow),
then a single-stream inter-token latency for pdserve (one request alone, each decode step after the
first token) and transformers batch 1 ((total - TTFT) / (tokens - 1), TTFT from a
max_new_tokens=1 call). Prompts are distinct random token ids, so pdserve's prefix cache has
nothing to reuse. Ratios, not absolute times, are the result: the machines are shared and noisy.
On the CPU pdserve's rows also carry their fraction of the machine's limits (common.bench.limits,
measured in this process): throughput as % of the ceiling (output tokens / the summed limits of
one prefill of every prompt and output_len - 1 decode steps of all of them at the mean context,
common.bench.step_cost.generate_floor_s), and where it is lower, as % of the cores' ceiling (each
step at the higher of its limit and its cores' floor: where one thread cannot stream memory by
itself, reading the KV cache and multiplying the weights cannot overlap), the single-stream ITL
as % of a decode step's limit.

    python benchmarks/offline_throughput.py [--dtypes float32,bfloat16] [--num-requests 64]
        [--prompt-len 256] [--output-len 128] [--hf-requests 8] [--skip-hf] [--threads N]
        [--json PATH] [--seed 0] [--kv-cache-dtype auto|int8|fp8|...]

The Markdown tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# transformers' GGUF loader draws a tqdm bar per load; tqdm reads this when it is first imported.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.bench import limits as machine_limits  # noqa: E402
from common.bench.step_cost import decode_floor, generate_floor_s  # noqa: E402
from common.config import OFFLINE_DEFAULTS, EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model.model_files import resolve_model  # noqa: E402
from common.runtime.malloc import keep_step_buffers  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

HF_STATIC_BATCH = 8
TARGET_RATIO_VS_HF_STATIC = 6.0
TARGET_ITL_MS = 12.0  # single stream, bfloat16
MIN_TOKEN_ID = 100  # skip the special tokens at the start of the vocabulary


@dataclass
class ThroughputRow:
    dtype: str
    system: str
    num_requests: int
    output_tokens: int
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class LatencyRow:
    dtype: str
    system: str
    itl_median_ms: float
    itl_p90_ms: float
    ttft_ms: float
    note: str = ""


def log(msg: str) -> None:
    print(f"[offline_throughput] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100])."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def random_prompts(n: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of uniform random ids in [MIN_TOKEN_ID, vocab); distinct, so no shared prefix."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(MIN_TOKEN_ID, vocab_size, (n, prompt_len), generator=gen)
    prompts = ids.tolist()
    assert len({tuple(p[:16]) for p in prompts}) == n, "random prompts share a first block"
    return prompts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- pdserve -------------------------------------------------------------------------------------


def run_pdserve(
    dtype: str,
    prompts: list[list[int]],
    itl_prompt: list[int],
    output_len: int,
    threads: int,
    limits: machine_limits.Limits | None,
    kv_cache_dtype: str = "auto",
) -> tuple[ThroughputRow, LatencyRow, dict[str, float]]:
    log(f"pdserve {dtype}: loading engine")
    engine = Engine(  # scheduled as `pdserve run-batch` schedules (OFFLINE_DEFAULTS)
        EngineConfig(
            model="default", dtype=dtype, kv_cache_memory="2GiB", num_threads=threads,
            kv_cache_dtype=kv_cache_dtype, **OFFLINE_DEFAULTS,
        )
    )  # fmt: skip
    device = engine.runner.device
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if device.type == "cpu":  # as run-batch and the workers do (process-wide: HF's runs too)
        keep_step_buffers()
    engine.warm_up()  # as `pdserve run-batch` and the workers start (--warm-up)

    log(f"pdserve {dtype}: {len(prompts)} requests")
    hits_before = engine.stats()["prefix_cache_hits_total"]
    sync(device)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    cache = {"prefix_cache_hit_tokens": stats["prefix_cache_hits_total"] - hits_before}
    out_tokens = sum(s.num_output_tokens for s in seqs)
    assert out_tokens == len(prompts) * output_len, "pdserve stopped a request early"
    throughput = ThroughputRow(dtype, "pdserve", len(prompts), out_tokens, seconds)
    model, cfg, act = engine.runner.model, resolve_model("default").hf_config, engine.runner.dtype
    kv = engine.runner.kv_dtype
    if limits is not None:
        n, prompt_len = len(prompts), len(prompts[0])
        floor_s = generate_floor_s(limits, model, cfg, act, n, prompt_len, output_len, kv)
        throughput.note = f"{100 * floor_s / seconds:.0f}% of ceiling ({out_tokens / floor_s:.0f})"
        cores_s = generate_floor_s(limits, model, cfg, act, n, prompt_len, output_len, kv, True)
        if cores_s > floor_s:  # reading takes the cores here: see common.bench.limits
            share, ceiling = 100 * cores_s / seconds, out_tokens / cores_s
            throughput.note += f"; {share:.0f}% of the cores' ceiling ({ceiling:.0f})"

    log(f"pdserve {dtype}: single-stream latency")
    engine.add_request("itl", itl_prompt, params)
    t_start = time.perf_counter()
    token_times = []
    while engine.has_unfinished():
        outputs = engine.step()
        sync(device)
        if any(o.request_id == "itl" for o in outputs):
            token_times.append(time.perf_counter())
    assert len(token_times) == output_len
    itls_ms = [(b - a) * 1e3 for a, b in zip(token_times, token_times[1:])]
    latency = LatencyRow(
        dtype,
        "pdserve",
        statistics.median(itls_ms) if itls_ms else 0.0,
        percentile(itls_ms, 90) if itls_ms else 0.0,
        (token_times[0] - t_start) * 1e3,
        note=f"each of the {len(itls_ms)} decode steps after the first token",
    )
    if limits is not None and itls_ms:
        step = decode_floor(limits, model, cfg, 1, len(itl_prompt) + output_len // 2, act, kv)
        latency.note += f"; {100 * step.limit_s * 1e3 / latency.itl_median_ms:.0f}% of limit"
    del engine, seqs
    gc.collect()
    return throughput, latency, cache


# --- transformers --------------------------------------------------------------------------------


def load_hf_model(dtype: str, device: torch.device):
    from transformers import AutoModelForCausalLM, GgufConfig

    source = resolve_model("default")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    # Dequantize to a dense model in `dtype`, as pdserve does: with the `kernels` package installed
    # transformers would otherwise keep the GGUF blocks packed and compute in float32.
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent),
        gguf_file=source.path.name,
        dtype=torch_dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    return model.to(device).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """One generate call on equal-length prompts; returns the number of new tokens."""
    device = model.device
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # ignore eos: every request makes exactly new_tokens
            do_sample=False,
            pad_token_id=pad_id,
        )
    sync(device)
    made = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    assert made == new_tokens * len(prompts), "transformers stopped early"
    return made


def run_hf(
    dtype: str,
    prompts: list[list[int]],
    warmup_prompt: list[int],
    output_len: int,
    hf_requests: int,
    device: torch.device,
) -> tuple[list[ThroughputRow], LatencyRow]:
    log(f"transformers {dtype}: loading model")
    model = load_hf_model(dtype, device)
    eos = model.generation_config.eos_token_id
    pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    # Quiet the per-call "setting pad_token_id" style notices; the numbers do not depend on them.
    model.generation_config.pad_token_id = pad_id
    hf_generate(model, [warmup_prompt] * HF_STATIC_BATCH, 4, pad_id)
    hf_generate(model, [warmup_prompt], 4, pad_id)

    log(f"transformers {dtype}: static batch {HF_STATIC_BATCH}, {len(prompts)} requests")
    t0 = time.perf_counter()
    made = 0
    for i in range(0, len(prompts), HF_STATIC_BATCH):
        made += hf_generate(model, prompts[i : i + HF_STATIC_BATCH], output_len, pad_id)
    static = ThroughputRow(
        dtype,
        f"transformers static {HF_STATIC_BATCH}",
        len(prompts),
        made,
        time.perf_counter() - t0,
    )

    single = prompts[:hf_requests]
    log(f"transformers {dtype}: batch 1, {len(single)} requests (plus a TTFT call each)")
    gen_s, ttfts_s, itls_ms, made = 0.0, [], [], 0
    for p in single:
        t0 = time.perf_counter()
        hf_generate(model, [p], 1, pad_id)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        made += hf_generate(model, [p], output_len, pad_id)
        total = time.perf_counter() - t0
        gen_s += total
        ttfts_s.append(ttft)
        if output_len > 1:
            itls_ms.append((total - ttft) / (output_len - 1) * 1e3)
    batch1 = ThroughputRow(
        dtype,
        "transformers batch 1",
        len(single),
        made,
        gen_s,
        note=f"first {len(single)} of the requests only",
    )
    latency = LatencyRow(
        dtype,
        "transformers batch 1",
        statistics.median(itls_ms) if itls_ms else 0.0,
        percentile(itls_ms, 90) if itls_ms else 0.0,
        statistics.median(ttfts_s) * 1e3,
        note=f"(total - TTFT) / (tokens - 1) per request, over {len(itls_ms)} requests",
    )
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [static, batch1], latency


# --- report --------------------------------------------------------------------------------------


def ratio_vs_static(rows: list[ThroughputRow], row: ThroughputRow) -> float | None:
    base = [r for r in rows if r.dtype == row.dtype and r.system.startswith("transformers static")]
    if not base or base[0].tokens_per_s == 0:
        return None
    return row.tokens_per_s / base[0].tokens_per_s


def print_report(
    machine: dict,
    args: argparse.Namespace,
    rows: list[ThroughputRow],
    lat: list[LatencyRow],
    cache: dict[str, dict[str, float]],
    limits: machine_limits.Limits | None,
) -> None:
    print("# Offline throughput: pdserve vs transformers\n")
    print(
        f"machine: {machine['cpu_cores']} CPU cores ({machine['threads']} torch threads), "
        f"device {machine['device']}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, python {machine['python']}"
    )
    print(
        f"workload: {args.num_requests} requests x {args.prompt_len} random prompt tokens "
        f"(seed {args.seed}), {args.output_len} output tokens each (ignore_eos, greedy); "
        "prompts are distinct, so the prefix cache does not help "
        + ", ".join(
            f"({d}: {int(c['prefix_cache_hit_tokens'])} hit tokens)" for d, c in cache.items()
        )
    )
    print(
        f"targets: pdserve >= {TARGET_RATIO_VS_HF_STATIC:g}x transformers static "
        f"{HF_STATIC_BATCH}; single-stream ITL <= {TARGET_ITL_MS:g} ms in bfloat16\n"
    )
    if limits is not None:
        print(limits.describe() + "\n")
    print(
        "| dtype | system | requests | output tokens | seconds | output tok/s | vs HF static 8 "
        "| target | note |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        ratio = ratio_vs_static(rows, r)
        target = ""
        if r.system == "pdserve" and ratio is not None:
            met = ratio >= TARGET_RATIO_VS_HF_STATIC
            target = f">= {TARGET_RATIO_VS_HF_STATIC:g}x: {'met' if met else 'NOT met'}"
        print(
            f"| {r.dtype} | {r.system} | {r.num_requests} | {r.output_tokens} | {r.seconds:.2f} "
            f"| {r.tokens_per_s:.1f} | {f'{ratio:.2f}x' if ratio is not None else '-'} "
            f"| {target} | {r.note} |"
        )
    print("\n## Single-stream latency\n")
    print("| dtype | system | ITL median ms | ITL p90 ms | TTFT ms | target | note |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in lat:
        target = ""
        if r.dtype == "bfloat16" and r.system == "pdserve":
            met = r.itl_median_ms <= TARGET_ITL_MS
            target = f"<= {TARGET_ITL_MS:g} ms: {'met' if met else 'NOT met'}"
        print(
            f"| {r.dtype} | {r.system} | {r.itl_median_ms:.2f} | {r.itl_p90_ms:.2f} "
            f"| {r.ttft_ms:.1f} | {target} | {r.note} |"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--hf-requests", type=int, default=8, help="requests for the slow transformers batch-1 run"
    )
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: all cores)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="pdserve's KV cache element type (as the engine's flag: auto, int8, fp8, ...)",
    )
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16")]
    if bad:
        p.error(f"--dtypes: float32 and bfloat16 only, not {bad}")
    if min(args.num_requests, args.prompt_len, args.output_len, args.hf_requests) < 1:
        p.error("--num-requests, --prompt-len, --output-len and --hf-requests must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or cores or 1
    torch.set_num_threads(threads)
    device = EngineConfig().resolved_device()

    import transformers

    transformers.utils.logging.disable_progress_bar()
    machine = {
        "cpu_cores": cores,
        "threads": threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    vocab_size = int(resolve_model("default").hf_config.vocab_size)
    # Request prompts, then one for pdserve's single-stream run and a short warm-up prompt: all
    # distinct, so neither warm-up nor latency run leaves blocks the timed requests could reuse.
    prompts = random_prompts(args.num_requests + 2, args.prompt_len, vocab_size, args.seed)
    itl_prompt, warmup_prompt = prompts[-2], prompts[-1][:16]
    prompts = prompts[: args.num_requests]

    limits = None
    if device.type == "cpu":  # the matmul rates are the CPU's; a GPU run reports none
        log("measuring the machine's limits")
        limits = machine_limits.measure(resolve_model("default").hf_config)
    rows: list[ThroughputRow] = []
    lat: list[LatencyRow] = []
    cache: dict[str, dict[str, float]] = {}
    for dtype in args.dtypes:
        tp, lr, cache[dtype] = run_pdserve(
            dtype, prompts, itl_prompt, args.output_len, threads, limits, args.kv_cache_dtype
        )
        rows.append(tp)
        lat.append(lr)
        if not args.skip_hf:
            hf_rows, hf_lat = run_hf(
                dtype, prompts, warmup_prompt, args.output_len, args.hf_requests, device
            )
            rows.extend(hf_rows)
            lat.append(hf_lat)

    print_report(machine, args, rows, lat, cache, limits)
    if args.json:
        result = {
            "machine": machine,
            "limits": limits.as_dict() if limits is not None else None,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "throughput": [
                {
                    **asdict(r),
                    "tokens_per_s": r.tokens_per_s,
                    "ratio_vs_hf_static_8": ratio_vs_static(rows, r),
                }
                for r in rows
            ],
            "latency": [asdict(r) for r in lat],
            "prefix_cache": cache,
            "targets": {
                "ratio_vs_hf_static_8": TARGET_RATIO_VS_HF_STATIC,
                "itl_ms_bfloat16": TARGET_ITL_MS,
            },
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
