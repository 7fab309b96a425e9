"""Engine numerics against transformers `generate`; prefix caching, chunked prefill, preemption."""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.engine.engine import Engine
from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(hf_model, **overrides) -> Engine:
    cfg = dict(
        model="tiny",
        dtype="float32",
        kv_cache_memory="8MiB",
        block_size=8,
        max_num_batched_tokens=256,
    )
    cfg.update(overrides)
    engine = Engine(EngineConfig(**cfg), hf_model.config, hf_model.state_dict().items())
    engine.check_books_when_idle = True  # every test audits the KV blocks whenever it idles
    return engine


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, seed: int = 0, lengths=(3, 7, 8, 9, 17, 31, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 250, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)
    ]


def assert_block_pool_full(engine: Engine) -> None:
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.pool.blocks)


def test_greedy_matches_transformers_batched(tiny_model):
    family, hf_model, _ = tiny_model
    engine = make_engine(hf_model)
    ps = prompts(7)
    seqs = engine.generate(ps, GREEDY)
    for prompt, seq in zip(ps, seqs):
        assert seq.output_token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens), family
        assert seq.finish_reason == "length"
    assert_block_pool_full(engine)


def test_prefix_cache_hit_gives_same_output(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    shared = prompts(1, seed=3, lengths=(37,))[0]
    first = engine.generate([shared + [5, 6]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = engine.generate([shared + [5, 6]], GREEDY)[0]
    # 39 tokens, blocks of 8: 4 full blocks are reusable
    assert second.num_cached_tokens == 32
    assert second.output_token_ids == first.output_token_ids
    third = engine.generate([shared + [9]], GREEDY)[0]
    assert third.num_cached_tokens == 32
    assert third.output_token_ids == hf_greedy(hf_model, shared + [9], GREEDY.max_tokens)
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] == 64
    assert stats["prefix_cache_queries_total"] == 39 + 39 + 38
    assert_block_pool_full(engine)


def test_prefix_cache_off_computes_everything(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model, enable_prefix_caching=False)
    p = prompts(1, lengths=(30,))[0]
    engine.generate([p], GREEDY)
    assert engine.generate([p], GREEDY)[0].num_cached_tokens == 0


@pytest.mark.parametrize("chunk", [1, 5, 8, 13, 64])
def test_chunked_prefill_same_output(tiny_llama, chunk):
    hf_model, _ = tiny_llama
    ps = prompts(4, seed=1, lengths=(40, 23, 9, 17))
    expected = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in ps]
    engine = make_engine(hf_model, max_num_batched_tokens=chunk)
    seqs = engine.generate(ps, GREEDY)
    assert [s.output_token_ids for s in seqs] == expected
    assert_block_pool_full(engine)


def test_preemption_recomputes_to_same_output(tiny_llama):
    hf_model, _ = tiny_llama
    ps = prompts(6, seed=2, lengths=(30, 25, 40, 12, 33, 20))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf_model, p, params.max_tokens) for p in ps]
    # 2 layers * 2 * 8 tokens * 2 heads * 16 dims * 4 bytes = 4 KiB a block; 20 blocks = 160 tokens
    engine = make_engine(hf_model, kv_cache_memory=str(20 * 4096), max_model_len=128)
    seqs = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    assert_block_pool_full(engine)


def test_stop_rules(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    p = prompts(1, seed=4, lengths=(10,))[0]
    free_run = engine.generate([p], GREEDY)[0].output_token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    seq = engine.generate(
        [p], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == free_run[: first + 1]
    # the model's eos ends a sequence unless ignore_eos
    eng_eos = make_engine(hf_model)
    eng_eos.eos_token_ids = eng_eos.verifier.eos_token_ids = frozenset([stop_at])
    assert (
        eng_eos.generate([p], SamplingParams(max_tokens=24, temperature=0.0))[0].output_token_ids
        == free_run[: first + 1]
    )
    # min_tokens keeps eos from being sampled before it is reached
    seq = eng_eos.generate(
        [p], SamplingParams(max_tokens=24, temperature=0.0, min_tokens=first + 3)
    )[0]
    assert len(seq.output_token_ids) >= first + 3
    assert stop_at not in seq.output_token_ids[: first + 2]


def test_bad_requests_are_rejected(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("b", list(range(64)), GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("c", [1, 999], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("d", [1, 2], SamplingParams(max_tokens=0))
    assert not engine.has_unfinished()


def test_abort_frees_blocks(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    for i, p in enumerate(prompts(3, lengths=(20,))):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    for i in range(3):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")
    assert not engine.has_unfinished()
    assert_block_pool_full(engine)


def test_block_books_balance_and_catch_leaks(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model, max_num_batched_tokens=16)
    ps = prompts(3, seed=11)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    books = engine.block_books()  # mid-run: running blocks, free ones, nothing else
    assert books.ok, books.errors
    assert books.running > 0 and books.reserved == books.held == 0
    assert books.free + books.cached + books.running == books.total == engine.pool.num_blocks
    while engine.has_unfinished():
        engine.step()  # and the engine audits itself when it goes idle
    books = engine.block_books()
    assert books.ok and books.running == 0 and books.free + books.cached == books.total
    assert books.cached > 0  # the prompts' full blocks stay reusable
    # a block nobody lists is a leak; a block listed but also free is in two places
    leaked = engine.pool.allocate(1)
    books = engine.block_books()
    assert f"block {leaked[0]} is in use (ref count 1) by no sequence" in books.errors
    assert books.free + books.cached + books.running == books.total - 1
    engine.pool.free(leaked)
    engine.add_request("x", ps[0], GREEDY)
    engine.step()
    spare = next(b.block_id for b in engine.pool.blocks if b.ref_count == 0)
    engine.seqs["x"].block_table.append(spare)  # listed by a sequence, yet on the free list
    books = engine.block_books()
    assert f"block {spare}: ref count 0, listed 1 times" in books.errors
    engine.seqs["x"].block_table.pop()
    assert engine.block_books().ok
    engine.abort("x")
    assert engine.block_books().ok


def test_a_long_cpu_step_runs_padded_rows_and_matches_transformers(tiny_model, monkeypatch):
    """A step of more than PAD_MIN_ROWS rows runs its decoder layers on a multiple of PAD_ROWS
    rows (zeros after the real ones): attention and the KV cache see the real rows only, and
    greedy output is still transformers' (its families: Qwen3's q/k norms work on the rows too)."""
    from common.model import llama

    family, hf_model, _ = tiny_model
    ps = prompts(3, seed=5, lengths=(101, 97, 95))  # 293 rows in the first step: padded to 320
    engine = make_engine(hf_model, max_num_batched_tokens=1024)
    seen = []
    layer = engine.runner.model.layers[0]
    forward = layer.forward
    monkeypatch.setattr(layer, "forward", lambda x, *a: seen.append(x.shape[0]) or forward(x, *a))
    seqs = engine.generate(ps, GREEDY)
    assert seen[0] == 320 and 320 % llama.PAD_ROWS == 0 and all(n <= 3 for n in seen[1:])
    assert engine.scheduler.row_granule == llama.PAD_ROWS  # cut chunks need no padding rows
    for prompt, seq in zip(ps, seqs):
        assert seq.output_token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens), family
    assert_block_pool_full(engine)
