"""Faults on both ends of a KV transfer: corrupt, short, missing or mislabelled payloads, layout
mismatches, unknown requests, deadlines, aborts, garbage on the socket. Each bad transfer is
refused (the cache untouched, the sender told), each ends in exactly one TransferResult, no
segment outlives its transfer, and the receiver keeps serving good transfers afterwards."""

from __future__ import annotations

import os
import socket
import time

import msgspec
import pytest
import torch

from common.protocol import MAX_KV_HEADER_BYTES, KVAck, encode
from kvtransfer import KVReceiver, KVSender, payload, shm
from tests.kvtransfer import (
    DST_BLOCKS,
    SRC_BLOCKS,
    assert_serves,
    damage_on_the_way,
    make_cache,
    make_header,
    own_segments,
    poll_until,
    raw_exchange,
    transfer,
)


@pytest.fixture
def pair():
    sender = KVSender(make_cache(torch.float32, seed=1))
    receiver = KVReceiver(make_cache(torch.float32, seed=2))
    yield sender, receiver
    sender.close()
    receiver.close()
    assert not own_segments()


def good_frames(cache: torch.Tensor, request_id: str = "raw") -> tuple:
    """A correct tcp header and payload, to break one way or another."""
    data = bytes(payload.as_bytes(cache[:, :, SRC_BLOCKS].contiguous()))
    header = make_header(cache, request_id, "tcp")
    header.nbytes = len(data)
    header.block_checksums = payload.block_checksums(data, cache, None, len(SRC_BLOCKS))
    return header, data


def assert_refused(receiver, before, received, ack, reason):
    assert [r.ok for r in received] == [False] and reason in received[0].reason
    assert ack is not None and not ack.ok and reason in ack.reason
    assert torch.equal(receiver.kv_cache, before), "a refused transfer touched the cache"


@pytest.mark.parametrize("block", [0, 2])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_byte_damaged_on_the_way_is_found_in_its_block(pair, transport, block, monkeypatch):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    damage_on_the_way(monkeypatch, block)  # after the sender took the checksums
    sender.send(receiver.address, make_header(sender.kv_cache, "bad", transport), SRC_BLOCKS, 5.0)
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    [result] = poll_until(sender.poll)
    assert not received.ok and received.damaged
    assert f"checksum mismatch in block {block} (" in received.reason, received.reason
    assert received.reason.endswith(f"of {len(SRC_BLOCKS)}")  # that block only
    assert not result.ok and "checksum mismatch" in result.reason
    assert torch.equal(receiver.kv_cache, before)
    assert_serves(sender, receiver, transport)


