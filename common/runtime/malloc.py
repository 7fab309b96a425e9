"""glibc's malloc thresholds: what each kind of process sets once, at start.

glibc gives memory back to the kernel in two ways: a chunk above the mmap threshold is its own
mapping, unmapped when freed; the free top of a heap above the trim threshold is trimmed. Both
thresholds start at 128 KiB and grow with what the process frees (the mmap threshold to the
largest mapped chunk freed, at most 32 MiB, the trim threshold to twice that). Memory given
back and asked for again is faulted in page by page, each page zeroed by the kernel.

- An engine on the CPU (`keep_step_buffers`: workers, `pdserve run-batch`) allocates and frees
  the same large activations every step: a prompt step of 32 x 256 tokens of the default model
  frees hundreds of MiB of them, more than a trim threshold of at most 64 MiB, so glibc trims
  them and the next step faults them in again. Measured (benchmarks/README.md, "Prefill page
  faults"): four such steps took 0.24-1.34 million page faults and 0.4-2.2 s of kernel time;
  with the mmap threshold at glibc's largest (32 MiB) and the trim threshold at 1 GiB, 41-55
  thousand and 0.1 s, and the steps after the first 1.16-1.46 s instead of 1.31-1.79 s. The
  process keeps what it freed up to its peak: its memory levels off at the peak's instead of
  falling back between steps. Chunks over 32 MiB are still mapped and unmapped each time.
- The router (router.memory.pin_malloc_thresholds) pins both at glibc's starting values
  instead: it must give a large request's memory back.

Either leaves the thresholds alone where the environment sets them (MALLOC_*_THRESHOLD_, or any
glibc.malloc.* tunable in GLIBC_TUNABLES), and does nothing without glibc (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

STEP_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64 bits)
STEP_TRIM_THRESHOLD = 2**30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>
_ENV_THRESHOLDS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def libc_function(name: str) -> ctypes._CFuncPtr | None:
    """The C library's function `name`, or None where there is none (not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def environment_sets_thresholds() -> bool:
    """True when the environment sets glibc's malloc thresholds or tunables itself."""
    if any(os.environ.get(name) for name in _ENV_THRESHOLDS):
        return True
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def set_thresholds(trim: int, mmap: int) -> bool:
    """Fix glibc's trim and mmap thresholds (in bytes; no dynamic growth after): whether they
    were set. Process-wide; nothing where the environment sets them or without glibc."""
    if environment_sets_thresholds():
        return False
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting either threshold also turns off glibc's adjustment
    trimmed = mallopt(_M_TRIM_THRESHOLD, trim) == 1
    return mallopt(_M_MMAP_THRESHOLD, mmap) == 1 and trimmed


def keep_step_buffers() -> bool:
    """An engine process on the CPU: keep what a step frees for the next step (above). Returns
    whether the thresholds were set, and logs what it did."""
    if set_thresholds(STEP_TRIM_THRESHOLD, STEP_MMAP_THRESHOLD):
        log.info(
            "malloc: chunks under %d MiB from the heap, kept up to %d MiB free between steps",
            STEP_MMAP_THRESHOLD >> 20,
            STEP_TRIM_THRESHOLD >> 20,
        )
        return True
    log.info("malloc thresholds left as they are (set by the environment, or no glibc)")
    return False
