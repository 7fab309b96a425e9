"""Weight formats on the default model, same process, same prompts: bf16 vs int8 vs int4 (Q4_1).

Formats (all from the default GGUF, so the weights are the same up to their format):
  bf16   --quantization none: everything dequantized to --dtype (as before native int4/int8)
  int8   the Q4_1 projections dequantized, then round-to-nearest int8 per channel
         (--quantization int8 on a 16-bit checkpoint)
  int4   --quantization auto: the file's Q4_1 blocks served natively (int4, groups of 32)
The embedding and the tied LM head are the file's Q8_0 (int8, groups of 32) in int8 and int4,
dequantized in bf16. For each format: weight memory; bytes read per decode token (projections,
LM head, the K/V of the context) and the read floor they set; single-stream inter-token latency
(in-process engine, the median decode step after the first token) as a % of its limit; prefill
rate (prompt tokens per second for the batch-8 prompts, each generating one token); output
throughput at batch 8 and 64; each rate with its % of the ceiling; perplexity on
benchmarks/data/calibration.txt; greedy agreement with bf16 (share of output tokens before the
first divergence, over the agreement prompts).
Limits (common.bench.limits, measured in this process; floors from common.bench.step_cost): a
step's limit is the larger of its read floor (bytes read / read-only bandwidth) and its compute
floor (each linear's FLOPs / the best rate of the dtype it computes in at that batch); "% of
limit" = limit / measured time, a rate's "% of ceiling" = rate / (tokens / summed step limits of
the same work: the prefill, then each decode step at its mean context).
With `--http` each format is also streamed through a colocated pdserve (router + one decode
worker) and with `--llama-server PATH` also through llama.cpp's server on the same GGUF: same
prompt, same client (common.bench.client), inter-token latency = gaps between streamed chunks.

    python benchmarks/quantization.py [--formats bf16,int8,int4] [--threads N] [--quick]
        [--prompt-len 256] [--output-len 128] [--http] [--llama-server PATH] [--json PATH]

Markdown on stdout, progress on stderr. Timings are noisy on shared machines: compare ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.api.tokenizer import Tokenizer  # noqa: E402
from common.bench import limits as machine_limits  # noqa: E402
from common.bench.step_cost import (  # noqa: E402
    decode_floor,
    decode_read_bytes,
    generate_floor_s,
    linears,
    weight_bytes,
)
from common.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.model.model_files import resolve_model  # noqa: E402
from common.model.quant import QuantizedTensor  # noqa: E402
from common.model.weights import iter_weights  # noqa: E402
from common.runtime.launcher import LocalCluster, WorkerSpec  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

CALIBRATION = Path(__file__).parent / "data" / "calibration.txt"
FORMATS = {"bf16": "none", "int8": "int8", "int4": "auto"}


def log(msg: str) -> None:
    print(f"[quantization] {msg}", file=sys.stderr, flush=True)


def weights_for(fmt: str, source):
    """int8 starts from the dequantized projections (the file holds int4); others as stored."""
    for name, tensor in iter_weights(source):
        if fmt == "int8" and isinstance(tensor, QuantizedTensor) and "embed_tokens" not in name:
            tensor = tensor.dequantize()
        yield name, tensor


def model_bytes(model) -> tuple[int, int]:
    """(all weight bytes, weight bytes one decode token reads: projections + LM head)."""
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return total, sum(weight_bytes(m) for _, m in linears(model))


def single_stream_itl(engine: Engine, prompt: list[int], output_len: int) -> list[float]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request("itl", prompt, params)
    times = []
    while engine.has_unfinished():
        engine.step()
        times.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


def _generate_timed(engine: Engine, prompts: list[list[int]], max_tokens: int):
    """(the finished sequences, seconds) of one greedy `generate` over the prompts."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    seqs = engine.generate(prompts, params)
    return seqs, time.perf_counter() - t


