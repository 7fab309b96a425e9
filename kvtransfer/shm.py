"""Shared-memory segments for the `shm` transport: one file per transfer under /dev/shm.

The sender (`kvtransfer.sender`) creates a segment, gathers the payload straight into it, and
unlinks it when the transfer ends (ack, refusal, deadline, abort, close). The receiver
(`kvtransfer.receiver`) maps it read-only by name, validates, copies, and unmaps. Plain files
rather than `multiprocessing.shared_memory`: its resource tracker would unlink (and warn about)
segments a receiver merely opened. Where /dev/shm does not exist (macOS) the temp dir serves.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import tempfile
import time

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "pdserve-kv-"
# Names arrive from the network: only our own pattern, so a header cannot name another file.
_NAME = re.compile(r"pdserve-kv-[0-9A-Za-z_-]{1,64}")
_counter = itertools.count()
# Transfers live seconds; a segment this old was left by a sender that died mid-transfer.
STALE_AFTER_S = 600.0
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


class SegmentError(Exception):
    """A segment that is missing or not the size its header claims."""


def path_of(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise SegmentError(f"bad shm segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def new_name() -> str:
    return f"{PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"


def create(name: str, nbytes: int) -> mmap.mmap:
    """A new segment of `nbytes` (> 0), mapped read-write; the caller unmaps it and unlinks it."""
    fd = os.open(path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            # Reserve the pages now: a full /dev/shm (docker's default is 64 MB) then fails here
            # with ENOSPC instead of killing the process with SIGBUS in the middle of the copy.
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        # Map every page now, in one call: cheaper than one page fault per 4 KiB while copying.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
    except BaseException:
        os.unlink(path_of(name))
        raise
    finally:
        os.close(fd)


def open_readonly(name: str, nbytes: int) -> mmap.mmap:
    """Map an existing segment read-only; SegmentError when missing or not exactly `nbytes`."""
    try:
        fd = os.open(path_of(name), os.O_RDONLY)
    except FileNotFoundError:
        raise SegmentError(f"shm segment {name} is gone") from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise SegmentError(f"shm segment holds {size} bytes, header says {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def close_quietly(segment: mmap.mmap) -> None:
    """Unmap now, or (if a tensor view still holds it) when the last view is collected."""
    try:
        segment.close()
    except BufferError:
        pass


def unlink(name: str) -> None:
    try:
        os.unlink(path_of(name))
    except FileNotFoundError:
        pass


def remove_stale(max_age_s: float = STALE_AFTER_S) -> int:
    """Unlink segments left behind by crashed senders (by age: pids mean nothing across the
    containers that may share /dev/shm); returns how many. Called when a sender starts."""
    removed, cutoff = 0, time.time() - max_age_s
    for name in os.listdir(SHM_DIR):
        if not _NAME.fullmatch(name):
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_mtime < cutoff:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
        except FileNotFoundError:
            pass
    return removed
