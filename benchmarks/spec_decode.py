"""Speculative decoding: no speculation vs `ngram` vs `draft` (early exit) on the default model.

In one process, for each workload and batch size, the same greedy chat requests run through an
in-process `Engine` per method:
  - `none`: plain decoding, the baseline,
  - `ngram`: prompt lookup (`--num-speculative-tokens`, `--prompt-lookup-min/max`),
  - `draft`: the target's first `--draft-layers` layers plus its norm and head (early exit).
Workloads: `repetitive` (the answer must copy a code snippet from the prompt with a small edit),
`verbatim` (the same snippets, to be repeated unchanged: the most a prompt can ask to copy) and
`chat` (open questions, little to copy). Batch 1 runs the requests one after the other, batch 8 all
at once. The engines are loaded together and take turns on each case, `--repeats` times, each
keeping its fastest run (the machines are shared and noisy). Each engine first runs every case
untimed with 4 output tokens (warm-up; the prompts' KV then comes from the prefix cache), so the
timed runs measure decoding, the part speculation changes. Reported: output tokens/s, mean accepted
length (tokens a verifying sequence gains per step: 1 + accepted drafts / drafts), speedup over
`none` in the same run, how many requests' outputs equal `none`'s (greedy: all of them in
float32; bfloat16 may flip near-ties), and for `ngram` its bound on these outputs (`ngram_bound`:
the speedup if a verify step cost no more than a decode step; what the model's own outputs allow
prompt lookup to gain, whatever the kernels do).

    python benchmarks/spec_decode.py [--model default] [--dtype bfloat16] [--max-tokens 160]
        [--num-speculative-tokens 4] [--draft-layers 8] [--speculative-disable-by-batch-size N]
        [--no-speculative-adaptive]
        [--methods none,ngram,draft]
        [--workloads repetitive,verbatim,chat] [--batch-sizes 1,8] [--repeats 2] [--threads N]
        [--quick]
        [--json PATH]

`--quick` (3 requests per batch-1 run, 24 tokens) only checks that it works. The Markdown table
goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.api.tokenizer import Tokenizer  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.spec.governor import mean_accepted_length  # noqa: E402
from common.engine.spec.proposers import ngram_propose  # noqa: E402
from common.model.model_files import resolve_model  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

SNIPPETS = [
    (
        "def total_price(items, tax_rate):\n"
        "    subtotal = 0\n"
        "    for item in items:\n"
        "        subtotal += item.price * item.quantity\n"
        "    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n",
        "Rename the function to compute_total and the variable subtotal to net.",
    ),
    (
        "def find_user(users, name):\n"
        "    for user in users:\n"
        "        if user.name == name:\n"
        "            return user\n"
        "    return None\n",
        "Make the comparison case-insensitive.",
    ),
    (
        "class Counter:\n"
        "    def __init__(self):\n"
        "        self.count = 0\n"
        "\n"
        "    def increment(self):\n"
        "        self.count += 1\n"
        "        return self.count\n"
        "\n"
        "    def reset(self):\n"
        "        self.count = 0\n",
        "Add a method decrement that lowers the count by one.",
    ),
    (
        "def average(values):\n"
        "    if not values:\n"
        "        return 0.0\n"
        "    total = sum(values)\n"
        "    return total / len(values)\n",
        "Rename values to numbers everywhere.",
    ),
]
CHAT_QUESTIONS = [
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a weekend trip near the mountains.",
    "What are the pros and cons of working from home?",
    "Write a short poem about autumn leaves.",
    "How do I make a good cup of tea?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a healthy breakfast and explain why it is healthy.",
    "Describe the plot of a mystery story set on a train.",
]


@dataclass
class Row:
    workload: str
    batch: int
    method: str
    requests: int
    output_tokens: int
    seconds: float
    mean_accepted_length: float
    same_as_none: int
    speedup: float = 0.0
    bound: float = 0.0  # ngram: ngram_bound's figure on none's outputs

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def ngram_bound(
    prompts: list[list[int]], outputs: list[list[int]], k: int, min_n: int, max_n: int
) -> float:
    """The most n-gram speculation can gain on these greedy outputs: output tokens / target
    steps, replaying each output with prompt lookup drafting before every step (as the engine's
    proposer does) and a step gaining its drafts up to the first that differs from the output,
    plus one token. The speedup if a verify step cost no more than a decode step."""
    tokens = steps = 0
    for prompt, out in zip(prompts, outputs):
        i = 0
        while i < len(out):
            drafts = ngram_propose(prompt + out[:i], k, min_n, max_n)
            kept = 0
            while kept < len(drafts) and i + kept < len(out) and drafts[kept] == out[i + kept]:
                kept += 1
            i += kept + 1
            steps += 1
        tokens += len(out)
    return tokens / steps if steps else 0.0


def log(msg: str) -> None:
    print(f"[spec_decode] {msg}", file=sys.stderr, flush=True)


def workload_prompts(tokenizer: Tokenizer, name: str, n: int) -> list[list[int]]:
    if name == "repetitive":
        texts = [
            f"Here is some Python code:\n\n```python\n{code}```\n\n{edit} Reply with the whole "
            "updated code only."
            for code, edit in SNIPPETS
        ]
    elif name == "verbatim":
        texts = [
            f"Here is some Python code:\n\n```python\n{code}```\n\nRepeat this code exactly as "
            "it is, with no changes and no explanation."
            for code, _ in SNIPPETS
        ]
    else:
        texts = list(CHAT_QUESTIONS)
    texts = [texts[i % len(texts)] for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def engine_config(args: argparse.Namespace, method: str) -> EngineConfig:
    extra: dict = {}
    if method != "none":
        extra = dict(
            speculative=method,
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
            speculative_adaptive=args.speculative_adaptive,
        )
    if method == "ngram":
        extra.update(
            prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max
        )
    elif method == "draft":
        extra.update(draft_layers=args.draft_layers)
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory="2GiB",
        num_threads=args.threads,
        # every engine prefills the same prompts in the same steps: a chunk measured from each
        # engine's own step times could differ, and how many rows a step has picks the kernels
        # (int8 GEMM or dense), so "same output as none" would test chunking, not speculation
        prefill_chunk="off",
        **extra,
    )


def run(engine: Engine, prompts: list[list[int]], batch: int, max_tokens: int):
    """(outputs, seconds, stats delta) of the prompts, `batch` at a time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = engine.stats()
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += [s.output_token_ids for s in engine.generate(prompts[i : i + batch], params)]
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in after if k.endswith("_total")}
    return outputs, seconds, delta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="the engine flag (default: its own, 2 on CPU; 0 = draft at every batch size)",
    )
    parser.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine flag: pause drafting while it measures slower than plain decoding",
    )
    parser.add_argument("--methods", default="none,ngram,draft")
    parser.add_argument("--workloads", default="repetitive,chat")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--batch1-requests", type=int, default=4, help="requests per batch-1 run")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per case and method")
    parser.add_argument("--quick", action="store_true", help="3 batch-1 requests, 24 tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.batch1_requests = 24, 3
    methods = args.methods.split(",")
    workloads = args.workloads.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    tokenizer = Tokenizer.from_source(resolve_model(args.model))
    cases = {
        (w, b): workload_prompts(tokenizer, w, args.batch1_requests if b == 1 else b)
        for w in workloads
        for b in batch_sizes
    }
    engines = {}
    for method in methods:
        log(f"{method}: loading engine")
        engines[method] = engine = Engine(engine_config(args, method))
        # untimed: first-call costs, and the prompts' KV into the prefix cache, so that the timed
        # runs measure decoding, what speculation changes
        for (_, batch), prompts in cases.items():
            run(engine, prompts, batch, 4)
    rows: list[Row] = []
    for (workload, batch), prompts in cases.items():
        # methods take turns, each keeping its fastest repeat: the machine is shared and noisy
        best: dict[str, tuple[list[list[int]], float, dict[str, float]]] = {}
        for repeat in range(args.repeats):
            for method in methods:
                log(f"{method}: {workload} batch {batch}, {len(prompts)} requests ({repeat + 1})")
                outputs, seconds, delta = run(engines[method], prompts, batch, args.max_tokens)
                if method not in best or seconds < best[method][1]:
                    best[method] = (outputs, seconds, delta)
        ref = best.get("none")
        for method in methods:
            outputs, seconds, delta = best[method]
            row = Row(
                workload,
                batch,
                method,
                len(prompts),
                sum(len(o) for o in outputs),
                seconds,
                mean_accepted_length(delta),
                sum(a == b for a, b in zip(outputs, ref[0])) if ref else 0,
            )
            if ref:
                row.speedup = row.tokens_per_s / (sum(len(o) for o in ref[0]) / ref[1])
                if method == "ngram":
                    row.bound = ngram_bound(
                        prompts, ref[0], args.num_speculative_tokens, args.prompt_lookup_min,
                        args.prompt_lookup_max,
                    )  # fmt: skip
            rows.append(row)
    del engines
    gc.collect()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print(
        f"model {args.model}, {args.dtype}, greedy, max {args.max_tokens} tokens, "
        f"k={args.num_speculative_tokens}, ngram {args.prompt_lookup_min}-"
        f"{args.prompt_lookup_max}, draft = first {args.draft_layers} layers\n"
    )
    print(
        "| workload | batch | method | requests | output tokens | s | output tok/s "
        "| mean accepted length | speedup vs none | same output as none | n-gram bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.workload, r.batch, methods.index(r.method))):
        print(
            f"| {r.workload} | {r.batch} | {r.method} | {r.requests} | {r.output_tokens} "
            f"| {r.seconds:.2f} | {r.tokens_per_s:.1f} | "
            f"{r.mean_accepted_length:.2f} | {r.speedup:.2f}x | {r.same_as_none}/{r.requests} | "
            f"{f'{r.bound:.2f}x' if r.bound else '-'} |"
        )
    print(
        "\nn-gram bound: output tokens / target steps when drafts are looked up before every step "
        "of none's outputs and a step keeps them up to the first wrong one (plus one token): the "
        "speedup if verifying cost no more than a decode step, an upper bound for ngram's."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
