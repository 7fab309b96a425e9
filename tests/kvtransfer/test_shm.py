"""shm transport (kvtransfer.shm through the sender and receiver): real segments under /dev/shm,
written by the sender, read by the receiver; reused after the receiver's reply, unlinked after a
deadline or abort and on close, never left mapped."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

from common.protocol import encode
from kvtransfer import KVReceiver, KVSender, payload, shm
from tests.kvtransfer import (
    DST_BLOCKS,
    SRC_BLOCKS,
    assert_serves,
    make_cache,
    make_header,
    mapped_segments,
    own_segments,
    poll_until,
    raw_exchange,
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
    assert not own_segments() and not mapped_segments(), "a segment outlived close()"


def send(sender, receiver, request_id: str, num_blocks: int = 3, deadline_s: float = 5.0):
    header = make_header(sender.kv_cache, request_id, "shm", num_blocks)
    sender.send(receiver.address, header, SRC_BLOCKS[:num_blocks], deadline_s)
    return header


@pytest.mark.parametrize("pair", [torch.float32, torch.bfloat16], indirect=True)
def test_blocks_arrive_exactly_and_segment_stays_pooled(pair):
    sender, receiver = pair
    header = send(sender, receiver, "r0")
    # The payload is the first nbytes of one segment of its size class.
    assert own_segments() == {header.shm_name}
    size = os.path.getsize(shm.path_of(header.shm_name))
    assert size == shm.size_class(header.nbytes) >= header.nbytes
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    [result] = poll_until(sender.poll)
    assert received.ok and result.ok and result.nbytes == header.nbytes
    src = sender.kv_cache[:, :, SRC_BLOCKS]
    assert header.nbytes == src.nbytes
    assert torch.equal(receiver.kv_cache[:, :, DST_BLOCKS], src)
    assert own_segments() == {header.shm_name}
    assert [s.name for s in sender.segments.idle] == [header.shm_name]
    assert receiver.segments.names() == [header.shm_name]


def test_segment_is_created_and_mapped_once(pair, monkeypatch):
    sender, receiver = pair
    maps = []

    def counted(fd, size, writable):
        maps.append(writable)
        return real_map_file(fd, size, writable)

    real_map_file = shm.map_file
    monkeypatch.setattr(shm, "map_file", counted)
    names = set()
    for i in range(5):
        sender.kv_cache.add_(1)  # new contents each time: the receiver must see each
        received, result = transfer(sender, receiver, "shm", request_id=f"r{i}")
        assert received.ok and result.ok
        assert torch.equal(receiver.kv_cache[:, :, DST_BLOCKS], sender.kv_cache[:, :, SRC_BLOCKS])
        names |= own_segments()
    assert len(names) == 1 and sorted(maps) == [False, True]  # one segment, mapped once by each


def test_segment_is_reused_after_a_refusal(pair):
    """A refusal is a reply too: the receiver no longer reads the segment."""
    sender, receiver = pair
    received, result = transfer(sender, receiver, "shm", request_id="unknown", dst=None)
    assert not received.ok and not result.ok
    [name] = own_segments()
    assert_serves(sender, receiver, "shm")
    assert own_segments() == {name}


def test_transfers_in_flight_never_share_a_segment(pair):
    sender, receiver = pair
    headers = [send(sender, receiver, f"r{i}") for i in range(3)]
    assert len({h.shm_name for h in headers}) == 3 == len(own_segments())


@pytest.mark.parametrize("ending", ["deadline", "abort"])
def test_no_reuse_after_a_deadline_or_abort(pair, ending):
    """The receiver may still be reading: the segment is unlinked, never written again, and a
    late header naming it is refused even though the receiver mapped it before."""
    sender, receiver = pair
    transfer(sender, receiver, "shm", request_id="first")
    [pooled] = own_segments()
    header = send(sender, receiver, "late", deadline_s=0.05)
    assert header.shm_name == pooled
    if ending == "deadline":
        time.sleep(0.08)
    else:
        sender.abort("late")
    [result] = sender.poll()
    assert not result.ok and sender.num_pending() == 0
    assert not own_segments() and not sender.segments.idle
    # For an abort the header may have been dropped with the peer's socket.
    received = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20), 0.3)
    assert all(not r.ok and "gone" in r.reason for r in received)
    assert pooled not in receiver.segments.names()
    assert sender.poll() == []
    assert_serves(sender, receiver, "shm")
    assert pooled not in own_segments()


def test_pool_keeps_its_budget():
    """Three transfers in flight at once are never held back by the budget; afterwards the pool
    keeps only what fits in it, least recently used given back first."""
    cache = make_cache()
    segment_size = shm.size_class(cache[:, :, SRC_BLOCKS].nbytes)
    sender = KVSender(make_cache(seed=1), shm_pool_bytes=2 * segment_size)
    receiver = KVReceiver(cache)
    try:
        headers = [send(sender, receiver, f"r{i}") for i in range(3)]
        assert len(own_segments()) == 3
        received = []
        while len(received) < 3:
            received += poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
        results = []
        while len(results) < 3:
            results += poll_until(sender.poll)
        assert all(r.ok for r in received + results)
        assert sender.segments.mapped_bytes() <= 2 * segment_size
        assert own_segments() == {h.shm_name for h in headers[1:]}
    finally:
        sender.close()
        receiver.close()
    assert not own_segments() and not mapped_segments()


def test_pool_of_no_bytes_keeps_nothing():
    sender, receiver = KVSender(make_cache(seed=1), shm_pool_bytes=0), KVReceiver(make_cache())
    try:
        for i in range(2):
            received, result = transfer(sender, receiver, "shm", request_id=f"r{i}")
            assert received.ok and result.ok and not own_segments()
    finally:
        sender.close()
        receiver.close()
    assert not mapped_segments()


def test_full_shm_gives_back_idle_segments_first(pair, monkeypatch):
    sender, receiver = pair
    transfer(sender, receiver, "shm", request_id="small", src=[1], dst=[0])
    [small] = own_segments()
    calls = []

    def full_once(fd, offset, length):
        calls.append(length)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fallocate(fd, offset, length)

    real_fallocate = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", full_once)
    received, result = transfer(
        sender, receiver, "shm", "big", src=list(range(8)), dst=list(range(8))
    )
    assert received.ok and result.ok and len(calls) == 2
    assert small not in own_segments() and len(own_segments()) == 1


@pytest.mark.parametrize("damage", ["unlinked", "truncated"])
def test_damaged_idle_segment_is_replaced(pair, damage):
    """Swept by another container's sender, or truncated (writing past its end is a SIGBUS):
    noticed on reuse, and the transfer takes a new segment."""
    sender, receiver = pair
    transfer(sender, receiver, "shm", request_id="first")
    [pooled] = own_segments()
    if damage == "unlinked":
        os.unlink(shm.path_of(pooled))
    else:
        os.truncate(shm.path_of(pooled), 100)
    assert_serves(sender, receiver, "shm")
    assert len(own_segments()) == 1 and pooled not in own_segments()


def test_receiver_cache_is_bounded():
    sender, receiver = KVSender(make_cache(seed=1)), KVReceiver(make_cache(), shm_cache_segments=2)
    try:
        headers = [send(sender, receiver, f"r{i}") for i in range(3)]
        received = []
        while len(received) < 3:
            received += poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
        assert all(r.ok for r in received)
        assert receiver.segments.names() == [h.shm_name for h in headers[1:]]
        assert mapped_segments() == {h.shm_name for h in headers}  # the sender maps all 3
    finally:
        sender.close()
        receiver.close()
    assert not own_segments() and not mapped_segments()


def test_receiver_drops_mappings_of_unlinked_segments(pair, monkeypatch):
    """Once the sender unlinks a segment (here: on close) the receiver's mapping is all that
    keeps its memory in use: the next poll's sweep drops it."""
    sender, receiver = pair
    transfer(sender, receiver, "shm")
    [name] = receiver.segments.names()
    sender.close()
    assert mapped_segments() == {name} and not own_segments()
    monkeypatch.setattr("kvtransfer.receiver.SHM_SWEEP_EVERY_S", 0.0)
    receiver.poll(lambda h: DST_BLOCKS)
    receiver.poll(lambda h: DST_BLOCKS)
    assert receiver.segments.names() == [] and not mapped_segments()


