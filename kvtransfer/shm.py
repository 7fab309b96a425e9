"""Shared-memory segments for the `shm` transport: files under /dev/shm, reused across transfers.

The sender (`kvtransfer.sender`) takes a segment from its `SegmentPool`, gathers the payload
straight into the mapping and sends only the header. When the receiver replies (ack or refusal)
the receiver is done reading, so the segment goes back to the pool, still mapped, for the next
transfer; after a deadline, an abort or a failed send the receiver may still be reading it, so
it is unlinked instead and never written again. The receiver (`kvtransfer.receiver`) maps a
segment read-only by name and keeps the mapping in a bounded `SegmentCache` while that name
still names the same file. Creating, faulting in and unmapping a fresh 200 MB segment per
transfer cost more than copying the KV itself.

Names: `pdserve-kv-{pid}-{serial}-{random hex}`, pid being the creating sender's. A segment
keeps its name for life (a new segment gets a new name), so the same name arrives in many
headers; the payload is always the first `header.nbytes` bytes of it, the file being a little
larger (`size_class`). Plain files rather than `multiprocessing.shared_memory`: its resource
tracker would unlink (and warn about) segments a receiver merely opened. Where /dev/shm does not
exist (macOS) the temp dir serves.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "pdserve-kv-"
# Names arrive from the network: only our own pattern, so a header cannot name another file.
_NAME = re.compile(r"pdserve-kv-[0-9A-Za-z_-]{1,64}")
_counter = itertools.count()
# Transfers live seconds and a pooled segment is touched each time it is reused: one this old
# whose sender is not running here was left by a sender that died.
STALE_AFTER_S = 600.0
POOL_BYTES = 1 << 30  # default cap on the segments a sender keeps mapped
CACHE_SEGMENTS, CACHE_BYTES = 32, 4 << 30  # default caps on a receiver's cached mappings
_PAGE = mmap.PAGESIZE
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


class SegmentError(Exception):
    """A segment that is missing or not a size its header allows."""


@dataclass
class Segment:
    """One mapped segment file: `inode` tells it from a later file of the same name."""

    name: str
    size: int
    inode: int
    mapping: mmap.mmap


def path_of(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise SegmentError(f"bad shm segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def new_name() -> str:
    return f"{PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"


def size_class(nbytes: int) -> int:
    """The segment size for a payload: whole pages, rounded up to 3 significant bits (at most
    25% over), so that payloads of similar size share segments."""
    step = max(_PAGE, 1 << max(0, nbytes.bit_length() - 3))
    return -(-nbytes // step) * step


def fits(size: int, nbytes: int) -> bool:
    """Whether a segment of `size` bytes may carry a payload of `nbytes`: big enough, and not so
    big that a receiver would map far more than the transfer needs."""
    return nbytes <= size <= 2 * size_class(nbytes)


def map_file(fd: int, size: int, writable: bool) -> mmap.mmap:
    """Map a whole segment with every page in place now: cheaper, in one call, than one page
    fault per 4 KiB while copying."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)


