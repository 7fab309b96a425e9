"""shm transport (kvtransfer.shm through the sender and receiver): real segments under /dev/shm,
written by the sender, read by the receiver, unlinked when the transfer ends."""

from __future__ import annotations

import errno
import os
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
    assert not own_segments()


@pytest.mark.parametrize("pair", [torch.float32, torch.bfloat16], indirect=True)
def test_blocks_arrive_exactly_and_segment_goes(pair):
    sender, receiver = pair
    header = make_header(sender.kv_cache, transport="shm")
    sender.send(receiver.address, header, SRC_BLOCKS, 5.0)
    # Until the ack, the payload sits in one segment of exactly the header's size.
    assert own_segments() == {header.shm_name}
    assert os.path.getsize(shm.path_of(header.shm_name)) == header.nbytes
    [received] = poll_until(lambda: receiver.poll(lambda h: DST_BLOCKS, timeout_ms=20))
    [result] = poll_until(sender.poll)
    assert received.ok and result.ok and result.nbytes == header.nbytes
    src = sender.kv_cache[:, :, SRC_BLOCKS]
    assert header.nbytes == src.nbytes
    assert torch.equal(receiver.kv_cache[:, :, DST_BLOCKS], src)
    assert not own_segments()


def test_many_transfers_leave_no_segment(pair):
    sender, receiver = pair
    for i in range(5):
        received, result = transfer(sender, receiver, "shm", request_id=f"r{i}")
        assert received.ok and result.ok
    assert not own_segments()


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
    stale, fresh = shm.path_of("pdserve-kv-0-stale-test"), shm.path_of("pdserve-kv-0-fresh-test")
    try:
        for path in (stale, fresh):
            with open(path, "wb") as f:
                f.write(b"x")
        old = time.time() - shm.STALE_AFTER_S - 60
        os.utime(stale, (old, old))
        KVSender(make_cache()).close()
        assert not os.path.exists(stale) and os.path.exists(fresh)
    finally:
        shm.unlink("pdserve-kv-0-stale-test")
        shm.unlink("pdserve-kv-0-fresh-test")
