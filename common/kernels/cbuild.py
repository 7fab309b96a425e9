"""Building and loading the project's C kernels: one compile per source, flags and host, cached.

Owns the cache location (`$PDSERVE_CACHE/kernels/`), the compile (the system's C compiler, `$CC`
first; written to a temporary name and renamed, so concurrent builders never load a half-written
file), the ctypes signatures and the build-once-on-first-use state. A failed build is remembered
and logged once; callers then use their torch path. Used by `cpu_attention`, `cpu_ops`,
`cpu_quant` and `cpu_layer` (which links the other three's sources into its library).

Never build with -ffast-math (nor -Ofast, -funsafe-math-optimizations): gcc then links
crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
process the moment the library loads. `REDUCTION_FLAGS` are the parts of -ffast-math that
vectorized reductions need; they act only on the file compiled with them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

REDUCTION_FLAGS = (
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
)


def cache_dir() -> Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(base) / "kernels"


def build(
    source: Path,
    flags: Sequence[str],
    what: str,
    parts: Sequence[tuple[Path, Sequence[str]]] = (),
) -> ctypes.CDLL | None:
    """Compile `source` into a shared library (once per source, flags and host) and load it;
    None, with a warning naming `what`, when no compiler is found or the compile fails.

    `parts` are further (source, flags) pairs linked into the same library, each compiled with
    its own flags (one object per source), so a file can call another's entry points directly."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: %s falls back to torch", what)
        return None
    units = [(source, list(flags)), *((Path(p), list(f)) for p, f in parts)]
    # -march=native output only runs where it was built: key the file by sources and host.
    key = [platform.node().encode(), platform.machine().encode()]
    for path, unit_flags in units:
        key += [path.read_bytes(), " ".join(unit_flags).encode()]
    for header in sorted({h for path, _ in units for h in path.parent.glob("*.h")}):
        key.append(header.read_bytes())  # the shared headers the sources include
    tag = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            if len(units) == 1:
                commands = [
                    [compiler, "-shared", "-fPIC", *flags, str(source), "-o", str(out), "-lm"]
                ]
            else:
                objects = [
                    str(Path(tmp) / f"{i}-{path.stem}.o") for i, (path, _) in enumerate(units)
                ]
                commands = [
                    [compiler, "-c", "-fPIC", *unit_flags, str(path), "-o", obj]
                    for (path, unit_flags), obj in zip(units, objects)
                ]
                link = sorted({f for _, unit_flags in units for f in unit_flags if f == "-fopenmp"})
                commands.append(
                    [compiler, "-shared", "-fPIC", *link, *objects, "-o", str(out), "-lm"]
                )
            for cmd in commands:
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    log.warning("building %s failed: %s", source.name, result.stderr[-2000:])
                    return None
            os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    return ctypes.CDLL(str(target))


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
        """`parts`: other libraries whose sources are linked into this one (see `build`)."""
        self.source, self.flags, self.signatures, self.what = source, list(flags), signatures, what
        self.parts = [(part.source, part.flags) for part in parts]
        self.lib: ctypes.CDLL | None = None
        self.failed = False

    def available(self) -> bool:
        """True when the library is loaded (building it on the first call)."""
        if self.lib is None and not self.failed:
            try:
                lib = build(self.source, self.flags, self.what, self.parts)
                for name, argtypes in self.signatures.items() if lib is not None else ():
                    fn = getattr(lib, name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = argtypes
                self.lib = lib
            except OSError as exc:
                log.warning("loading %s failed: %s", self.what, exc)
            self.failed = self.lib is None
        return self.lib is not None

    def get(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError when it could not be built."""
        if not self.available():
            raise RuntimeError(f"{self.what} could not be built")
        return self.lib
