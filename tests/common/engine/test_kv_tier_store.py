"""common/engine/kv_tier_store.py: byte-exact block copies (8-bit scales too), the RAM store's
byte bound and LRU order, and the reload-or-prefill decision from measured rates."""

from __future__ import annotations

import time

import pytest
import torch

from common.engine.kv_tier_store import BlockIO, RamStore, ReloadCosts
from common.kernels import kv_quant

KV_DTYPES = [torch.float32, torch.bfloat16, torch.int8] + (
    [kv_quant.FP8] if kv_quant.FP8 is not None else []
)


def make_cache(dtype: torch.dtype, num_blocks: int = 6) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = (2, 2, num_blocks, 4, 2)  # layers, K/V, blocks, block size, KV heads
    x = torch.randn(*shape, 8)
    if kv_quant.is_8bit(dtype):
        q, scales = kv_quant.quantize(x, dtype)
        return q.contiguous(), scales.contiguous()
    return x.to(dtype), None


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_block_round_trip_is_byte_exact(dtype):
    cache, scales = make_cache(dtype)
    io = BlockIO(cache, scales)
    expected_scales = 0 if scales is None else 2 * 2 * 4 * 2 * 4
    assert io.block_nbytes == 2 * 2 * 4 * 2 * 8 * cache.element_size() + expected_scales
    data = io.read(3)
    assert data.dtype == torch.uint8 and data.numel() == io.block_nbytes
    before_kv = kv_quant.storage(cache).clone()
    before_scales = None if scales is None else scales.clone()
    io.write(5, data)
    storage = kv_quant.storage(cache)
    assert torch.equal(storage[:, :, 5], before_kv[:, :, 3])  # bytes, even for float8
    assert torch.equal(storage[:, :, :5], before_kv[:, :, :5])  # nothing else touched
    if scales is not None:
        assert torch.equal(scales[:, :, 5], before_scales[:, :, 3])
        assert torch.equal(scales[:, :, :5], before_scales[:, :, :5])
    with pytest.raises(ValueError):
        io.write(0, data[:-1])


def test_ram_store_keeps_its_byte_bound_lru_first():
    store = RamStore(capacity_bytes=3 * 100, name="cpu")
    blocks = {bytes([i]) * 16: torch.full((100,), i, dtype=torch.uint8) for i in range(5)}
    dropped = []
    for i, (key, data) in enumerate(blocks.items()):
        dropped += store.put(key, [i, i], data)
        assert store.used_bytes <= store.capacity_bytes
        if i == 2:
            assert store.get(bytes([0]) * 16, [0, 0]) is not None  # 0 is now most recent
    assert [k for k, _ in dropped] == [bytes([1]) * 16, bytes([2]) * 16]
    assert dropped[0][1].tokens == (1, 1) and torch.equal(dropped[0][1].data, blocks[dropped[0][0]])
    assert set(store.keys()) == {bytes([i]) * 16 for i in (0, 3, 4)}
    assert store.counters.stores == 5 and store.counters.evictions == 2
    assert store.get(bytes([3]) * 16, [9, 9]) is None  # other tokens under the key: never served
    assert store.read(bytes([4]) * 16)[0] == (4, 4)
    assert store.put(b"x" * 16, [1], torch.zeros(301, dtype=torch.uint8)) == []  # too big
    assert store.counters.stores_skipped == 1
    assert store.check() == []


def test_costs_reload_before_anything_is_measured():
    costs = ReloadCosts()
    assert costs.favours_reload(16, {"cpu": 10**9})  # nothing measured: reload, and measure
    costs.record_load("cpu", 10**6, 0.001)  # 1 GB/s
    assert costs.favours_reload(16, {"cpu": 10**9})  # prefill still unmeasured
    assert costs.favours_reload(16, {"cpu": 0, "disk": 10**6})  # the disk rate is not known


def test_costs_compare_measured_rates():
    costs = ReloadCosts()
    costs.record_load("cpu", 10**6, 0.001)  # 1 GB/s
    start = time.perf_counter() - 0.1
    costs.record_step(num_prefill_tokens=100, num_tokens=100, start_s=start)  # ~1 ms per token
    assert costs.prefill_s_per_token == pytest.approx(1e-3, rel=0.5)
    assert costs.favours_reload(16, {"cpu": 10**6})  # 1 ms to reload vs ~16 ms to compute
    assert not costs.favours_reload(16, {"cpu": 10**8})  # 100 ms to reload
    before = costs.prefill_s_per_token
    costs.record_step(num_prefill_tokens=1, num_tokens=8, start_s=start)  # decode: not counted
    assert costs.prefill_s_per_token == before


def test_costs_leave_reload_time_out_of_prefill():
    costs = ReloadCosts()
    start = time.perf_counter()
    costs.record_load("cpu", 1000, 0.05)  # 50 ms of this "step" was a reload
    time.sleep(0.06)
    costs.record_step(num_prefill_tokens=100, num_tokens=100, start_s=start)
    elapsed = time.perf_counter() - start
    assert costs.prefill_s_per_token is not None
    assert costs.prefill_s_per_token <= (elapsed - 0.05) / 100


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_a_block_is_a_one_block_kv_transfer_payload(dtype):
    """A peer fetch can ship a tier block as it is (and its per-block CRC-32 covers these bytes)."""
    from kvtransfer import payload

    cache, scales = make_cache(dtype)
    io = BlockIO(cache, scales)
    shipped = payload.gather_payload(cache, scales, torch.tensor([2]))
    assert torch.equal(io.read(2), shipped.view(torch.uint8).reshape(-1))
