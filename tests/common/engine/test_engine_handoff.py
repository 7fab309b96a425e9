"""Engine disaggregation hooks: hold blocks after prefill, reserve + admit on the decode side."""

from __future__ import annotations

import dataclasses

from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import GREEDY, assert_block_pool_full, make_engine, prompts


def handoff(prefill, decode, rid: str, prompt: list[int], params: SamplingParams):
    """Prefill on one engine, copy the KV (and an 8-bit cache's scales) the decode engine lacks,
    decode there."""
    cached = decode.reserve(rid, prompt, params)
    assert cached is not None
    first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    prefill.add_request(rid, prompt, first_params, hold_blocks=True)
    while rid not in prefill.held:
        prefill.step()
    held = prefill.held[rid]
    src = held.block_table
    dst = decode.reserved_block_ids(rid)
    start = cached // decode.config.block_size
    # the prompt's blocks; the decode side also holds room for the first token
    assert len(src) == -(-len(prompt) // decode.config.block_size) <= len(dst)
    pk, dk = prefill.runner.kv_cache, decode.runner.kv_cache
    dk[:, :, dst[start : len(src)]] = pk[:, :, src[start:]]
    if prefill.runner.kv_scales is not None:  # an 8-bit cache: its scales travel with it
        decode.runner.kv_scales[:, :, dst[start : len(src)]] = prefill.runner.kv_scales[
            :, :, src[start:]
        ]
    state = held.generator.get_state().numpy().tobytes() if held.generator is not None else b""
    out = decode.admit_prefilled(rid, held.output_token_ids[0], generator_state=state)
    assert prefill.release(rid)
    return cached, out


def test_handoff_matches_single_engine(tiny_llama):
    hf_model, _ = tiny_llama
    ps = prompts(4, seed=5, lengths=(9, 16, 23, 40))
    single = make_engine(hf_model)
    expected = [s.output_token_ids for s in single.generate(ps, GREEDY)]
    prefill, decode = make_engine(hf_model), make_engine(hf_model)
    for i, p in enumerate(ps):
        cached, first = handoff(prefill, decode, f"r{i}", p, GREEDY)
        assert cached == 0
        assert first.new_token_ids == expected[i][:1]
    outputs: dict[str, list[int]] = {f"r{i}": expected[i][:1] for i in range(len(ps))}
    while decode.has_unfinished():
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    assert [outputs[f"r{i}"] for i in range(len(ps))] == expected
    assert_block_pool_full(prefill)
    assert_block_pool_full(decode)


def test_seeded_sampling_continues_across_handoff(tiny_llama):
    # The prefill side's RNG state travels with the first token, so a seeded request samples the
    # same tokens disaggregated as on one engine.
    hf_model, _ = tiny_llama
    ps = prompts(2, seed=7, lengths=(11, 20))
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    expected = [s.output_token_ids for s in make_engine(hf_model).generate(ps, params)]
    prefill, decode = make_engine(hf_model), make_engine(hf_model)
    outputs = {}
    for i, p in enumerate(ps):
        _, first = handoff(prefill, decode, f"s{i}", p, params)
        outputs[f"s{i}"] = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    assert [outputs[f"s{i}"] for i in range(len(ps))] == expected


def test_decode_prefix_hit_skips_blocks(tiny_llama):
    hf_model, _ = tiny_llama
    p = prompts(1, seed=6, lengths=(30,))[0]
    prefill, decode = make_engine(hf_model), make_engine(hf_model)
    decode.generate([p], GREEDY)  # decode worker now caches 3 full blocks of this prompt
    cached, first = handoff(prefill, decode, "again", p, GREEDY)
    assert cached == 24
    tokens = first.new_token_ids
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == make_engine(hf_model).generate([p], GREEDY)[0].output_token_ids
    assert_block_pool_full(decode)


def test_reserve_refuses_when_full_and_abort_frees(tiny_llama):
    hf_model, _ = tiny_llama
    decode = make_engine(hf_model, kv_cache_memory=str(20 * 4096), max_model_len=128)
    assert decode.reserve("big", list(range(2, 130 - 2)), GREEDY) is not None
    assert decode.reserve("no-room", list(range(2, 100)), GREEDY) is None
    assert decode.pool.num_free < decode.pool.num_blocks
    assert decode.abort("big")
    assert not decode.abort("no-room")
    assert_block_pool_full(decode)
    prefill = make_engine(hf_model)
    prefill.add_request("h", [5, 6, 7], dataclasses.replace(GREEDY, max_tokens=1), hold_blocks=True)
    while "h" not in prefill.held:
        prefill.step()
    assert prefill.pool.num_free < prefill.pool.num_blocks
    assert prefill.abort("h")
    assert_block_pool_full(prefill)


def test_first_token_can_finish_the_request(tiny_llama):
    hf_model, _ = tiny_llama
    prefill, decode = make_engine(hf_model), make_engine(hf_model)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    _, out = handoff(prefill, decode, "one", [3, 4, 5, 6, 7], one)
    assert out.finished and out.finish_reason == "length"
    assert not decode.has_unfinished()
    assert_block_pool_full(decode)


def test_reserve_leaves_room_for_the_running_sequences_next_tokens(tiny_llama, monkeypatch):
    from common.engine import handoff as engine_module

    monkeypatch.setattr(engine_module, "OUTPUT_RESERVE_TOKENS", 0)  # next tokens only
    hf_model, _ = tiny_llama
    decode = make_engine(hf_model, kv_cache_memory=str(8 * 4096), max_model_len=64)
    assert decode.pool.num_blocks == 8
    decode.add_request("run", prompts(1, seed=2, lengths=(16,))[0], GREEDY)  # 2 full blocks
    decode.step()
    run = decode.seqs["run"]
    assert run.num_tokens == 17 and len(run.block_table) == 2  # its next token needs block 3
    # 6 blocks free; a 39-token prompt plus its first token needs 5: with the running
    # sequence's next block that is 6, which fits; 6 blocks more (41 + 1 tokens) would not.
    assert decode.reserve("too-big", list(range(2, 43)), GREEDY) is None
    assert decode.reserve("fits", list(range(2, 41)), GREEDY) is not None
    books = decode.block_books()
    assert books.ok and books.reserved == 5 and books.running == 2
    decode.step()  # the running sequence gets its block: no preemption
    assert decode.scheduler.num_preemptions == 0 and len(run.block_table) == 3
    assert decode.abort("fits") and decode.abort("run")
    assert_block_pool_full(decode)


def test_reserve_leaves_room_for_the_admitted_sequences_growth(tiny_llama):
    # With the growth reserve (OUTPUT_RESERVE_TOKENS, larger than these max_tokens), the same
    # reservation is refused: run grows to 40 tokens (3 blocks more), "fits" to 63 (8 blocks).
    hf_model, _ = tiny_llama
    decode = make_engine(hf_model, kv_cache_memory=str(8 * 4096), max_model_len=64)
    decode.add_request("run", prompts(1, seed=2, lengths=(16,))[0], GREEDY)
    decode.step()
    assert decode.reserve("fits", list(range(2, 41)), GREEDY) is None  # 3 + 8 > 6
    short = dataclasses.replace(GREEDY, max_tokens=1)
    assert decode.reserve("one-token", list(range(2, 18)), short) is not None  # 3 + 3
    assert decode.abort("one-token") and decode.abort("run")
    assert_block_pool_full(decode)


def test_a_retried_reservation_is_one_prefix_cache_query(tiny_llama):
    hf_model, _ = tiny_llama
    decode = make_engine(hf_model, kv_cache_memory=str(20 * 4096), max_model_len=128)
    assert decode.reserve("big", list(range(2, 126)), GREEDY) is not None
    queries = decode.stats()["prefix_cache_queries_total"]
    prompt = list(range(3, 101))
    for _ in range(5):  # the router retries while there is no room
        assert decode.reserve("later", prompt, GREEDY) is None
    assert decode.stats()["prefix_cache_queries_total"] == queries + len(prompt)
    assert decode.abort("big")
    assert decode.reserve("later", prompt, GREEDY) is not None  # room now: still the one query
    assert decode.stats()["prefix_cache_queries_total"] == queries + len(prompt)
    assert "later" not in decode.reserve_refused
    assert decode.abort("later")
    assert_block_pool_full(decode)