def create(size: int) -> Segment:
    """A new segment of `size` (> 0) bytes under a new name, mapped read-write."""
    name = new_name()
    fd = os.open(path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            # Reserve the pages now: a full /dev/shm (docker's default is 64 MB) then fails here
            # with ENOSPC instead of killing the process with SIGBUS in the middle of the copy.
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        return Segment(name, size, os.fstat(fd).st_ino, map_file(fd, size, writable=True))
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def close_quietly(mapping: mmap.mmap) -> None:
    """Unmap now, or (if a tensor view still holds it) when the last view is collected."""
    try:
        mapping.close()
    except BufferError:
        pass


def unlink(name: str) -> None:
    try:
        os.unlink(path_of(name))
    except FileNotFoundError:
        pass


class SegmentPool:
    """The sender's segments: each one lent to one transfer at a time (`acquire`), then kept
    mapped for reuse (`release`, once the receiver has replied) or unlinked (`discard`).

    Idle segments are kept while idle + lent bytes stay within `budget_bytes`, least recently
    used given back first; a transfer is never refused for the budget, only its segment is then
    unlinked when it ends."""

    def __init__(self, budget_bytes: int = POOL_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.idle: list[Segment] = []  # least recently released first
        self.lent: dict[str, Segment] = {}

    def mapped_bytes(self) -> int:
        return sum(s.size for s in self.idle) + sum(s.size for s in self.lent.values())

    def acquire(self, nbytes: int) -> Segment:
        """A segment for a payload of `nbytes` (> 0): an idle one that fits, else a new one."""
        for segment in sorted(self.idle, key=lambda s: s.size):
            if fits(segment.size, nbytes):
                self.idle.remove(segment)
                if self._intact(segment):
                    self.lent[segment.name] = segment
                    return segment
                self._unmap_and_unlink(segment)
        size = size_class(nbytes)
        self._trim(room=size)
        try:
            segment = create(size)
        except OSError:  # most likely /dev/shm is full: give back the idle segments, try again
            if not self.idle:
                raise
            while self.idle:
                self._unmap_and_unlink(self.idle.pop(0))
            segment = create(size)
        self.lent[segment.name] = segment
        return segment

    def release(self, segment: Segment) -> None:
        """The receiver has replied: nobody reads the segment now; keep it for reuse."""
        del self.lent[segment.name]
        self.idle.append(segment)
        self._trim()

    def discard(self, segment: Segment) -> None:
        """The receiver may still be reading: unlink the segment, never write it again."""
        del self.lent[segment.name]
        self._unmap_and_unlink(segment)

    def close(self) -> None:
        """Unlink every segment, lent or idle."""
        for segment in [*self.idle, *self.lent.values()]:
            self._unmap_and_unlink(segment)
        self.idle.clear()
        self.lent.clear()

    def _intact(self, segment: Segment) -> bool:
        """Still our file at its size (not swept, replaced or truncated: writing past the end of
        a truncated file is a SIGBUS); touched, so that no sender sweeps it as stale."""
        path = path_of(segment.name)
        try:
            stat = os.stat(path)
            if (stat.st_ino, stat.st_size) != (segment.inode, segment.size):
                return False
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def _trim(self, room: int = 0) -> None:
        """Give back idle segments, oldest first, until `room` more bytes fit in the budget."""
        while self.idle and self.mapped_bytes() + room > self.budget_bytes:
            self._unmap_and_unlink(self.idle.pop(0))

    @staticmethod
    def _unmap_and_unlink(segment: Segment) -> None:
        unlink(segment.name)
        close_quietly(segment.mapping)


class SegmentCache:
    """The receiver's read-only mappings by segment name, most recently used last: at most
    `max_segments` and `max_bytes` (the newest is kept whatever its size). A mapping is used
    only while its name still names the same file; `sweep` drops those whose file is gone."""

    def __init__(self, max_segments: int = CACHE_SEGMENTS, max_bytes: int = CACHE_BYTES) -> None:
        assert max_segments >= 1
        self.max_segments, self.max_bytes = max_segments, max_bytes
        self._segments: OrderedDict[str, Segment] = OrderedDict()

    def names(self) -> list[str]:
        return list(self._segments)

    def map(self, name: str, nbytes: int) -> mmap.mmap:
        """The mapping of segment `name` for a payload of `nbytes`; SegmentError when the name is
        not ours, the file is missing, or its size does not fit (`fits`)."""
        path = path_of(name)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            self._drop(name)
            raise SegmentError(f"shm segment {name} is gone") from None
        segment = self._segments.get(name)
        if segment is not None and (segment.inode, segment.size) != (stat.st_ino, stat.st_size):
            self._drop(name)  # replaced or resized since we mapped it
            segment = None
        if segment is None:
            segment = self._open(name, path, nbytes)
            self._segments[name] = segment
            self._trim()
        elif not fits(segment.size, nbytes):
            raise SegmentError(f"shm segment holds {segment.size} bytes, header says {nbytes}")
        self._segments.move_to_end(name)
        return segment.mapping

    def sweep(self) -> None:
        """Drop the mappings of segments unlinked or replaced since (their senders are done with
        them): an unlinked file's memory stays in use as long as someone maps it."""
        for name, segment in list(self._segments.items()):
            try:
                stat = os.stat(path_of(name))
                if (stat.st_ino, stat.st_size) == (segment.inode, segment.size):
                    continue
            except FileNotFoundError:
                pass
            self._drop(name)

    def close(self) -> None:
        for name in list(self._segments):
            self._drop(name)

    @staticmethod
    def _open(name: str, path: str, nbytes: int) -> Segment:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentError(f"shm segment {name} is gone") from None
        try:
            stat = os.fstat(fd)  # the file we map, whatever the name names by now
            if not fits(stat.st_size, nbytes):
                raise SegmentError(f"shm segment holds {stat.st_size} bytes, header says {nbytes}")
            return Segment(name, stat.st_size, stat.st_ino, map_file(fd, stat.st_size, False))
        finally:
            os.close(fd)

    def _trim(self) -> None:
        while len(self._segments) > 1 and (
            len(self._segments) > self.max_segments
            or sum(s.size for s in self._segments.values()) > self.max_bytes
        ):
            self._drop(next(iter(self._segments)))

    def _drop(self, name: str) -> None:
        segment = self._segments.pop(name, None)
        if segment is not None:
            close_quietly(segment.mapping)


def _owner_alive(name: str) -> bool:
    """Whether the pid in a segment's name is a live process in this pid namespace."""
    pid = name.removeprefix(PREFIX).split("-", 1)[0]
    try:
        if int(pid) <= 0:
            return False
        os.kill(int(pid), 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale(max_age_s: float = STALE_AFTER_S) -> int:
    """Unlink segments left behind by crashed senders; returns how many. Called when a sender
    starts. Stale means both: not touched for `max_age_s` (a sender touches a pooled segment
    whenever it reuses it) and its pid not running here. Either alone is not enough: a live
    sender's idle pool ages, and pids mean nothing across the containers that may share
    /dev/shm (a segment swept from under a live sender is noticed when it is next reused)."""
    removed, cutoff = 0, time.time() - max_age_s
    for name in os.listdir(SHM_DIR):
        if not _NAME.fullmatch(name) or _owner_alive(name):
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_mtime < cutoff:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
        except FileNotFoundError:
            pass
    return removed
