"""The engine's warm-up: throwaway requests through the paths a first real request takes, so
that it does not pay their one-time costs. Measured on the default model (CPU, 2 threads): a fresh
engine's first 16-token request took 445 ms against ~30 ms, the first 300-token prompt 656 ms
against 101 (weight repacking for the int8-activation kernels, the dense copies and oneDNN's first
calls for prompt-sized steps, first calls of the C kernels). The weight copies are now made when
the model runner loads, for every batch size up to the step's budget (weight_copies.prepare_copies);
these requests still take the first calls. On the CPU it then runs one decoder layer's
projections at every row count a padded prompt step can take, up to `WARM_UP_MAX_ROWS`
(CausalLM.build_padded_matmuls: oneDNN builds a matmul per row count, 20-30 ms each when a step
first met it; about 2 s in all for a 2,048-token budget), and so a separate draft model's
(`--draft-model`), whose prompt steps have the same row counts. Meanwhile a thread builds the
grammar engine's tokenizer (`GrammarCompiler.ll_tokenizer`): built by a first structured request
instead, it held the interpreter lock (0.25 s for the default model's 49k tokens, more for larger
vocabularies) and every running stream's step waited (measured: 8 streams decoding, one step of
492 ms among steps of 8.6, the model's tokenizer loaded too). It costs the worker about 27 MiB
there. Workers run the warm-up before they register and run-batch before it reads its input
(--warm-up), through `Engine.warm_up`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from common.engine.spec.governor import ShadowDrafts, SpeculationGovernor
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.engine.engine import Engine

log = logging.getLogger(__name__)

# The long prompt: more rows than the C decode layers take (cpu_layer's DENSE_FLOOR_ROWS, 64), so
# a prompt-sized step's kernels run once; its token ids count from WARM_UP_FIRST_TOKEN
WARM_UP_PROMPT_TOKENS = 96
WARM_UP_FIRST_TOKEN = 100
# oneDNN's matmuls are built for the padded row counts up to this many rows (56 counts, ~2 s on
# the default model): a larger --max-num-batched-tokens would cost ~35 ms a count more at start
# (8,192: ~9 s) for steps that seldom come; theirs are built when first met
WARM_UP_MAX_ROWS = 2048


def warm_up(engine: Engine) -> float:
    """Run the warm-up requests on `engine`, before its first request. Leaves no trace a client
    can see: prefix caching is off meanwhile (no blocks cached, no KV events), and the counters
    (stats), the speculation governor and the KV tier's measured costs are as they were; the
    prompt-step budget keeps these steps as its warm-up ones (step_budget: one-time costs, not
    fitted). Returns the seconds it took."""
    if engine.seqs or engine.held or engine.reserved:
        raise RuntimeError("warm_up runs before the first request")
    start = time.perf_counter()
    if engine.max_model_len < 8:  # no room for its prompts and tokens: nothing worth warming
        return 0.0
    # a prompt step of more rows than the C decode layers take (the dense path's batches),
    # then decode steps of two rows and of one
    long_len = max(1, min(WARM_UP_PROMPT_TOKENS, engine.max_model_len - 4))
    short_len = max(1, min(8, long_len))
    span = max(1, engine.vocab_size - WARM_UP_FIRST_TOKEN)
    first = min(WARM_UP_FIRST_TOKEN, engine.vocab_size - 1)
    long_prompt = [first + (7 * i) % span for i in range(long_len)]
    short_prompt = [first + (11 * i + 3) % span for i in range(short_len)]
    e, scheduler, pool = engine, engine.scheduler, engine.pool
    counters = (
        e.num_steps, e.num_prefill_tokens, e.num_drafts, e.num_draft_tokens,
        e.num_accepted_tokens, scheduler.num_preemptions, pool.query_tokens, pool.hit_tokens,
    )  # fmt: skip
    caching = engine.block_manager.enable_prefix_caching
    engine.block_manager.enable_prefix_caching = False
    grammar = threading.Thread(target=_build_grammar_tokenizer, args=(engine,), name="grammar")
    grammar.start()
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.generate([long_prompt, short_prompt], params)
        engine.generate(
            [short_prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        if engine.runner.device.type == "cpu":  # oneDNN's matmul for each padded row count
            rows = min(engine.config.max_num_batched_tokens, WARM_UP_MAX_ROWS)
            engine.runner.model.build_padded_matmuls(rows)
            if engine.runner.draft_model is not None:  # a separate draft prefills prompts too
                engine.runner.draft_model.build_padded_matmuls(rows)
    finally:
        grammar.join()
        engine.block_manager.enable_prefix_caching = caching
        (
            e.num_steps, e.num_prefill_tokens, e.num_drafts, e.num_draft_tokens,
            e.num_accepted_tokens, scheduler.num_preemptions, pool.query_tokens, pool.hit_tokens,
        ) = counters  # fmt: skip
        if engine.governor is not None:
            engine.governor = SpeculationGovernor()
            engine.shadow = ShadowDrafts(engine._free_draft)
        if engine.tier is not None:
            engine.tier.costs = type(engine.tier.costs)()
    return time.perf_counter() - start


def _build_grammar_tokenizer(engine: Engine) -> None:
    """Build the grammar engine's tokenizer now, not on the first structured request."""
    try:
        engine.grammars.ll_tokenizer  # noqa: B018 (built on first access)
    except ValueError as e:  # no usable tokenizer: structured requests will say so, one by one
        log.info("structured outputs unavailable: %s", e)
