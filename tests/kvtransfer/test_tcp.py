"""tcp transport end to end on loopback (kvtransfer.sender / receiver), plus transport choice and
the per-block checksums."""

from __future__ import annotations

import time
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
    poll_until,
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


def test_the_sender_keeps_a_bounded_number_of_peer_sockets(pair, monkeypatch):
    from kvtransfer import sender as sender_module

    monkeypatch.setattr(sender_module, "MAX_PEERS", 2)
    sender, receiver = pair
    others = [KVReceiver(make_cache(seed=None)) for _ in range(3)]
    try:
        # A transfer in flight to each of 3 peers not reading yet: no socket of them is closed
        for i, other in enumerate(others):
            sender.send(other.address, make_header(sender.kv_cache, f"r{i}"), SRC_BLOCKS, 5.0)
        assert sender.num_peers() == 3 and sender.num_pending() == 3
        for other in others:
            assert poll_until(lambda o=other: o.poll(lambda h: DST_BLOCKS, timeout_ms=20))
        results: list = []
        for _ in range(3):
            results += poll_until(sender.poll)
            if len(results) == 3:
                break
        assert len(results) == 3 and all(r.ok for r in results)
        # All idle now: a new peer closes the least recently used until 2 are left
        received, result = transfer(sender, receiver, "tcp", request_id="r9")
        assert received.ok and result.ok
        assert set(sender._peers) == {others[2].address, receiver.address}
        # A closed peer's socket is made anew on its next use
        received, result = transfer(sender, others[0], "tcp", request_id="r10")
        assert received.ok and result.ok and sender.num_peers() == 2
        assert sender.drop_peer(others[0].address) and sender.num_peers() == 1
        assert not sender.drop_peer(others[0].address)  # already gone
    finally:
        for other in others:
            other.close()


def test_a_staged_transfer_is_filled_by_the_caller_then_sent(pair):
    """`stage` / `send_staged` (a peer fetch's answer, filled over several turns) deliver what
    one `send` would; a stage whose deadline passed sends nothing."""
    sender, receiver = pair
    cache = sender.kv_cache
    header = make_header(cache, "staged")
    buffer = sender.stage(receiver.address, header, 5.0)
    assert buffer is not None and len(buffer) == header.nbytes and sender.is_pending("staged")
    n = len(SRC_BLOCKS)
    for i, block in enumerate(SRC_BLOCKS):  # a block a "turn"
        payload.assemble_payload(cache, None, [block], out=buffer, first=i, num_blocks=n)
    sender.send_staged("staged", payload.block_checksums(buffer, cache, None, n))
    received = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    [result] = poll_until(sender.poll)
    assert received[0].ok and result.ok
    assert torch.equal(receiver.kv_cache[:, :, DST_BLOCKS], cache[:, :, SRC_BLOCKS])
    late = make_header(cache, "late")
    assert sender.stage(receiver.address, late, 0.01) is not None
    time.sleep(0.05)
    [result] = poll_until(sender.poll)
    assert not result.ok and result.reason == "deadline" and not sender.is_pending("late")
    sender.send_staged("late", [])  # ended: nothing goes out
    assert not receiver.poll(lambda h: DST_BLOCKS, timeout_ms=100)


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