def test_receiver_refuses_an_oversized_segment(pair):
    """A segment far larger than the payload is not a size class of it: not mapped."""
    sender, receiver = pair
    header = send(sender, receiver, "huge")
    os.truncate(shm.path_of(header.shm_name), 64 * shm.size_class(header.nbytes))
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    assert not received.ok and "header says" in received.reason
    poll_until(sender.poll)
    assert_serves(sender, receiver, "shm")


def test_close_unlinks_pending_segments(pair):
    sender, receiver = pair
    for i in range(3):
        sender.send(receiver.address, make_header(sender.kv_cache, f"r{i}", "shm"), SRC_BLOCKS, 5.0)
    assert len(own_segments()) == 3 and sender.num_pending() == 3
    sender.close()
    assert not own_segments()


def test_segment_names_from_the_wire_are_confined(pair):
    """A header cannot make the receiver open an arbitrary file."""
    sender, receiver = pair
    for name in ["../../etc/passwd", "/etc/passwd", "pdserve-kv-../x", ""]:
        with pytest.raises(shm.SegmentError):
            shm.path_of(name)
    header = make_header(sender.kv_cache, "evil", "shm")
    header.nbytes = sender.kv_cache[:, :, SRC_BLOCKS].nbytes
    header.shm_name = "../../etc/passwd"
    [received], ack = raw_exchange(receiver, [encode(header)])
    assert not received.ok and "bad shm segment name" in received.reason
    assert not ack.ok and ack.request_id == "evil"
    assert_serves(sender, receiver, "shm")


