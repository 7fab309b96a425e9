"""The KV tier in an engine (common/engine/kv_tier.py): a prefix evicted from a small KV cache is
reloaded from host RAM or disk, byte for byte (8-bit scales too), and greedy output with a tier hit
equals the output with a device-cache hit and with no cache at all; a damaged file is recomputed;
the measured cost decides; the books balance and the metrics count it all."""

from __future__ import annotations

import pytest
import torch

from common.engine.kv_tier_store import BlockIO
from common.kernels import kv_quant
from common.prefix_hash import block_keys
from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import make_engine, prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 8
# 16 blocks of 8 tokens: a 40-token prompt and its output take 6, so three other prompts evict it
KV_DTYPES = ["auto", "int8"] + (["fp8"] if kv_quant.FP8 is not None else [])


# bytes per token: 2 layers x K, V x 2 KV heads x 16 values (x 4 bytes, or 1 + a 4-byte scale)
BYTES_PER_TOKEN = {"auto": 512, "int8": 2 * 2 * 2 * (16 + 4), "fp8": 2 * 2 * 2 * (16 + 4)}


def small_engine(hf_model, kv_dtype: str = "auto", **overrides):
    """An engine whose cache holds 16 blocks of 8 tokens, whatever the KV dtype."""
    memory = str(16 * BLOCK * BYTES_PER_TOKEN[kv_dtype])
    engine = make_engine(
        hf_model, kv_cache_dtype=kv_dtype, max_model_len=128, kv_cache_memory=memory, **overrides
    )
    assert engine.pool.num_blocks == 16
    return engine