def test_a_shm_byte_changed_after_send_is_found(pair):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    header = make_header(sender.kv_cache, "bad", "shm")
    sender.send(receiver.address, header, SRC_BLOCKS, 5.0)
    rows, blocks = 2 * sender.kv_cache.shape[0], len(SRC_BLOCKS)
    where = (1 * blocks + 1) * (header.nbytes // (rows * blocks)) + 5  # layer 0's V of block 1
    with open(shm.path_of(header.shm_name), "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x01]))
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    poll_until(sender.poll)
    assert not received.ok and received.damaged and "mismatch in block 1 (" in received.reason
    assert torch.equal(receiver.kv_cache, before)
    assert_serves(sender, receiver, "shm")


@pytest.mark.parametrize("count", [0, 2, 4])
def test_block_checksums_not_one_per_block_are_damage(pair, count):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    header, data = good_frames(sender.kv_cache)
    header.block_checksums = (header.block_checksums * 2)[:count]
    received, ack = raw_exchange(receiver, [encode(header), data])
    reason = f"{count} block checksums for {len(SRC_BLOCKS)} blocks"
    assert_refused(receiver, before, received, ack, reason)
    assert received[0].damaged  # nothing to check the KV against: recomputed, never used
    assert_serves(sender, receiver)


def test_block_checksums_are_bounded_when_decoded(pair):
    from common.protocol import MAX_KV_BLOCKS, ProtocolError, decode_kv

    header, _ = good_frames(pair[0].kv_cache)
    for bad in ([0] * (MAX_KV_BLOCKS + 1), [2**32], [-1]):
        frame = msgspec.msgpack.encode(msgspec.structs.replace(header, block_checksums=bad))
        with pytest.raises(ProtocolError):
            decode_kv(frame)


def test_corrupt_raw_frame(pair):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    header, data = good_frames(sender.kv_cache)
    bad = bytearray(data)
    bad[-1] ^= 0x80
    received, ack = raw_exchange(receiver, [encode(header), bytes(bad)])
    assert_refused(receiver, before, received, ack, "checksum mismatch in block 2 (")
    assert_serves(sender, receiver)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("truncated", "truncated payload"),
        ("nbytes", "nbytes mismatch"),
        ("missing frame", "expected one payload frame, got 0"),
        ("extra frame", "expected one payload frame, got 2"),
    ],
)
def test_short_or_missing_payload(pair, case, reason):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    header, data = good_frames(sender.kv_cache)
    if case == "truncated":
        frames = [encode(header), data[:-4]]
    elif case == "nbytes":  # a consistent but wrong-sized transfer: header and frame agree
        header.nbytes = len(data) - 4
        frames = [encode(header), data[:-4]]
    elif case == "missing frame":
        frames = [encode(header)]
    else:
        frames = [encode(header), data, b"x"]
    received, ack = raw_exchange(receiver, frames)
    assert_refused(receiver, before, received, ack, reason)
    assert_serves(sender, receiver)


def test_truncated_shm_segment(pair):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    header = make_header(sender.kv_cache, "short", "shm")
    sender.send(receiver.address, header, SRC_BLOCKS, 5.0)
    os.truncate(shm.path_of(header.shm_name), header.nbytes - 1)
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    [result] = poll_until(sender.poll)
    assert not received.ok and not result.ok and "header says" in result.reason
    assert torch.equal(receiver.kv_cache, before)
    assert_serves(sender, receiver, "shm")


@pytest.mark.parametrize(
    "receiver_cache, reason",
    [
        (lambda: make_cache(torch.float32, seed=None, num_kv_heads=4), "num_kv_heads"),
        (lambda: make_cache(torch.bfloat16, seed=None), "dtype"),
    ],
    ids=["shape", "dtype"],
)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_layout_mismatch(receiver_cache, reason, transport):
    cache = receiver_cache()
    before = cache.clone()
    sender, receiver = KVSender(make_cache(torch.float32)), KVReceiver(cache)
    try:
        received, result = transfer(sender, receiver, transport)
        assert not received.ok and "layout mismatch" in received.reason
        assert not result.ok and reason in result.reason
        assert torch.equal(cache, before)
    finally:
        sender.close()
        receiver.close()
    assert not own_segments()


@pytest.mark.parametrize(
    "dst, reason",
    [
        (None, "unknown or aborted request"),
        ([0, 5], "2 destination blocks for 3"),
        ([0, 5, 99], "out of range"),
        ([0, 5, 5], "repeated"),
    ],
)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bad_destination(pair, transport, dst, reason):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    received, result = transfer(sender, receiver, transport, dst=dst)
    assert not received.ok and reason in received.reason
    assert not result.ok and reason in result.reason
    assert torch.equal(receiver.kv_cache, before)
    assert_serves(sender, receiver, transport)


