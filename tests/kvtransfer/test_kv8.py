"""An 8-bit KV cache over kvtransfer: the blocks and their scales travel in one payload (tcp and
shm), each block's checksum covering its scales (a corrupt scale byte is caught in its block), an
8-bit sender and a 16-bit receiver refuse each other, and cuda_ipc is refused for 8-bit KV."""

from __future__ import annotations

import pytest
import torch

from common.kernels import kv_quant
from kvtransfer import KVReceiver, KVSender, payload
from tests.kvtransfer import (
    DST_BLOCKS,
    SRC_BLOCKS,
    block_bytes,
    make_cache,
    make_header,
    poll_until,
    transfer,
)

KV_DTYPES = [torch.int8] + ([kv_quant.FP8] if kv_quant.FP8 is not None else [])


def make_8bit(dtype: torch.dtype, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit cache, scales [L, 2, blocks, block_size, kv heads]); zeros for seed None."""
    values, scales = kv_quant.quantize(make_cache(torch.float32, seed=seed or 0), dtype)
    if seed is None:
        return torch.zeros_like(kv_quant.storage(values)).view(dtype), torch.zeros_like(scales)
    return values, scales


@pytest.fixture(params=KV_DTYPES, ids=str)
def pair(request):
    cache, scales = make_8bit(request.param, seed=1)
    sender = KVSender(cache, kv_scales=scales)
    dst_cache, dst_scales = make_8bit(request.param, seed=None)
    receiver = KVReceiver(dst_cache, kv_scales=dst_scales)
    yield sender, receiver
    sender.close()
    receiver.close()


def bits(t: torch.Tensor) -> torch.Tensor:
    return kv_quant.storage(t)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_blocks_and_scales_arrive_exactly(pair, transport):
    sender, receiver = pair
    received, result = transfer(sender, receiver, transport)
    assert received.ok and result.ok, received.reason
    assert received.header.dtype == payload.dtype_name(sender.kv_cache.dtype)
    sent_kv = bits(sender.kv_cache)[:, :, SRC_BLOCKS]
    assert torch.equal(bits(receiver.kv_cache)[:, :, DST_BLOCKS], sent_kv)
    assert torch.equal(receiver.kv_scales[:, :, DST_BLOCKS], sender.kv_scales[:, :, SRC_BLOCKS])
    kv_bytes = sender.kv_cache[:, :, SRC_BLOCKS].numel()  # one byte each
    scale_bytes = sender.kv_scales[:, :, SRC_BLOCKS].numel() * 4
    assert result.nbytes == received.header.nbytes == kv_bytes + scale_bytes
    untouched = [b for b in range(receiver.kv_cache.shape[2]) if b not in DST_BLOCKS]
    assert not receiver.kv_scales[:, :, untouched].any()


def test_zero_blocks(pair):
    sender, receiver = pair
    received, result = transfer(sender, receiver, "tcp", src=[], dst=[])
    assert received.ok and result.ok and result.nbytes == 0


def test_checksum_covers_the_scales(pair, monkeypatch):
    # shm: the receiver maps the sender's segment, so a byte flipped there after the sender took
    # its checksum is a byte damaged in flight
    sender, receiver = pair
    sent = []
    real_checksums = payload.block_checksums

    def checksums_then_keep(view, *layout):
        sent.append(view)
        return real_checksums(view, *layout)

    monkeypatch.setattr(payload, "block_checksums", checksums_then_keep)
    header = make_header(sender.kv_cache, "bad", "shm")
    sender.send(receiver.address, header, SRC_BLOCKS, 5.0)
    view = sent[0]
    view[len(view) - 1] ^= 0xFF  # the last scale's top byte (last block's), after the checksums
    monkeypatch.setattr(payload, "block_checksums", real_checksums)
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    assert not received.ok and received.damaged
    assert f"checksum mismatch in block {len(SRC_BLOCKS) - 1} (" in received.reason
    assert not receiver.kv_scales.any()  # nothing written
    poll_until(sender.poll)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_8bit_sender_and_16bit_receiver_refuse(dtype):
    cache, scales = make_8bit(dtype, seed=1)
    sender = KVSender(cache, kv_scales=scales)
    receiver = KVReceiver(make_cache(torch.bfloat16, seed=None))
    try:
        sender.send(receiver.address, make_header(cache), SRC_BLOCKS, 5.0)
        [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
        assert not received.ok and "layout mismatch: dtype" in received.reason
        assert not receiver.kv_cache.any()
        [result] = poll_until(sender.poll)
        assert not result.ok
    finally:
        sender.close()
        receiver.close()


def test_cuda_ipc_refused_for_8bit(pair):
    sender, receiver = pair
    header = make_header(sender.kv_cache, transport="cuda_ipc")
    sender.send(receiver.address, header, SRC_BLOCKS, 5.0)
    [result] = sender.poll()
    assert not result.ok and "not cuda_ipc" in result.reason


def test_block_checksums_cover_each_blocks_kv_then_scales(pair):
    import zlib

    sender, _ = pair
    n = len(SRC_BLOCKS)
    index = payload.block_index(SRC_BLOCKS, sender.kv_cache.shape[2], sender.kv_cache.device)
    data = payload.gather_payload(sender.kv_cache, sender.kv_scales, index)
    got = payload.block_checksums(payload.as_bytes(data), sender.kv_cache, sender.kv_scales, n)
    want = [
        zlib.crc32(block_bytes(payload.as_bytes(data), sender.kv_cache, sender.kv_scales, n, b))
        for b in range(n)
    ]
    assert got == want and len(set(got)) == n


def test_a_payload_assembled_in_slices_is_the_payload_gathered_at_once(pair):
    """A peer fetch's answer is filled a slice a turn (`peer_fetch.FetchServer`): cache blocks
    and tier bytes, each slice into its place, with checksums per slice, give the same bytes and
    checksums as one gather."""
    from common.engine.kv_tier_store import BlockIO

    sender, _ = pair
    cache, scales = sender.kv_cache, sender.kv_scales
    blocks = [5, 0, 3, 7, 2]
    n = len(blocks)
    index = payload.block_index(blocks, cache.shape[2], cache.device)
    whole = bytes(payload.as_bytes(payload.gather_payload(cache, scales, index)))
    io = BlockIO(cache, scales)
    sources = [5, io.read(0), 3, io.read(7), 2]  # tier bytes for two of them
    out = memoryview(bytearray(payload.payload_nbytes(cache, n, scales)))
    checksums: list[int] = []
    for first, num in ((0, 2), (2, 1), (3, 2)):
        payload.assemble_payload(cache, scales, sources[first : first + num], out=out,
                                 first=first, num_blocks=n)  # fmt: skip
        checksums += payload.block_checksums(out, cache, scales, n, range(first, first + num))
    assert bytes(out) == whole
    assert checksums == payload.block_checksums(whole, cache, scales, n)
    with pytest.raises(ValueError, match="payload"):
        payload.assemble_payload(cache, scales, sources[:2], out=out, first=4, num_blocks=n)
