"""Structured outputs' cost: inter-token latency with a JSON schema vs without, and compile time.

In one process, an in-process `Engine` on the default model (or, with `--tiny`, a random-weight
2-layer model over the default model's tokenizer, which shows the grammar's fixed cost against a
nearly free forward pass) decodes `batch` sampled requests at once, for each batch size:
  - `free`: no constraint (ignore_eos, so every sequence runs the whole measured window),
  - `json`: the same requests with a JSON schema (an array of objects long enough to outlast the
    window), its grammar compiled and cached by an untimed warm-up request.
Inter-token latency is the mean engine step time over the first `--steps` decode steps in which
all `batch` sequences are running (each gets one token per step), best of `--repeats` runs taken
in turns. The grammar's own work per step (bitmasks, matcher updates, unpacking the masks; timed
inside the step) is reported too: on a shared, noisy machine it is the steadier measure of the
overhead, while the difference of two step times swings with the neighbours' load. Compile time:
building the tokenizer's grammar tables (once per model), the schema's first compile, and a
cached lookup.

    python benchmarks/structured.py [--model default] [--tiny] [--batch-sizes 1,16] [--steps 24]
        [--repeats 2] [--threads N] [--greedy]

Prints a Markdown table (ms per token, overhead %) and the compile times. Target: at most 10%
slower per token once compiled. A few minutes on a laptop CPU; timings on a shared machine are
noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.api.tokenizer import Tokenizer  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.engine import sampler as sampler_module  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.grammar import GrammarCompiler, GrammarMatcher  # noqa: E402
from common.model.model_files import resolve_model  # noqa: E402
from common.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 12,
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 3, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                    "active": {"type": "boolean"},
                },
                "required": ["name", "age", "role", "active"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = "List twelve people of the team as JSON with name, age, role and active."


def build_engine(args: argparse.Namespace) -> tuple[Engine, Tokenizer]:
    source = resolve_model(args.model)
    tokenizer = Tokenizer.from_source(source)
    config = EngineConfig(
        model=args.model, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048
    )
    if not args.tiny:
        return Engine(config, eos_token_ids=tokenizer.eos_token_ids), tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=source.hf_config.vocab_size,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    weights = model.state_dict().items()
    return Engine(config, hf_config, weights, tokenizer.eos_token_ids), tokenizer


class GrammarTimer:
    """Seconds spent in the grammar's own work (bitmasks, matcher updates, mask unpacking):
    the part of a step that structured output adds, measured inside the step, so it is less
    exposed to a shared machine's noise than the difference of two step times."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for owner, name in ((GrammarMatcher, "bitmask"), (GrammarMatcher, "sync"),
                            (sampler_module, "_grammar_refusals")):  # fmt: skip
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def step_latency_ms(engine: Engine, prompt: list[int], params: SamplingParams, batch: int,
                    steps: int, timer: GrammarTimer) -> tuple[float, float]:  # fmt: skip
    """Mean step time and grammar time (ms) over the first `steps` steps where all `batch`
    sequences decode."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt, params)
    times, grammar = [], []
    while engine.has_unfinished():
        full = all(rid in engine.seqs and engine.seqs[rid].num_output_tokens > 0 for rid in ids)
        start, in_grammar = time.perf_counter(), timer.seconds
        engine.step()
        if full and len(engine.scheduler.running) == batch:
            times.append(time.perf_counter() - start)
            grammar.append(timer.seconds - in_grammar)
        if len(times) >= steps:
            for rid in ids:
                engine.abort(rid)
    if len(times) < steps // 2:
        raise SystemExit(f"only {len(times)} full steps at batch {batch}: raise max_tokens")
    return 1000 * sum(times) / len(times), 1000 * sum(grammar) / len(grammar)


def compile_times(tokenizer: Tokenizer, vocab_size: int) -> dict[str, float]:
    compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size)
    so = StructuredOutput("json", json.dumps(SCHEMA))
    start = time.perf_counter()
    assert compiler.ll_tokenizer is not None
    tables = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(so)
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(so)
    cached = time.perf_counter() - start
    return {"tokenizer_tables_s": tables, "first_compile_ms": 1000 * first,
            "cached_ms": 1000 * cached}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer model instead")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--greedy", action="store_true", help="temperature 0 instead of 0.8")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine, tokenizer = build_engine(args)
    times = compile_times(tokenizer, engine.vocab_size)
    engine.grammars = GrammarCompiler(tokenizer, vocab_size=engine.vocab_size)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    temperature = 0.0 if args.greedy else 0.8
    window = args.steps + 8
    free = SamplingParams(max_tokens=window, temperature=temperature, ignore_eos=True)
    so = StructuredOutput("json", json.dumps(SCHEMA))
    constrained = SamplingParams(max_tokens=window, temperature=temperature, structured_output=so)
    engine.generate([prompt], SamplingParams(max_tokens=8, structured_output=so))  # warm, compile

    timer = GrammarTimer()
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        best = {"free": float("inf"), "json": float("inf")}
        grammar_ms = float("inf")
        for _ in range(args.repeats):
            for name, params in (("free", free), ("json", constrained)):
                ms, in_grammar = step_latency_ms(engine, prompt, params, batch, args.steps, timer)
                best[name] = min(best[name], ms)
                if name == "json":
                    grammar_ms = min(grammar_ms, in_grammar)
                print(
                    f"batch {batch} {name}: {ms:.2f} ms/token, grammar {in_grammar:.2f} ms/step",
                    file=sys.stderr,
                )
        rows.append((batch, best["free"], best["json"], grammar_ms))

    model = "tiny random 2-layer" if args.tiny else args.model
    print(f"\nModel: {model}, {'greedy' if args.greedy else 'sampled (T=0.8)'}, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}\n")  # fmt: skip
    print("| batch | free ms/token | json schema ms/token | overhead | grammar work ms/step |")
    print("|---|---|---|---|---|")
    for batch, a, b, g in rows:
        print(f"| {batch} | {a:.2f} | {b:.2f} | {100 * (b - a) / a:+.1f}% | {g:.2f} "
              f"({100 * g / a:.1f}% of a free step) |")  # fmt: skip
    print(
        f"\nCompile: tokenizer tables {times['tokenizer_tables_s']:.2f} s (once per model), "
        f"schema first compile {times['first_compile_ms']:.1f} ms, "
        f"cached {times['cached_ms']:.3f} ms"
    )


if __name__ == "__main__":
    main()
