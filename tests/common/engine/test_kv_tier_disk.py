"""common/engine/kv_tier_disk.py on a real directory: write and read back, the byte bound, damaged
and partial files (a miss, the file deleted), a full disk and a vanished directory (counted
write errors, no crash), a full queue (counted drops), and cleaning what dead stores left."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from common.engine import kv_tier_disk
from common.engine.kv_tier_disk import DiskStore, file_nbytes

BLOCK = 256  # bytes of one block's KV in these tests
TOKENS = [3, 1, 4, 1]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int) -> torch.Tensor:
    return torch.arange(BLOCK, dtype=torch.int64).add(i).to(torch.uint8)


FILE = file_nbytes(len(TOKENS), BLOCK)


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path, capacity_bytes=3 * FILE, block_nbytes=BLOCK)
    s.track_events = True
    yield s
    assert s.check() == []
    s.close()


def test_write_then_read_back(store):
    assert store.put(key(1), TOKENS, block(1))
    store.flush()
    assert key(1) in store and store.used_bytes == FILE
    assert torch.equal(store.get(key(1), TOKENS), block(1))
    assert store.get(key(1), [3, 1, 4, 2]) is None  # another prefix under the key: a miss
    assert store.get(key(2), TOKENS) is None
    files = list(store.path.iterdir())
    assert [f.name for f in files] == [key(1).hex() + ".kvb"] and files[0].stat().st_size == FILE
    assert store.read(key(1))[0] == tuple(TOKENS)
    assert store.drain_events() == ([key(1)], [])
    assert store.counters.stores == 1


def test_byte_bound_evicts_least_recently_used(store):
    for i in range(3):
        store.put(key(i), TOKENS, block(i))
    store.flush()
    assert store.get(key(0), TOKENS) is not None  # 0 is now the most recent
    for i in (3, 4):
        store.put(key(i), TOKENS, block(i))
    store.flush()
    assert set(store.keys()) == {key(0), key(3), key(4)}
    assert store.used_bytes == 3 * FILE <= store.capacity_bytes
    assert sum(f.stat().st_size for f in store.path.iterdir()) == store.used_bytes
    assert store.counters.evictions == 2
    stored, evicted = store.drain_events()
    assert set(stored) == {key(0), key(3), key(4)} and set(evicted) == {key(1), key(2)}


def test_a_block_bigger_than_the_bound_is_skipped(tmp_path):
    store = DiskStore(tmp_path, capacity_bytes=FILE - 1, block_nbytes=BLOCK)
    store.put(key(1), TOKENS, block(1))
    store.flush()
    assert len(store) == 0 and store.used_bytes == 0 and store.counters.stores_skipped == 1
    store.close()


@pytest.mark.parametrize(
    "damage",
    ["payload byte", "token", "header", "truncated", "appended", "empty", "missing"],
)
def test_a_damaged_file_is_a_miss_and_is_deleted(store, damage):
    store.put(key(1), TOKENS, block(1))
    store.flush()
    path = store.path / (key(1).hex() + ".kvb")
    raw = bytearray(path.read_bytes())
    header = len(raw) - BLOCK - 8 * len(TOKENS)
    if damage == "payload byte":
        raw[-7] ^= 0x10
    elif damage == "token":
        raw[header] ^= 0x01
    elif damage == "header":
        raw[0] ^= 0xFF
    elif damage == "truncated":
        raw = raw[:-10]  # a partial write
    elif damage == "appended":
        raw += b"\0"
    elif damage == "empty":
        raw = bytearray()
    if damage == "missing":  # deleted behind the store's back
        path.unlink()
    else:
        path.write_bytes(bytes(raw))
    assert store.get(key(1), TOKENS) is None
    assert store.counters.corrupt == 1
    assert not path.exists() and key(1) not in store and store.used_bytes == 0
    assert store.drain_events() == ([], [key(1)])  # the router hears it is gone (net: never)


def test_full_disk_is_a_counted_write_error(store):
    """The temporary file is a link to /dev/full: every write fails with ENOSPC."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    tmp = store.path / (key(1).hex() + ".tmp")
    tmp.symlink_to("/dev/full")
    store.put(key(1), TOKENS, block(1))
    store.flush()
    assert key(1) not in store and store.used_bytes == 0
    assert store.counters.write_errors == 1 and store.counters.stores_skipped == 1
    assert not tmp.exists() and not tmp.is_symlink()
    store.put(key(1), TOKENS, block(1))  # the disk has room again
    store.flush()
    assert torch.equal(store.get(key(1), TOKENS), block(1))


def test_a_vanished_directory_is_a_counted_write_error(tmp_path):
    store = DiskStore(tmp_path, capacity_bytes=3 * FILE, block_nbytes=BLOCK)
    store.path.rmdir()
    store.path.write_bytes(b"not a directory")  # writes below it fail (ENOTDIR)
    store.put(key(1), TOKENS, block(1))
    store.flush()
    assert store.counters.write_errors == 1 and store.used_bytes == 0 and len(store) == 0
    store.path.unlink()
    store.close()


def test_a_full_queue_drops_and_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_tier_disk, "QUEUE_BYTES", 0)  # room for 4 blocks
    store = DiskStore(tmp_path, capacity_bytes=100 * FILE, block_nbytes=BLOCK)
    gate = threading.Event()
    write = store._write
    monkeypatch.setattr(store, "_write", lambda *a: (gate.wait(), write(*a)))
    accepted = [store.put(key(i), TOKENS, block(i)) for i in range(8)]
    # the writer holds one block while it waits, the queue four more
    assert accepted.count(True) in (4, 5) and store.counters.stores_skipped == accepted.count(False)
    gate.set()
    store.flush()
    assert len(store) == accepted.count(True)
    store.close()


def test_stale_stores_are_cleaned_on_start_live_ones_kept(tmp_path):
    dead = DiskStore(tmp_path, capacity_bytes=3 * FILE, block_nbytes=BLOCK)
    dead.put(key(1), TOKENS, block(1))
    dead.flush()
    dead.close(remove=False)  # as if its process died: files left, lock released
    assert dead.path.exists()
    alive = DiskStore(tmp_path, capacity_bytes=3 * FILE, block_nbytes=BLOCK)
    alive.put(key(2), TOKENS, block(2))
    alive.flush()
    other = tmp_path / "someone-elses-file"
    other.write_text("kept")
    new = DiskStore(tmp_path, capacity_bytes=3 * FILE, block_nbytes=BLOCK)
    assert not dead.path.exists() and not Path(str(dead.path) + ".lock").exists()
    assert alive.path.exists() and key(2) in alive and other.exists()
    assert len(new) == 0  # a new store never reads what another left
    for s in (alive, new):
        s.close()
    assert sorted(os.listdir(tmp_path)) == ["someone-elses-file"]
