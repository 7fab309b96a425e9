"""tcp transport end to end on loopback (kvtransfer.sender / receiver), plus transport choice and
the per-block checksums."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvtransfer import KVReceiver, KVSender, payload
from tests.kvtransfer import (
    DST_BLOCKS,
    SRC_BLOCKS,
    block_bytes,
    make_cache,
    make_header,
    run_child_transfer,
    transfer,
)


@pytest.fixture
def pair(request):
    dtype = getattr(request, "param", torch.float32)
    sender = KVSender(make_cache(dtype, seed=1))
    receiver = KVReceiver(make_cache(dtype, seed=None))
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("pair", [torch.float32, torch.bfloat16], indirect=True)
def test_blocks_arrive_exactly(pair):
    sender, receiver = pair
    received, result = transfer(sender, receiver, "tcp")
    assert received.ok and received.reason == ""
    assert received.header.first_token_id == 42 and received.header.first_logprob == -0.5
    src = sender.kv_cache[:, :, SRC_BLOCKS]
    assert torch.equal(receiver.kv_cache[:, :, DST_BLOCKS], src)
    untouched = [b for b in range(receiver.kv_cache.shape[2]) if b not in DST_BLOCKS]
    assert not receiver.kv_cache[:, :, untouched].any()
    assert result.ok and result.request_id == "r0" and result.seconds > 0
    assert result.nbytes == received.header.nbytes == src.nbytes
    assert sender.poll() == []  # exactly one result per send


def test_one_socket_per_peer_and_many_transfers(pair):
    sender, receiver = pair
    for i in range(3):
        received, result = transfer(sender, receiver, "tcp", request_id=f"r{i}")
        assert received.ok and result.ok
    assert len(sender._peers) == 1


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_zero_blocks(pair, transport):
    """All blocks already on the decode side: only the first token travels."""
    sender, receiver = pair
    received, result = transfer(sender, receiver, transport, src=[], dst=[])
    assert received.ok and result.ok and result.nbytes == 0


def test_request_already_in_flight_is_an_error(pair):
    sender, receiver = pair
    sender.send(receiver.address, make_header(sender.kv_cache), SRC_BLOCKS, 5.0)
    with pytest.raises(ValueError, match="in flight"):
        sender.send(receiver.address, make_header(sender.kv_cache), SRC_BLOCKS, 5.0)
    with pytest.raises(ValueError, match="out of range"):
        sender.send(receiver.address, make_header(sender.kv_cache, "x"), [0, 1, 99], 5.0)


def test_bad_address_is_a_failed_result(pair):
    sender, _ = pair
    sender.send("nonsense://x", make_header(sender.kv_cache), SRC_BLOCKS, 5.0)
    [result] = sender.poll()
    assert not result.ok and "send failed" in result.reason and sender.num_pending() == 0


@pytest.mark.e2e  # spawns the receiver process
def test_receiver_in_another_process():
    run_child_transfer("tcp", torch.bfloat16)


@pytest.mark.parametrize("fast", [True, False], ids=["zlib-ng if installed", "zlib"])
@pytest.mark.parametrize("num_blocks", [0, 1, 3, 8])
def test_block_checksums_are_zlib_crc32_of_each_blocks_bytes(num_blocks, fast, monkeypatch):
    if not fast:
        monkeypatch.setattr(payload, "_fast_crc32", None)
    cache = make_cache(torch.bfloat16, seed=4)
    blocks = torch.arange(num_blocks).flip(0)
    data = payload.as_bytes(payload.gather(cache, blocks))
    got = payload.block_checksums(data, cache, None, num_blocks)
    want = [zlib.crc32(block_bytes(data, cache, None, num_blocks, b)) for b in range(num_blocks)]
    assert got == want and len(set(got)) == num_blocks
    assert b"".join(block_bytes(data, cache, None, num_blocks, b) for b in range(num_blocks)) == (
        bytes(payload.as_bytes(cache[:, :, blocks].permute(2, 0, 1, 3, 4, 5).contiguous()))
    )  # every byte of the payload in exactly one block


@pytest.mark.parametrize("contiguous", [True, False])
def test_gather_and_scatter_match_plain_indexing(contiguous):
    cache = make_cache(torch.bfloat16, seed=3)
    if not contiguous:  # a cache that is a slice of a bigger one
        cache = torch.cat([cache, cache], dim=2)[:, :, 4:12]
        assert not cache.is_contiguous()
    index = torch.tensor(SRC_BLOCKS)
    assert torch.equal(payload.gather(cache, index), cache[:, :, SRC_BLOCKS])
    out = torch.empty_like(cache[:, :, SRC_BLOCKS])
    assert torch.equal(payload.gather(cache, index, out=out), cache[:, :, SRC_BLOCKS])
    target = torch.zeros_like(cache)
    payload.scatter(target, torch.tensor(DST_BLOCKS), out)
    assert torch.equal(target[:, :, DST_BLOCKS], cache[:, :, SRC_BLOCKS])
