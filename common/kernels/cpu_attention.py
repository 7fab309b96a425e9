"""The CPU decode-attention kernel: a small C file compiled once with the system's C compiler.

Decode attention on the CPU is memory-bound, and the torch formulation has to gather every
sequence's KV blocks into a padded copy first (several times the bytes attention itself reads).
`csrc/paged_decode.c` reads the blocks in place through the block table instead. It is built on
first use into `$PDSERVE_CACHE/kernels/` and called through ctypes (which releases the GIL);
where no C compiler is found, `available()` is False and the torch path is used. Called by
common.kernels.attention.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -fopenmp links the libgomp torch already loaded (same soname): one thread pool, not two competing.
# Not -ffast-math (nor -Ofast, -funsafe-math-optimizations): with those gcc links crtfastmath.o,
# whose constructor turns on flush-to-zero / denormals-are-zero for the whole process the moment
# the library loads, changing every float result the worker computes afterwards. The flags below
# are the parts of -ffast-math the kernel's vectorized reductions need; they act only on this
# file's code.
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
    "-shared",
    "-fPIC",
    "-fopenmp",
]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lib: ctypes.CDLL | None = None
_failed = False
enabled = os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0"  # tests flip it to reach the torch path


def _cache_dir() -> Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(base) / "kernels"


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention falls back to torch")
        return None
    source = _SOURCE.read_bytes()
    # -march=native output only runs where it was built: key the file by source and host.
    key = [source, " ".join(_FLAGS).encode(), platform.node().encode(), platform.machine().encode()]
    tag = hashlib.sha256(b"\0".join(key))
    target = _cache_dir() / f"paged_decode-{tag.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building %s failed: %s", _SOURCE.name, result.stderr[-2000:])
                return None
            os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(target))
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return lib


def available() -> bool:
    """True when the kernel is built (building it on the first call)."""
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            _lib = _build()
        except OSError as exc:
            log.warning("loading the CPU attention kernel failed: %s", exc)
            _lib = None
        _failed = _lib is None
    return _lib is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        enabled
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: q [B, H, D] -> [B, H, D], reading K/V through the block tables."""
    if not available():
        raise RuntimeError("the CPU decode attention kernel could not be built")
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    rc = _lib.paged_decode(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        _DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError("shape not supported by the CPU decode kernel")
    return out