def test_resolve_that_raises(pair):
    sender, receiver = pair
    sender.send(receiver.address, make_header(sender.kv_cache, "boom"), SRC_BLOCKS, 5.0)

    def resolve(header):
        raise KeyError("no such sequence")

    [received] = poll_until(lambda: receiver.poll(resolve, timeout_ms=20))
    [result] = poll_until(sender.poll)
    assert not received.ok and not result.ok and "receiver error" in result.reason
    assert_serves(sender, receiver)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_deadline_when_receiver_never_polls(pair, transport):
    sender, receiver = pair
    header = make_header(sender.kv_cache, "slow", transport)
    sender.send(receiver.address, header, SRC_BLOCKS, 0.05)
    assert sender.poll() == [] and sender.num_pending() == 1
    time.sleep(0.08)
    [result] = sender.poll()
    assert (result.request_id, result.ok, result.reason) == ("slow", False, "deadline")
    assert sender.num_pending() == 0 and not own_segments()
    # The late header is refused (segment gone) or, for tcp, the socket was dropped with it;
    # either way the sender reports nothing more for it.
    receiver.poll(lambda h: None, timeout_ms=20)
    assert sender.poll() == []
    assert_serves(sender, receiver, transport)


def test_deadline_when_receiver_is_dead(pair):
    sender, receiver = pair
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender.send(f"tcp://127.0.0.1:{port}", make_header(sender.kv_cache, "d", "shm", 1), [1], 0.05)
    time.sleep(0.08)
    [result] = sender.poll()
    assert not result.ok and result.reason == "deadline" and not own_segments()
    assert_serves(sender, receiver, "shm")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_abort(pair, transport):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    sender.send(receiver.address, make_header(sender.kv_cache, "gone", transport), SRC_BLOCKS, 5.0)
    sender.abort("gone")
    sender.abort("never-sent")  # unknown ids are ignored
    [result] = sender.poll()
    assert (result.request_id, result.ok, result.reason) == ("gone", False, "aborted")
    assert sender.num_pending() == 0 and not own_segments()
    # The header was dropped with the peer's socket, or arrives after its segment is gone:
    # either way nothing is written, and the sender has already reported its one result.
    received = receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20)
    if transport == "shm":
        assert all(not r.ok and "gone" in r.reason for r in received)
        assert torch.equal(receiver.kv_cache, before)
    assert sender.poll() == []
    assert_serves(sender, receiver, transport)


@pytest.mark.parametrize(
    "frames",
    [
        [b"garbage"],
        [b""],
        [b"\xc1" * 10],
        [os.urandom(70_000), os.urandom(100)],
        [encode(KVAck("x", ok=True))],
        [b"\x92\xa2kv\x01"],  # msgpack, not a header
        [b"\x81\xa4type\xa2kv"],  # a header with every field missing
    ],
    ids=["text", "empty", "bad-msgpack", "random", "ack", "array", "incomplete"],
)
def test_garbage_frames_are_dropped(pair, frames):
    sender, receiver = pair
    before = receiver.kv_cache.clone()
    received, ack = raw_exchange(receiver, frames)
    assert received == [] and ack is None
    assert torch.equal(receiver.kv_cache, before)
    assert_serves(sender, receiver)


def test_oversized_header_is_dropped(pair):
    sender, receiver = pair
    header, data = good_frames(sender.kv_cache)
    # over the size limit (which leaves room for a long prompt's logprobs)
    header.shm_name = "x" * MAX_KV_HEADER_BYTES
    received, ack = raw_exchange(receiver, [encode(header), data])
    assert received == [] and ack is None
    # within it, but a field over its own bound
    header.shm_name = ""
    header.first_top_logprobs = [(i, 0.0) for i in range(200_000)]
    received, ack = raw_exchange(receiver, [encode(header), data])
    assert received == [] and ack is None
    assert_serves(sender, receiver)


def test_raw_tcp_garbage_does_not_hurt(pair):
    """Bytes that are not even ZeroMQ: the connection fails its handshake, nothing else."""
    sender, receiver = pair
    host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(os.urandom(4096))
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(100))
    assert receiver.poll(lambda h: DST_BLOCKS, timeout_ms=50) == []
    assert_serves(sender, receiver)