def prefix_blocks(engine, prompt: list[int]) -> dict[bytes, torch.Tensor]:
    """The bytes of each cached block of `prompt`'s leading full blocks, by key."""
    io = BlockIO(engine.runner.kv_cache, engine.runner.kv_scales)
    keys = block_keys(
        prompt[: (len(prompt) - 1) // BLOCK * BLOCK], BLOCK, engine.block_manager.salt
    )
    return {k: io.read(engine.pool._cached[k]) for k in keys if engine.pool.is_cached(k)}


def evict(engine, seed: int = 50) -> None:
    """Run four other prompts, one after another: the cache reuses every block."""
    for prompt in prompts(4, seed=seed, lengths=(40,)):
        engine.generate([prompt], GREEDY)


def finish(engine) -> None:
    if engine.tier is not None:
        engine.tier.flush()
    books = engine.block_books()
    assert books.ok, books.errors
    assert books.free + books.cached == books.total
    if engine.tier is not None:
        engine.tier.close()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("where", ["ram", "disk", "ram+disk"])
def test_tier_hit_equals_device_hit_and_no_cache(tiny_llama, tmp_path, kv_dtype, where):
    hf_model, _ = tiny_llama
    prompt = prompts(1, seed=7, lengths=(40,))[0]
    tier = {
        "ram": dict(kv_offload_memory="1MiB"),
        "disk": dict(kv_offload_dir=str(tmp_path), kv_offload_disk="1MiB"),
        # RAM for two blocks: the prompt's blocks go on down to disk
        "ram+disk": dict(kv_offload_memory=str(2 * BLOCK * BYTES_PER_TOKEN[kv_dtype]),
                         kv_offload_dir=str(tmp_path), kv_offload_disk="1MiB"),
    }[where]  # fmt: skip
    # no cache at all, and a device-cache hit
    uncached = small_engine(hf_model, kv_dtype, enable_prefix_caching=False)
    expected = uncached.generate([prompt], GREEDY)[0].output_token_ids
    device = small_engine(hf_model, kv_dtype)
    device.generate([prompt], GREEDY)
    again = device.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.output_token_ids == expected

    engine = small_engine(hf_model, kv_dtype, **tier)
    first = engine.generate([prompt], GREEDY)[0]
    assert first.output_token_ids == expected
    evicted = prefix_blocks(engine, prompt)
    assert len(evicted) == 4
    evict(engine)
    assert prefix_blocks(engine, prompt) == {}  # gone from the device cache
    engine.tier.flush()
    reloaded = engine.generate([prompt], GREEDY)[0]
    assert reloaded.num_cached_tokens == 32
    assert reloaded.output_token_ids == expected
    # the blocks read back are the bytes that were evicted (scales included for 8-bit KV)
    back = prefix_blocks(engine, prompt)
    assert back.keys() == evicted.keys()
    assert all(torch.equal(back[k], evicted[k]) for k in evicted)
    stats = engine.stats()
    assert stats["external_prefix_cache_hits_total"] == 32
    assert stats["prefix_cache_hits_total"] == 0  # the device cache never had them again
    hit_tier = "cpu" if where == "ram" else "disk"
    assert stats[f"kv_offload_{hit_tier}_block_hit_total"] >= 4
    assert stats[f"kv_offload_{hit_tier}_block_store_total"] >= 4
    finish(engine)


def test_prefill_tokens_and_bytes_per_token_metrics(tiny_llama):
    hf_model, _ = tiny_llama
    engine = small_engine(hf_model, kv_offload_memory="1MiB")
    prompt = prompts(1, seed=8, lengths=(40,))[0]
    engine.generate([prompt], GREEDY)
    stats = engine.stats()
    assert stats["kv_cache_bytes_per_token"] == 512  # 2 layers x K, V x 2 heads x 16 x 4 bytes
    assert stats["prefill_kv_computed_tokens_total"] == 40  # then 5 decode steps of 1 token
    evict(engine)
    computed = engine.stats()["prefill_kv_computed_tokens_total"]
    assert computed == 40 + 4 * 40
    engine.generate([prompt], GREEDY)
    stats = engine.stats()
    assert stats["prefill_kv_computed_tokens_total"] == computed + 8  # 32 reloaded
    assert stats["external_prefix_cache_queries_total"] == 6 * 40
    assert stats["kv_offload_cpu_usage_bytes"] <= stats["kv_offload_cpu_capacity_bytes"]
    assert stats["kv_offload_cpu_usage_bytes"] > 0
    finish(engine)


def test_ram_tier_stays_within_its_bytes(tiny_llama):
    hf_model, _ = tiny_llama
    per_block = 512 * BLOCK
    engine = small_engine(hf_model, kv_offload_memory=str(5 * per_block))
    for seed in range(4):
        evict(engine, seed=60 + seed)
        assert engine.tier.ram.used_bytes <= 5 * per_block
    counters = engine.tier.ram.counters
    assert len(engine.tier.ram) == 5 and counters.evictions == counters.stores - 5
    finish(engine)


def test_a_damaged_file_is_recomputed_with_the_same_output(tiny_llama, tmp_path):
    hf_model, _ = tiny_llama
    prompt = prompts(1, seed=9, lengths=(40,))[0]
    engine = small_engine(hf_model, kv_offload_dir=str(tmp_path), kv_offload_disk="1MiB")
    expected = engine.generate([prompt], GREEDY)[0].output_token_ids
    keys = list(prefix_blocks(engine, prompt))
    evict(engine)
    engine.tier.flush()
    disk = engine.tier.disk
    third = disk.path / (keys[2].hex() + ".kvb")
    raw = bytearray(third.read_bytes())
    raw[-1] ^= 0xFF  # one bit of KV: must never be loaded
    third.write_bytes(bytes(raw))
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 16  # the two blocks before it, then computed
    assert again.output_token_ids == expected
    assert disk.counters.corrupt == 1 and not third.exists()
    finish(engine)


def test_prefill_measured_cheaper_declines_the_reload(tiny_llama):
    hf_model, _ = tiny_llama
    prompt = prompts(1, seed=10, lengths=(40,))[0]
    engine = small_engine(hf_model, kv_offload_memory="1MiB")
    expected = engine.generate([prompt], GREEDY)[0].output_token_ids
    evict(engine)
    costs = engine.tier.costs
    assert costs.prefill_s_per_token is not None  # measured by the engine's own prefill steps
    costs.bytes_per_s["cpu"] = 1.0  # a reload that would take hours
    costs.record_step = lambda *a: None  # keep the rates as set
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.output_token_ids == expected
    assert engine.stats()["kv_offload_reloads_declined_total"] == 4
    finish(engine)


def test_no_tier_by_default(tiny_llama):
    hf_model, _ = tiny_llama
    engine = small_engine(hf_model)
    assert engine.tier is None and engine.pool.on_evict is None
    assert "kv_offload_cpu_block_hit_total" not in engine.stats()


def test_the_flags(tmp_path):
    import argparse

    from common.config import EngineConfig, add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--kv-offload-memory", "512MiB", "--kv-offload-dir", str(tmp_path), "--kv-offload-disk",
         "2GiB"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.kv_offload_memory, config.kv_offload_disk) == ("512MiB", "2GiB")
    assert config.kv_offload_dir == str(tmp_path)
    defaults = config_from_args(parser.parse_args([]))
    assert (defaults.kv_offload_memory, defaults.kv_offload_dir) == ("0", "")
    for bad in (dict(kv_offload_dir=str(tmp_path)), dict(kv_offload_disk="1GiB"),
                dict(kv_offload_memory="lots")):  # fmt: skip
        with pytest.raises(ValueError):
            EngineConfig(**bad).validate()