def throughput(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    seqs, seconds = _generate_timed(engine, prompts, output_len)
    return sum(s.num_output_tokens for s in seqs) / seconds


def prefill_rate(engine: Engine, prompts: list[list[int]]) -> float:
    _, seconds = _generate_timed(engine, prompts, 1)
    return sum(len(p) for p in prompts) / seconds


@torch.inference_mode()
def perplexity(engine: Engine, ids: list[int], window: int) -> float:
    """exp(mean NLL) of each window's next tokens, one prefill forward per window."""
    runner = engine.runner
    blocks = list(range(math.ceil(window / runner.block_size)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        inp, pos, meta = runner.prepare_rows([(chunk[:-1], 0, blocks)])
        logits = runner.model.compute_logits(runner.model(inp, pos, meta)).float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= logp[torch.arange(len(target)), target].sum().item()
        count += len(target)
    return math.exp(nll / count)


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    same = 0
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / max(1, sum(len(b) for b in ref))


def run_format(fmt: str, args, source, prompts: dict, limits) -> dict:
    log(f"{fmt}: loading")
    config = EngineConfig(
        model="default",
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        quantization=FORMATS[fmt],
        max_model_len=2048,
        enable_prefix_caching=False,  # same prompts in every phase: measure compute, not cache
    )
    engine = Engine(config, source.hf_config, weights_for(fmt, source))
    total, streamed = model_bytes(engine.runner.model)
    model, cfg, dtype = engine.runner.model, source.hf_config, engine.runner.dtype
    ctx = args.prompt_len + args.output_len // 2  # the single stream's mean context
    single = decode_floor(limits, model, cfg, 1, ctx, dtype)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(prompts["batch"][:2], warm)
    log(f"{fmt}: single stream")
    itls = single_stream_itl(engine, prompts["itl"], args.output_len)
    row = {
        "format": fmt,
        "weight_MB": total / 1e6,
        "weight_MB_per_token": streamed / 1e6,
        "read_MB_per_token": decode_read_bytes(model, cfg, 1, ctx, dtype) / 1e6,
        "read_floor_ms": single.read_s * 1e3,
        "compute_floor_ms": single.compute_s * 1e3,
        "itl_ms": statistics.median(itls),
        "itl_p90_ms": sorted(itls)[int(0.9 * (len(itls) - 1))],
        "compute_dtypes": {1: single.dtypes},
    }
    row["itl_pct_of_limit"] = 100 * single.limit_s * 1e3 / row["itl_ms"]
    log(f"{fmt}: prefill")
    b0 = args.batches[0]
    row["prefill_tok_s"] = prefill_rate(engine, prompts["batch"][:b0])
    floor_s = generate_floor_s(limits, model, cfg, dtype, b0, args.batch_prompt_len, 1)
    row["prefill_pct_of_ceiling"] = (
        100 * row["prefill_tok_s"] * floor_s / (b0 * args.batch_prompt_len)
    )
    for batch in args.batches:
        log(f"{fmt}: batch {batch}")
        rate = throughput(engine, prompts["batch"][:batch], args.batch_output_len)
        lens = (args.batch_prompt_len, args.batch_output_len)
        floor_s = generate_floor_s(limits, model, cfg, dtype, batch, *lens)
        row[f"tok_s_b{batch}"] = rate
        row[f"pct_of_ceiling_b{batch}"] = 100 * rate * floor_s / (batch * args.batch_output_len)
        mean_ctx = args.batch_prompt_len + args.batch_output_len // 2
        row["compute_dtypes"][batch] = decode_floor(
            limits, model, cfg, batch, mean_ctx, dtype
        ).dtypes
    log(f"{fmt}: greedy outputs and perplexity")
    params = SamplingParams(max_tokens=args.agree_tokens, temperature=0.0, ignore_eos=True)
    row["greedy"] = [s.output_token_ids for s in engine.generate(prompts["agree"], params)]
    row["perplexity"] = perplexity(engine, prompts["text"], args.ppl_window)
    del engine
    gc.collect()
    return row


async def _stream_one(url: str, prompt: list[int], output_len: int):
    import httpx

    from common.bench.client import send_request
    from common.bench.datasets import BenchRequest

    sink: list = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        request = BenchRequest(max_tokens=output_len, prompt=prompt)
        await send_request(client, "default", request, 0, time.perf_counter(), sink)  # warm-up
        result = await send_request(client, "default", request, 0, time.perf_counter(), sink)
    if result.error:
        raise RuntimeError(f"{url}: request failed: {result.error}")
    times = result.chunk_times_s
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


def free_port() -> int:
    """A free loopback port for llama-server (it cannot report one chosen by the OS)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pdserve_http(fmt: str, args, prompt: list[int]) -> float:
    """Median ITL of one stream through a colocated `pdserve` (router + one decode worker, as
    `pdserve up --prefill 0` runs it), with the client llama-server is measured with."""
    flags = ["--dtype", args.dtype, "--quantization", FORMATS[fmt]]
    flags += ["--kv-cache-memory", args.kv_cache_memory]
    if args.threads:
        flags += ["--num-threads", str(args.threads)]
    with LocalCluster("default", [WorkerSpec("decode", "decode-0", flags)]) as cluster:
        itls = asyncio.run(_stream_one(f"{cluster.url}/v1", prompt, args.output_len))
    return statistics.median(itls)


def run_llama_server(path: str, gguf: Path, args, prompt: list[int]) -> dict:
    import httpx

    port = free_port()
    cmd = [path, "-m", str(gguf), "--port", str(port), "-c", "2048", "-np", "1"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    log(f"llama-server: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            time.sleep(0.5)
        itls = asyncio.run(_stream_one(f"{url}/v1", prompt, args.output_len))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"format": "llama-server (Q4_1)", "http_itl_ms": statistics.median(itls)}


def make_prompts(args, tok: Tokenizer) -> dict:
    text = CALIBRATION.read_text()
    ids = tok.encode(text)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, 49000, (n,), generator=g).tolist()  # noqa: E731
    starts = range(0, len(ids) - args.agree_prompt_len, max(1, len(ids) // args.agree_prompts))
    return {
        "itl": rand(args.prompt_len),
        "batch": [rand(args.batch_prompt_len) for _ in range(max(args.batches))],
        "agree": [ids[s : s + args.agree_prompt_len] for s in starts][: args.agree_prompts],
        "text": ids[: args.ppl_tokens],
    }


def table(rows: list[dict], batches: list[int]) -> str:
    head = ["format", "weights MB", "read MB/token", "read floor ms", "compute floor ms"]
    head += ["ITL ms", "ITL p90", "ITL % of limit", "ITL ms over HTTP"]
    head += [f"prefill tok/s b{batches[0]} (% of ceiling)"]
    head += [f"tok/s b{b} (% of ceiling)" for b in batches] + ["perplexity", "greedy agree vs bf16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:

        def f(key: str, fmt: str = "{:.1f}", r: dict = r) -> str:
            return fmt.format(r[key]) if key in r else "-"

        def pct(rate: str, pct: str, fmt: str = "{:.1f}", r: dict = r) -> str:
            return f"{f(rate, fmt)} ({r[pct]:.0f}%)" if pct in r else f(rate, fmt)

        cells = [
            r["format"],
            f("weight_MB"),
            f("read_MB_per_token"),
            f("read_floor_ms", "{:.2f}"),
            f("compute_floor_ms", "{:.2f}"),
            f("itl_ms", "{:.2f}"),
            f("itl_p90_ms", "{:.2f}"),
            f("itl_pct_of_limit", "{:.0f}%"),
            f("http_itl_ms", "{:.2f}"),
            pct("prefill_tok_s", "prefill_pct_of_ceiling", "{:.0f}"),
        ]
        cells += [pct(f"tok_s_b{b}", f"pct_of_ceiling_b{b}") for b in batches]
        cells += [f("perplexity", "{:.3f}"), f("agreement", "{:.1%}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batches", default="8,64")
    p.add_argument("--batch-prompt-len", type=int, default=128)
    p.add_argument("--batch-output-len", type=int, default=32)
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--agree-prompt-len", type=int, default=64)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--ppl-window", type=int, default=256)
    p.add_argument("--llama-server", metavar="PATH", help="also measure llama.cpp's server")
    p.add_argument(
        "--http", action="store_true",
        help="also stream each format through a colocated pdserve (the llama-server client)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.output_len, args.batch_prompt_len, args.batch_output_len = (
            32,
            8,
            16,
            4,
        )
        args.batches, args.agree_prompts, args.agree_tokens, args.ppl_tokens = "2,4", 2, 8, 128
        args.ppl_window = 64
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model("default")
    prompts = make_prompts(args, Tokenizer.from_source(source))
    log("measuring the machine's limits")
    limits = machine_limits.measure(source.hf_config)
    rows = [run_format(fmt, args, source, prompts, limits) for fmt in args.formats.split(",")]
    ref = next((r for r in rows if r["format"] == "bf16"), None)
    for r in rows:
        if ref is not None:
            r["agreement"] = agreement(r["greedy"], ref["greedy"])
    if args.http or args.llama_server:
        # int8 is made here from the dequantized Q4_1 weights; the server refuses to requantize
        # a 4-bit file (`--quantization int8` on it is an error), so only bf16 and int4 stream
        for r in (r for r in rows if r["format"] != "int8"):
            log(f"{r['format']}: pdserve over HTTP")
            r["http_itl_ms"] = run_pdserve_http(r["format"], args, prompts["itl"])
    if args.llama_server:
        rows.append(run_llama_server(args.llama_server, source.path, args, prompts["itl"]))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
    machine += f"{torch.__version__}, {torch.get_num_threads()} threads"
    print(f"machine: {machine}\n\n{limits.describe()}\n")
    print(table(rows, args.batches))
    for r in rows:
        if "compute_dtypes" in r:
            by_batch = ", ".join(f"b{b} {'/'.join(d)}" for b, d in r["compute_dtypes"].items())
            print(f"\n{r['format']} computes in: {by_batch}", end="")
    print()
    if args.json:
        out = {"machine": machine, "limits": limits.as_dict(), "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
