"""The instruction-set levels the C kernels are compiled for, and which one this CPU runs.

A level is a set of compiler flags and the CPU flags (as /proc/cpuinfo names them) its code
needs. Levels are ordered; `candidates` gives, highest first, the levels a source has code for
that the running CPU supports, up to the cap `PDSERVE_CPU_ISA` sets. Machines here change between
AVX2-only and AVX-512 (with VNNI and BF16) from one day to the next and share cache directories,
so nothing is ever compiled for "whatever this host has": the level is chosen here, at load, and
is part of the library's file name and build key (common/kernels/cbuild.py, the only caller).

Which levels a source has code for: any C code gains from portable, avx2 and avx512 (the
compiler vectorises loops with them); avxvnni, avx512vnni and avx512bf16 only add instructions
that the source must ask for, so they count only where the source (or a header next to it)
tests that level's macro in a preprocessor conditional (`__AVXVNNI__`, `__AVX512VNNI__`,
`__AVX512BF16__`): a library without such code loads its avx512 build and the log says so.
avx512bf16 is its own level because Cascade Lake has VNNI without BF16; amx (Sapphire Rapids on:
AMX tiles with int8 and bfloat16 products, `__AMX_INT8__` or `__AMX_BF16__`) sits above it, as
every CPU with AMX has both. The order is linear, so a source with AVX-VNNI code but no AVX-512
VNNI code gets avx512 (no VNNI) on a CPU with both.

`PDSERVE_CPU_ISA=portable|avx2|avxvnni|avx512|avx512vnni|avx512bf16|amx` caps the level: each
library loads the highest level at or below it that it has code for and the CPU runs. A cap above
what the CPU runs falls back to the CPU's highest with a warning (one setting can then serve a
mixed fleet); an unknown name is a ValueError. Off x86-64, and where /proc/cpuinfo cannot be
read, only `portable` (plain -O3) exists.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_ISA"


@dataclass(frozen=True)
class Level:
    name: str
    flags: tuple[str, ...]  # on top of the x86-64 baseline
    cpu_flags: frozenset[str]  # /proc/cpuinfo names
    macros: tuple[str, ...] = ()  # a source has code for the level if it tests one; () = any C


# -march=x86-64: the baseline even where a distribution's compiler defaults to x86-64-v2/v3.
BASELINE_X86 = ("-march=x86-64",)
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX2_CPU = frozenset({"avx2", "fma", "f16c"})
# 256-bit vectors for the loops the compiler vectorises, as a host-tuned build chose on the hosts
# the kernels were measured on (quant_matmul at batch 1 and 8: as fast as that build); hand-written
# 512-bit intrinsics are not affected.
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
           "-mprefer-vector-width=256")  # fmt: skip
_AVX512_CPU = _AVX2_CPU | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}

LEVELS = (
    Level("portable", (), frozenset()),
    Level("avx2", _AVX2, _AVX2_CPU),
    Level("avxvnni", (*_AVX2, "-mavxvnni"), _AVX2_CPU | {"avx_vnni"}, ("__AVXVNNI__",)),
    Level("avx512", _AVX512, _AVX512_CPU),
    Level("avx512vnni", (*_AVX512, "-mavx512vnni"), _AVX512_CPU | {"avx512_vnni"},
          ("__AVX512VNNI__",)),
    Level("avx512bf16", (*_AVX512, "-mavx512vnni", "-mavx512bf16"),
          _AVX512_CPU | {"avx512_vnni", "avx512_bf16"}, ("__AVX512BF16__",)),
    Level("amx", (*_AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8",
                  "-mamx-bf16"),
          _AVX512_CPU | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
          ("__AMX_INT8__", "__AMX_BF16__")),
)  # fmt: skip
BY_NAME = {level.name: level for level in LEVELS}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (the first `flags` line; every core has the same); empty when
    the file is missing (not Linux) or has none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def compile_flags(level: Level) -> list[str]:
    """The compiler flags for `level` on this machine."""
    return [*BASELINE_X86, *level.flags] if is_x86() else []


def runs(level: Level, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with `flags`) runs code built for `level`."""
    if level.name == "portable":
        return True
    return is_x86() and level.cpu_flags <= (cpu_flags() if flags is None else flags)


def used_by(level: Level, texts: Iterable[str]) -> bool:
    """Whether sources with these texts have code for `level`: a preprocessor conditional
    (#if, #ifdef, #elif ...) tests one of its macros; a mention in a comment does not count."""
    if not level.macros:
        return True
    names = "|".join(level.macros)
    conditional = re.compile(rf"^[ \t]*#[ \t]*(?:el)?if.*\b(?:{names})\b", re.MULTILINE)
    return any(conditional.search(text) for text in texts)


def cap(value: str) -> int:
    """Index in LEVELS of the highest level `value` (a $PDSERVE_CPU_ISA setting) allows."""
    if not value:
        return len(LEVELS) - 1
    if value not in BY_NAME:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(BY_NAME)}")
    return LEVELS.index(BY_NAME[value])


def candidates(
    uses: Callable[[Level], bool],
    flags: frozenset[str] | None = None,
    value: str | None = None,
) -> list[Level]:
    """The levels a source has code for (`uses`) that this CPU (or one with `flags`) runs, up to
    the cap (`value`, else $PDSERVE_CPU_ISA), highest first; the last is always `portable`."""
    value = os.environ.get(ENV, "") if value is None else value
    top = cap(value)
    if value and not runs(LEVELS[top], flags):
        _warn_above_cpu(value)
    return [lv for lv in LEVELS[: top + 1] if runs(lv, flags) and uses(lv)][::-1]


@functools.cache
def _warn_above_cpu(value: str) -> None:
    log.warning(
        "%s=%s: this CPU lacks some of %s; the C kernels load the highest level it runs",
        ENV, value, " ".join(sorted(BY_NAME[value].cpu_flags)),
    )  # fmt: skip
