"""Building and loading the project's C kernels: one compile per source, flags, ISA level and
compiler, cached.

Owns the cache location (`$PDSERVE_CACHE/kernels/`), the build key, the compile (the system's C
compiler, `$CC` first; written to a temporary name and renamed, so concurrent builders never
load a half-written file), the ctypes signatures and the build-once-on-first-use state. A failed
build is remembered and logged once; callers then use their torch path. Used by
`cpu_attention`, `cpu_ops`, `cpu_quant` and `cpu_layer` (which links the other three's sources
into its library).

Each library is built on first use for one instruction-set level only: the highest one that its
sources have code for, the CPU runs, `PDSERVE_CPU_ISA` allows and the compiler accepts
(common/kernels/isa.py); a log line names the level each library loaded. Callers pass the
ISA-independent flags; the level's flags are added here, and a host-tuned -march/-mtune/-mcpu
is dropped with a warning (it would build code only its own kind of host runs). The file is
`<source>-<level>-<key>.so`, the key a hash of the compiler's identity (its path and `--version`
output), every flag of every compile and the contents of the sources and of the headers next to
them. Never the host's name: hosts sharing a cache share the builds, and a host only loads
levels its CPU runs.

Never build with -ffast-math (nor -Ofast, -funsafe-math-optimizations): gcc then links
crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
process the moment the library loads. `REDUCTION_FLAGS` are the parts of -ffast-math that
vectorized reductions need; they act only on the file compiled with them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from common.kernels import isa

log = logging.getLogger(__name__)

REDUCTION_FLAGS = (
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
)
_NATIVE = re.compile(r"-m(arch|tune|cpu)=native")  # flags a caller must not pass (see above)

Unit = tuple[Path, list[str]]  # a source and its ISA-independent flags


def cache_dir() -> Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(base) / "kernels"


def find_compiler() -> str | None:
    """The C compiler's path: `$CC`, else gcc, else cc; None when there is none."""
    name = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    return shutil.which(name) if name else None


@functools.cache
def compiler_identity(compiler: str) -> bytes:
    """The compiler's path and `--version` output: what its output depends on besides flags."""
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return f"{compiler}\0{result.stdout}".encode()


@functools.cache
def accepts(compiler: str, flags: tuple[str, ...]) -> bool:
    """Whether the compiler takes `flags` (an older one may not know a level's -m options)."""
    cmd = [compiler, "-x", "c", "-c", *flags, "-", "-o", os.devnull]
    result = subprocess.run(cmd, input="int x;\n", capture_output=True, text=True, timeout=60)
    return result.returncode == 0


def headers(path: Path) -> list[Path]:
    """The headers a source may include: every .h next to it."""
    return sorted(path.parent.glob("*.h"))


def level_for(compiler: str, source: Path) -> isa.Level:
    """The ISA level `source` is built at on this host (isa.candidates, then the compiler)."""
    texts = [p.read_text() for p in (source, *headers(source))]
    for level in isa.candidates(lambda lv: isa.used_by(lv, texts)):
        if level.name == "portable" or accepts(compiler, tuple(isa.compile_flags(level))):
            return level
    raise AssertionError("portable is always a candidate")


def build_key(compiler: str, commands: Sequence[Sequence[str]], sources: Sequence[Path]) -> str:
    """The cache key of a library: the compiler's identity, every compile and link command's
    arguments but the file names, and the contents of the sources and their headers."""
    key = [compiler_identity(compiler), platform.machine().encode()]
    key += ["\0".join(cmd).encode() for cmd in commands]
    key += [p.read_bytes() for p in sources]
    key += [h.read_bytes() for h in sorted({h for p in sources for h in headers(p)})]
    return hashlib.sha256(b"\1".join(key)).hexdigest()[:16]


def _without_native(flags: Sequence[str], what: str) -> list[str]:
    if any(_NATIVE.fullmatch(f) for f in flags):
        log.warning("%s: dropping -march/-mtune=native (cbuild adds the ISA level's flags)", what)
    return [f for f in flags if not _NATIVE.fullmatch(f)]


def build(units: Sequence[Unit], what: str) -> tuple[ctypes.CDLL | None, str]:
    """Compile the first unit's source, with the other units' linked in (each compiled with its
    own flags at its own ISA level, the one it gets built alone, so a part's code is the same
    in either library), into a shared library, once per key, and load it: (library, level);
    the library is None, with a warning naming `what`, when no compiler is found or the
    compile fails. The level is the highest of the units'."""
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: %s falls back to torch", what)
        return None, "portable"
    levels = [level_for(compiler, path) for path, _ in units]
    level = max(levels, key=isa.LEVELS.index)
    unit_flags = [
        [*isa.compile_flags(lv), *_without_native(flags, what)]
        for lv, (_, flags) in zip(levels, units)
    ]
    openmp = sorted({f for flags in unit_flags for f in flags if f == "-fopenmp"})
    # file names are filled in below; the key sees the arguments only
    compiles = [[compiler, "-c", "-fPIC", *flags] for flags in unit_flags]
    link = [compiler, "-shared", "-fPIC", *openmp]
    sources = [path for path, _ in units]
    tag = build_key(compiler, [*compiles, link], sources)
    target = cache_dir() / f"{sources[0].stem}-{level.name}-{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            objects = [str(Path(tmp) / f"{i}-{path.stem}.o") for i, path in enumerate(sources)]
            commands = [
                [*cmd, str(path), "-o", obj] for cmd, path, obj in zip(compiles, sources, objects)
            ]
            commands.append([*link, *objects, "-o", str(out), "-lm"])
            for cmd in commands:
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    log.warning("building %s failed: %s", sources[0].name, result.stderr[-2000:])
                    return None, level.name
            os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    return ctypes.CDLL(str(target)), level.name


class CLibrary:
    """A C kernel library built on first use, with each function's ctypes signature set."""

    def __init__(
        self,
        source: Path,
        flags: Sequence[str],
        signatures: dict[str, list],
        what: str,
        parts: Sequence[CLibrary] = (),
    ) -> None:
        """`flags`: the ISA-independent ones (the level's are added at build); `parts`: other
        libraries whose sources are linked into this one (see `build`)."""
        self.source, self.flags, self.signatures, self.what = source, list(flags), signatures, what
        self.parts = [(part.source, part.flags) for part in parts]
        self.lib: ctypes.CDLL | None = None
        self.level: str | None = None  # the ISA level loaded, once built
        self.failed = False

    def available(self) -> bool:
        """True when the library is loaded (building it on the first call)."""
        if self.lib is None and not self.failed:
            try:
                lib, level = build([(self.source, self.flags), *self.parts], self.what)
                for name, argtypes in self.signatures.items() if lib is not None else ():
                    fn = getattr(lib, name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = argtypes
                self.lib = lib
                if lib is not None:
                    self.level = level
                    log.info("%s: %s loaded, ISA level %s", self.what, self.source.name, level)
            except OSError as exc:
                log.warning("loading %s failed: %s", self.what, exc)
            self.failed = self.lib is None
        return self.lib is not None

    def get(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError when it could not be built."""
        if not self.available():
            raise RuntimeError(f"{self.what} could not be built")
        return self.lib
