"""A decode engine out of KV blocks with prefilled sequences arriving (the PD path) and local
ones (colocated): every request finishes, greedy outputs equal solo runs, the books balance.

The driver plays the router and the decode worker: it reserves blocks for a request (retrying
refused ones later, in order, as the router's queue does), prefills it on another engine, copies
the KV into the reservation and admits it, and steps the decode engine in between.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from common.engine import handoff as engine_module
from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import assert_block_pool_full, make_engine, prompts

BLOCK_BYTES = 4096  # 2 layers * 2 (K, V) * 8 tokens * 2 heads * 16 dims * 4 bytes (float32)


def prefill_into(prefill, decode, rid: str, prompt: list[int], params: SamplingParams):
    """The KV of a reserved request: prefilled on `prefill`, copied into `decode`, admitted."""
    first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    prefill.add_request(rid, prompt, first, hold_blocks=True)
    while rid not in prefill.held:
        prefill.step()
    held = prefill.held[rid]
    dst = decode.reserved_block_ids(rid)
    bs = decode.config.block_size
    start = decode.reserved[rid].num_cached_tokens // bs
    src = held.block_table
    decode.runner.kv_cache[:, :, dst[start : len(src)]] = prefill.runner.kv_cache[:, :, src[start:]]
    out = decode.admit_prefilled(rid, held.output_token_ids[0])
    assert prefill.release(rid)
    return out


def run_cluster(hf_model, requests, num_blocks: int, local: set[str], max_steps: int = 20000):
    """Drive `requests` [(rid, prompt, params)] through a decode engine of `num_blocks` blocks;
    returns each request's output tokens and the decode engine."""
    decode = make_engine(hf_model, kv_cache_memory=str(num_blocks * BLOCK_BYTES), max_model_len=128)
    assert decode.pool.num_blocks == num_blocks
    prefill = make_engine(hf_model)
    outputs: dict[str, list[int]] = {}
    pending = list(requests)
    for _ in range(max_steps):
        still = []
        for rid, prompt, params in pending:
            if rid in local:
                decode.add_request(rid, prompt, params)
                outputs[rid] = []
            elif decode.reserve(rid, prompt, params) is not None:
                outputs[rid] = prefill_into(prefill, decode, rid, prompt, params).new_token_ids
            else:
                still.append((rid, prompt, params))  # refused: the router asks again later
        pending = still
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
        books = decode.block_books()
        assert books.ok, books.errors
        if not pending and not decode.has_unfinished():
            break
    else:
        stuck = decode.stats()
        pytest.fail(f"not done after {max_steps} steps: {len(pending)} refused, {stuck}")
    assert_block_pool_full(decode)
    assert_block_pool_full(prefill)
    return outputs, decode


def solo_runs(hf_model, requests) -> dict[str, list[int]]:
    """Each request alone on a roomy engine (one after another: no batching, no preemption)."""
    engine = make_engine(hf_model, max_model_len=128)
    return {rid: engine.generate([p], prm)[0].output_token_ids for rid, p, prm in requests}


def test_the_reported_deadlock_shape_finishes(tiny_llama, monkeypatch):
    # Long prompts, long outputs, a pool that holds about two of them at full length, and
    # reservations that count no growth (as before the fix): decode must preempt, and the
    # prefilled sequences arriving behind a preempted one must not wait on it forever.
    monkeypatch.setattr(engine_module, "OUTPUT_RESERVE_TOKENS", 0)
    hf_model, _ = tiny_llama
    ps = prompts(8, seed=11, lengths=(60, 70, 64, 66))
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(ps)]
    outputs, decode = run_cluster(hf_model, requests, num_blocks=24, local=set())
    assert decode.scheduler.num_preemptions > 0  # the pressure was real
    assert outputs == solo_runs(hf_model, requests)


def test_reservations_leave_room_for_growth_so_nothing_is_preempted(tiny_llama):
    hf_model, _ = tiny_llama
    ps = prompts(6, seed=12, lengths=(40, 50, 45))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = [(f"g{i}", p, params) for i, p in enumerate(ps)]
    outputs, decode = run_cluster(hf_model, requests, num_blocks=24, local=set())
    assert decode.scheduler.num_preemptions == 0
    assert outputs == solo_runs(hf_model, requests)


def test_a_reservation_waits_for_a_preempted_sequence(tiny_llama, monkeypatch):
    # A preempted sequence needs all its blocks back: new reservations are refused until they
    # are free, so a stream of arrivals cannot starve it.
    monkeypatch.setattr(engine_module, "OUTPUT_RESERVE_TOKENS", 0)
    hf_model, _ = tiny_llama
    decode = make_engine(hf_model, kv_cache_memory=str(15 * BLOCK_BYTES), max_model_len=96)
    p = prompts(1, seed=3, lengths=(60,))[0]  # 8 blocks with its first token
    decode.add_request("preempted", p, SamplingParams(max_tokens=4, ignore_eos=True))
    seq = decode.seqs["preempted"]  # waiting, no blocks: it needs 8 to run again
    assert decode.reserve("new", prompts(1, seed=4, lengths=(60,))[0], seq.params) is None
    assert decode.reserve("small", [5, 6, 7], seq.params) is not None  # 1 block: 8 still free
    decode.abort("small")
    decode.abort("preempted")


@pytest.mark.parametrize("seed", [1, 2])
def test_randomized_pressure_every_request_finishes_as_solo(tiny_llama, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(engine_module, "OUTPUT_RESERVE_TOKENS", rng.choice([0, 4, 16, 256]))
    hf_model, _ = tiny_llama
    n = rng.randint(4, 8)
    ps = prompts(n, seed=100 + seed, lengths=[rng.randint(3, 80) for _ in range(n)])
    requests = []
    for i, p in enumerate(ps):
        max_tokens = rng.randint(1, 128 - len(p) - 1)
        requests.append((f"q{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    local = {rid for rid, _, _ in requests if rng.random() < 0.3}  # colocated short prompts
    outputs, _ = run_cluster(hf_model, requests, num_blocks=rng.randint(16, 30), local=local)
    assert outputs == solo_runs(hf_model, requests)
