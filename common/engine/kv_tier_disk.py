"""The disk tier: evicted KV blocks as files in a local directory, one file per block.

A file is named by the block's prefix key (`<key hex>.kvb`) and holds a header (magic, format
version, key, token count, payload size, CRC-32 of tokens and payload), the block's token ids and
its bytes (`kv_tier_store.BlockIO`'s layout). Files are written by a background thread from a
bounded queue, so the engine's step never waits for the disk: a block that finds the queue full is
dropped and counted. Each file is written to a temporary name and renamed, and the sum of file
sizes never exceeds the byte budget (least recently used files are deleted first). A write that
fails (a full disk, a vanished directory) is a counted skip, never a crash; a file that is short,
damaged or of another layout is a counted miss and is deleted, never loaded as KV.

Each store lives in its own subdirectory `pdserve-kv-<pid>-<random>` under the given directory,
held by an exclusive lock on `<subdirectory>.lock` while the store is open, so that workers may
share one directory. On start, every subdirectory whose lock nobody holds (its process died) is
deleted: what a dead worker left is never read. Used by `common.engine.kv_tier`.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import queue
import secrets
import shutil
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from common.engine.kv_tier_store import TierCounters

log = logging.getLogger(__name__)

MAGIC = b"PDKVBLK\x00"
FORMAT_VERSION = 1
# magic, format version, key, token count, payload bytes, CRC-32 of tokens + payload
_HEADER = struct.Struct("<8sI16sIQI")
PREFIX = "pdserve-kv-"
QUEUE_BYTES = 64 << 20  # blocks waiting for the writer, at most (about; at least 4 blocks)


def file_nbytes(num_tokens: int, payload_nbytes: int) -> int:
    return _HEADER.size + 8 * num_tokens + payload_nbytes


def clean_stale(root: Path) -> int:
    """Delete the stores under `root` whose owner is gone (their lock is free); returns how many."""
    removed = 0
    for lock_path in root.glob(PREFIX + "*.lock"):
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live store
        try:
            shutil.rmtree(lock_path.with_suffix(""), ignore_errors=True)
            lock_path.unlink(missing_ok=True)  # after the directory: a crash here is retried
            removed += 1
        finally:
            os.close(fd)
    return removed


class DiskStore:
    """Blocks as checksummed files, LRU within `capacity_bytes`, written off the caller's thread."""

    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, block_nbytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        removed = clean_stale(self.root)
        if removed:
            log.info("KV disk tier: removed %d stale stores under %s", removed, self.root)
        self.capacity_bytes = capacity_bytes
        self.block_nbytes = block_nbytes
        self.counters = TierCounters()
        self.used_bytes = 0  # files written or being written
        self.track_events = False
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._queued: set[bytes] = set()
        self._events: dict[bytes, bool] = {}  # key -> stored (True) or evicted, net
        self._lock_fd, self.path = self._open_own_directory()
        maxsize = max(4, QUEUE_BYTES // max(block_nbytes, 1))
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # a clean exit leaves nothing behind (a crash: the next start)

    def _open_own_directory(self) -> tuple[int, Path]:
        while True:
            name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            lock_path = self.root / (name + ".lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:  # a cleaner may have unlinked the lock between our open and our flock
                if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                    path = self.root / name
                    path.mkdir()
                    return fd, path
            except FileNotFoundError:
                pass
            os.close(fd)

    def _file(self, key: bytes) -> Path:
        return self.path / (key.hex() + ".kvb")

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def put(self, key: bytes, tokens: Sequence[int], data: torch.Tensor) -> bool:
        """Queue a block for writing (`data` must not change afterwards); False if dropped."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._queued:
                return True
            try:
                self._queue.put_nowait((key, tuple(tokens), data))
            except queue.Full:
                self.counters.stores_skipped += 1
                return False
            self._queued.add(key)
            return True

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # never let one bad block stop the writer
                log.exception("KV disk tier: writing a block failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.discard(item[0])
                self._queue.task_done()

    def _write(self, key: bytes, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        size = file_nbytes(len(tokens), data.numel())
        with self._lock:
            if key in self._index:
                return
            if size > self.capacity_bytes:
                self.counters.stores_skipped += 1
                return
            while self.used_bytes + size > self.capacity_bytes and self._index:
                old_key, old_size = self._index.popitem(last=False)
                self._delete(old_key, old_size)
                self.counters.evictions += 1
            self.used_bytes += size  # reserved while the file is written
        token_bytes = np.asarray(tokens, dtype=np.int64).tobytes()
        payload = memoryview(data.numpy())
        crc = zlib.crc32(payload, zlib.crc32(token_bytes))
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, key, len(tokens), len(payload), crc)
        final = self._file(key)
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(token_bytes)
                f.write(payload)
            os.replace(tmp, final)
        except OSError as e:
            with self._lock:
                self.used_bytes -= size
                self.counters.write_errors += 1
                self.counters.stores_skipped += 1
            log.warning("KV disk tier: cannot write %s: %s", final, e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return
        with self._lock:
            self._index[key] = size
            self.counters.stores += 1
            self._record(key, True)

    def _delete(self, key: bytes, size: int) -> None:
        """Forget a file (the lock is held) and delete it."""
        self.used_bytes -= size
        self._record(key, False)
        try:
            self._file(key).unlink(missing_ok=True)
        except OSError:
            pass

    def _record(self, key: bytes, stored: bool) -> None:
        if self.track_events:
            self._events.pop(key, None)
            self._events[key] = stored

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        with self._lock:
            events, self._events = self._events, {}
        return [k for k, s in events.items() if s], [k for k, s in events.items() if not s]

    def get(self, key: bytes, tokens: Sequence[int]) -> torch.Tensor | None:
        """The block's bytes if its file holds `key` with these tokens and passes the checksum;
        a damaged file is deleted (None)."""
        found = self.read(key, touch=True)
        if found is None:
            return None
        held_tokens, data = found
        return data if held_tokens == tuple(tokens) else None

    def read(self, key: bytes, touch: bool = False) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """(tokens, bytes) of a stored block, checked; None if absent or damaged."""
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return None
            if touch:
                self._index.move_to_end(key)
        try:
            with open(self._file(key), "rb") as f:
                header = f.read(_HEADER.size)
                magic, version, file_key, num_tokens, nbytes, crc = _HEADER.unpack(header)
                if (magic, version, file_key) != (MAGIC, FORMAT_VERSION, key) or (
                    nbytes != self.block_nbytes or file_nbytes(num_tokens, nbytes) != size
                ):
                    raise ValueError("header does not match")
                token_bytes = f.read(8 * num_tokens)
                data = torch.empty(nbytes, dtype=torch.uint8)
                got = f.readinto(memoryview(data.numpy()))
                if len(token_bytes) != 8 * num_tokens or got != nbytes or f.read(1):
                    raise ValueError("wrong length")
            if zlib.crc32(memoryview(data.numpy()), zlib.crc32(token_bytes)) != crc:
                raise ValueError("checksum mismatch")
        except (OSError, ValueError, struct.error) as e:
            with self._lock:
                if isinstance(e, FileNotFoundError) and key not in self._index:
                    return None  # the writer evicted it meanwhile: a plain miss
                log.warning("KV disk tier: dropping block %s: %s", key.hex()[:12], e)
                self.counters.corrupt += 1
                if self._index.pop(key, None) is not None:
                    self._delete(key, size)
            return None
        tokens = tuple(np.frombuffer(token_bytes, dtype=np.int64).tolist())
        return tokens, data

    def check(self) -> list[str]:
        with self._lock:
            used = sum(self._index.values())
            writing = self.used_bytes - used
        errors = []
        if writing < 0 or (writing and self._queue.unfinished_tasks == 0):
            errors.append(f"disk tier: {self.used_bytes} bytes counted, {used} in files")
        if self.used_bytes > self.capacity_bytes:
            errors.append(f"disk tier: {self.used_bytes} bytes over a {self.capacity_bytes} bound")
        return errors

    def close(self, remove: bool = True) -> None:
        """Stop the writer (after what is queued) and, with `remove`, delete this store's files."""
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
            (self.root / (self.path.name + ".lock")).unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
