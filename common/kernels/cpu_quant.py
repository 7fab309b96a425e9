"""CPU matmuls over quantized weights (common.model.quant's format), one path chosen per call.

Paths, all computing x [M, K] @ W.T for W = the dequantized weight:
  c          csrc/quant_matmul.c: dequantizes each weight group in registers once per 8 rows of x,
             float32 accumulation, OpenMP over N; built on first use like cpu_attention's kernel.
  int4pack   torch's _weight_int4pack_mm_for_cpu on a repacked copy (int4, power-of-two groups).
  int8pack   torch's _weight_int8pack_mm (int8 per channel only).
  dequant    dequantize to x's dtype, then F.linear: the reference.
`PICK` says which runs for (bits, batch) — chosen from measurements on an AVX2-only host (see the
report in benchmarks/README.md); a path that does not apply falls through to the next candidate.
`PDSERVE_CPU_QUANT_KERNEL=c|int4pack|int8pack|dequant` forces one where it applies (tests and the
benchmark use it). Called by
`common.model.quant.QuantLinear`.
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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from common.model.quant import QuantLinear

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "quant_matmul.c"
# Not -ffast-math: it links crtfastmath.o, which turns on flush-to-zero for the whole process when
# the library loads (see cpu_attention.py). These are the parts the vectorized sums need.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-freciprocal-math", "-shared", "-fPIC", "-fopenmp"]  # fmt: skip
_lib: ctypes.CDLL | None = None
_failed = False

# Candidates per (bits, batch upper bound), fastest first as measured; the first that applies runs.
PICK: list[tuple[int, int, tuple[str, ...]]] = [
    (4, 1, ("c", "int4pack", "dequant")),
    (4, 1 << 30, ("int4pack", "c", "dequant")),
    (8, 8, ("c", "int8pack", "dequant")),
    (8, 1 << 30, ("int8pack", "c", "dequant")),  # int8pack: per channel only; groups -> c
]
PATHS = ("c", "int4pack", "int8pack", "dequant")


def _cache_dir() -> Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(base) / "kernels"


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: quantized matmuls use torch's kernels")
        return None
    source = _SOURCE.read_bytes()
    # -march=native output only runs where it was built: key the file by source and host.
    key = [source, " ".join(_FLAGS).encode(), platform.node().encode(), platform.machine().encode()]
    tag = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = _cache_dir() / f"quant_matmul-{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *_FLAGS, str(_SOURCE), "-o", str(out)], capture_output=True, text=True
            )
            if result.returncode != 0:
                log.warning("building %s failed: %s", _SOURCE.name, result.stderr[-2000:])
                return None
            os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(target))
    lib.quant_matmul.restype = ctypes.c_int
    lib.quant_matmul.argtypes = (
        [ctypes.c_void_p, ctypes.c_long]
        + [ctypes.c_int] * 6
        + [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    )
    return lib


def c_available() -> bool:
    """True when the C kernel is built (building it on the first call)."""
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            _lib = _build()
        except OSError as exc:
            log.warning("loading the CPU quantized matmul failed: %s", exc)
        _failed = _lib is None
    return _lib is not None


def applies(path: str, layer: QuantLinear, x: torch.Tensor) -> bool:
    """Whether `path` can compute this layer for this input."""
    if path == "c":
        return (
            layer.scale.dtype in (torch.float32, torch.bfloat16)
            and (layer.zero is None or layer.zero.dtype == layer.scale.dtype)
            and c_available()
        )
    if path == "int4pack":
        g = layer.group_size
        return layer.bits == 4 and g in (32, 64, 128, 256) and x.dtype in _TORCH_DTYPES
    if path == "int8pack":
        return (
            layer.bits == 8
            and layer.group_size == layer.in_features
            and layer.zero is None
            and x.dtype in _TORCH_DTYPES
        )
    return path == "dequant"


_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def choose(layer: QuantLinear, x: torch.Tensor) -> str:
    forced = os.environ.get("PDSERVE_CPU_QUANT_KERNEL")
    if forced:
        if forced not in PATHS:
            raise ValueError(f"PDSERVE_CPU_QUANT_KERNEL must be one of {PATHS}, not {forced!r}")
        if applies(forced, layer, x):
            return forced  # else the usual choice: forcing int8pack must not break int4 layers
    m = x.shape[0]
    for bits, max_m, candidates in PICK:
        if bits == layer.bits and m <= max_m:
            for path in candidates:
                if applies(path, layer, x):
                    return path
    return "dequant"


def quant_matmul(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """x [M, K] @ W.T on the CPU through the path `choose` picks; the result has x's dtype."""
    path = choose(layer, x)
    if path == "c":
        return _c_matmul(x, layer)
    if path == "int4pack":
        packed, scale_zero = _prepared(layer, x.dtype, _prepare_int4pack)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), packed, layer.group_size, scale_zero
        )
    if path == "int8pack":
        scales = _prepared(layer, x.dtype, lambda lay, dt: lay.scale[:, 0].to(dt).contiguous())
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.qweight, scales)
    return F.linear(x, layer.qt.dequantize(x.dtype))


def _prepared(layer: QuantLinear, dtype: torch.dtype, make):
    """A repacked form of the layer's weight, made once per (kind, dtype) and kept on the layer."""
    key = (make.__name__, dtype, layer.qweight.data_ptr(), layer.scale.dtype)
    hit = layer.cpu_cache.get(key)
    if hit is None:
        layer.cpu_cache.clear()  # weights or their dtype changed: drop stale copies
        hit = layer.cpu_cache[key] = make(layer, dtype)
    return hit


def _prepare_int4pack(layer: QuantLinear, dtype: torch.dtype):
    qt = layer.qt
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qt.unpack().to(torch.int32), 1)
    zero = qt.zero if qt.zero is not None else torch.zeros_like(qt.scale)
    # [K/group, N, 2] of (scale, zero): torch's w = (q - 8) * scale + zero, the same as ours
    scale_zero = torch.stack((qt.scale, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scale_zero


def _c_matmul(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    # one call: the kernel converts/reorders x and writes x's dtype (torch ops per call cost more
    # than the matmul itself at decode sizes)
    m, k = x.shape
    if x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.float32).contiguous()
    out = torch.empty(m, layer.out_features, dtype=x.dtype)
    zero = layer.zero
    rc = _lib.quant_matmul(
        x.data_ptr(),
        x.stride(0),
        0 if x.dtype == torch.float32 else 1,
        m,
        k,
        layer.out_features,
        layer.bits,
        layer.group_size,
        layer.qweight.data_ptr(),
        layer.scale.data_ptr(),
        None if zero is None else zero.data_ptr(),
        0 if layer.scale.dtype == torch.float32 else 1,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"shape not supported by the CPU quantized kernel: {layer} (rc {rc})")
    return out