@pytest.mark.e2e  # spawns the receiver process
def test_receiver_in_another_process():
    run_child_transfer("shm", torch.float32)


def test_full_shm_is_a_failed_result(pair, monkeypatch):
    """/dev/shm full (docker's default is 64 MB): a failed transfer, not a crash or a SIGBUS."""
    sender, receiver = pair

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    sender.send(receiver.address, make_header(sender.kv_cache, "full", "shm"), SRC_BLOCKS, 5.0)
    [result] = sender.poll()
    assert not result.ok and "No space left" in result.reason
    assert sender.num_pending() == 0 and not own_segments()
    monkeypatch.undo()
    assert_serves(sender, receiver, "shm")


def test_copy_failure_leaves_no_segment(pair, monkeypatch):
    sender, receiver = pair

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(payload, "gather", broken)
    sender.send(receiver.address, make_header(sender.kv_cache, "x", "shm"), SRC_BLOCKS, 5.0)
    [result] = sender.poll()
    assert not result.ok and "copy failed" in result.reason and not own_segments()


def test_stale_segments_of_dead_senders_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    names = ["pdserve-kv-0-stale-test", f"pdserve-kv-{dead}-0-stale", "pdserve-kv-0-fresh-test"]
    paths = [shm.path_of(name) for name in names]
    try:
        for path in paths:
            with open(path, "wb") as f:
                f.write(b"x")
        old = time.time() - shm.STALE_AFTER_S - 60
        for path in paths[:2]:
            os.utime(path, (old, old))
        KVSender(make_cache()).close()
        assert [os.path.exists(path) for path in paths] == [False, False, True]
    finally:
        for name in names:
            shm.unlink(name)


def test_live_senders_idle_segments_are_not_swept(pair):
    """An idle pooled segment ages, but its sender is running: another sender leaves it."""
    sender, receiver = pair
    transfer(sender, receiver, "shm", request_id="first")
    [pooled] = own_segments()
    old = time.time() - shm.STALE_AFTER_S - 60
    os.utime(shm.path_of(pooled), (old, old))
    KVSender(make_cache()).close()
    assert own_segments() == {pooled}
    assert_serves(sender, receiver, "shm")
    assert own_segments() == {pooled}
    assert os.path.getmtime(shm.path_of(pooled)) > old + 60  # touched when reused
