"""CPU matmuls over quantized weights (`common.kernels.quant_weight.QuantWeight`), one path chosen
per call.

Paths, all computing x [M, K] @ W.T for W = the dequantized weight:
  c          csrc/quant_matmul.c: dequantizes each weight group in registers once per 8 rows of x,
             float32 accumulation, OpenMP over N; built on first use like cpu_attention's kernel.
             At batch 1 a dot per group instead; with bfloat16 x those dots are summed in int32
             over x written as int16 times a power of two per 32 columns (exact for x within 2^7
             of its block's largest, else off by at most 2^-15 of it; float32 x stays float).
  f32tiles   csrc/quant_matmul.c's `dequantize_rows` writes tiles of W's rows in float32, each
             multiplied by torch's float32 GEMM (common.kernels.cpu_gemm): pays off at large M.
  int4pack   torch's _weight_int4pack_mm_for_cpu on a repacked copy (int4, power-of-two groups).
  int8pack   torch's _weight_int8pack_mm (int8 per channel only).
  a8         common.kernels.cpu_qgemm: x quantized to int8 per row and block of 32 columns, exact
             int32 block sums (VNNI / AVX2), on a copy of the weight repacked into panels. Not
             exact: off by x's rounding (at most max|x| / 254 per block times the weights' sum).
  dense      a copy of the weight dequantized to x's dtype, made once and kept (oneDNN-prepacked
             where torch can), then its 16-bit / float32 GEMM (AMX or AVX-512 bfloat16 where the
             CPU has them): the prompt steps' path where it measures faster. Exactly `dequant`'s
             products; it costs 2 (bfloat16) or 4 (float32) bytes per weight, so it applies only
             where `set_dense_weights` allowed it (EngineConfig.dense_weight_memory). A split
             weight (a fused gate/up: QuantWeight.split) keeps its two parts packed apart, for
             `silu_mul_matmul` (SiLU(gate) * up applied by the matmuls' own epilogues).
  amxbf16    common.kernels.cpu_dense: bfloat16 x times such a copy (bfloat16, in the AMX tile
             layout) on the tile unit, float32 sums over all of K; AMX-BF16 hosts, within the
             same budget (one more copy). The C decode layers run it too (unlike dense).
  amx4       common.kernels.cpu_dense's int4 form: amxbf16's products, bit for bit, with no dense
             copy: the 4-bit codes in tile order (half a byte a weight, and float32 scales) and
             each panel dequantized to bfloat16 as a thread reaches it. Groups of a multiple of
             32 columns; the C decode layers run it too.
  dequant    dequantize to x's dtype, then F.linear: the reference.
Which runs is `kernel_choice` (EngineConfig.kernel_choice, --kernel-choice, set by
common.kernels.tune.prepare at an engine's start):
  auto       measured on this machine (common.kernels.tune): `tuned` holds, per (bits, x dtype,
             activation mode), each batch range's paths fastest first; the first that applies
             runs. A layer meeting a key nothing was tuned for tunes on its own shape then.
  table      `TABLE`, fixed orders measured once on one AVX2 host: a fallback, never the default.
  a path     that path wherever it applies; elsewhere the table's order.
`activations` (int8 | float | auto, set from EngineConfig.cpu_activations by the model runner
through `set_activations`) says whether "a8" may run: int8 wherever it applies, float never (the
other paths, exactly as before it existed), auto where the measurement (or the table) puts it
first and the kernel was built with VNNI or AVX2 (not its portable C).
`PDSERVE_CPU_QUANT_KERNEL=c|f32tiles|int4pack|int8pack|a8|dequant` forces one where it applies,
as a path name in `kernel_choice` does (tests use it; read when a layer first meets a batch
size). Called by `common.model.quant.QuantLinear`, which describes its weight as a
`QuantWeight`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from common.kernels import cpu_dense, cpu_gemm, cpu_qgemm
from common.kernels.cbuild import REDUCTION_FLAGS, CLibrary
from common.kernels.cpu_gemm import MIN_ROWS, tiled_matmul
from common.kernels.quant_weight import QuantWeight

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "quant_matmul.c"
_FLAGS = ["-O3", *REDUCTION_FLAGS, "-fopenmp"]  # never -ffast-math: cbuild

A8_MIN_ROWS = 2  # TABLE: int8 activations from this batch on (below: the C decode layers' kernel)
# kernel_choice "table": candidates per (bits, batch upper bound), fastest first as measured on
# one AVX2 host; the first that applies runs. "a8" runs only where `activations` allows it.
TABLE: list[tuple[int, int, tuple[str, ...]]] = [
    (4, 1, ("c", "int4pack", "dequant")),
    (4, A8_MIN_ROWS - 1, ("int4pack", "c", "dequant")),
    (4, MIN_ROWS - 1, ("a8", "int4pack", "c", "dequant")),
    (4, 1 << 30, ("a8", "f32tiles", "int4pack", "c", "dequant")),
    (8, A8_MIN_ROWS - 1, ("c", "int8pack", "dequant")),
    (8, 8, ("a8", "c", "int8pack", "dequant")),
    (8, MIN_ROWS - 1, ("a8", "int8pack", "c", "dequant")),  # int8pack: per channel only
    (8, 1 << 30, ("a8", "f32tiles", "int8pack", "c", "dequant")),
]
PATHS = ("c", "f32tiles", "int4pack", "int8pack", "a8", "dense", "amxbf16", "amx4", "dequant")
ACTIVATION_MODES = ("auto", "int8", "float")
activations = "auto"  # see the module docstring; set_activations changes it
KERNEL_CHOICES = ("auto", "table", *PATHS)
kernel_choice = "auto"  # see the module docstring; set_kernel_choice changes it
dense_weights = False  # whether the "dense" path may keep its copies: set_dense_weights
dense_min_rows = 0  # ... and from how many rows on it may serve (set_dense_weights)
# an engine's single rows take the order tuned for 2 rows (set_uniform_rows): a row then
# computes alike alone and beside others, and a verify step's rows as the decode steps they
# stand for (same kernel, same activation rounding): greedy output does not change with the
# batch a request shares or with speculation
uniform_rows = False
# (bits, x dtype, activations) -> (the M points, each point's paths fastest first): a batch of M
# rows takes the first point >= M (the last beyond it); written by common.kernels.tune.install
tuned: dict[tuple[int, torch.dtype, str], tuple[list[int], list[list[str]]]] = {}
# TABLE: torch's packed kernels take float32 activations through a slow path: 20-45x slower than
# the C kernel at batch 8-64 on an AVX2 host (1536x576, int4pack 17 ms vs 0.57 ms at batch 16).
_SLOW_IN_FLOAT32 = ("int4pack", "int8pack")


_p, _i = ctypes.c_void_p, ctypes.c_int
_LIB = CLibrary(
    _SOURCE,
    _FLAGS,
    {
        "quant_matmul": [_p, ctypes.c_long, _i, _i, _i, _i, _i, _i, _p, _p, _p, _i, _p, _i],
        "dequantize_rows": [_i, _i, _i, _i, _i, _p, _p, _p, _i, _p, _i],
    },
    "the CPU quantized matmul",
)


def set_activations(mode: str) -> None:
    """int8 | float | auto: whether quantized layers may take int8 activations (the "a8" path)
    from now on (each layer's cached choices are keyed by it)."""
    global activations
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"cpu activations must be one of {ACTIVATION_MODES}, not {mode!r}")
    activations = mode


def set_kernel_choice(choice: str) -> None:
    """auto | table | a path name: how quantized layers choose their path from now on."""
    global kernel_choice
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernel choice must be one of {KERNEL_CHOICES}, not {choice!r}")
    kernel_choice = choice


def set_dense_weights(allowed: bool, min_rows: int = 0) -> None:
    """Whether quantized layers may keep a dequantized copy of their weight (the "dense" path)
    from now on, for batches of more than `min_rows` rows; the model runner decides it from the
    copies' size and its memory budget, and keeps the batches the C decode layers run (which need
    c or a8) off it."""
    global dense_weights, dense_min_rows
    dense_weights, dense_min_rows = allowed, min_rows


def set_uniform_rows(on: bool) -> None:
    """Whether a batch of one row takes the tuned order of two rows from now on (auto only)."""
    global uniform_rows
    uniform_rows = on


def dense_bytes(weights: list[QuantWeight], dtype: torch.dtype) -> int:
    """What the dense paths' copies of `weights` take for x in `dtype` (bfloat16 on an AMX
    host: oneDNN's and amxbf16's, one each)."""
    copies = 2 if dtype == torch.bfloat16 and cpu_dense.available() else 1
    return copies * sum(w.n * w.k for w in weights) * torch.empty(0, dtype=dtype).element_size()


def int8_activations() -> bool:
    """Whether `activations` lets the a8 path run on this host."""
    if activations == "float" or not cpu_qgemm.available():
        return False
    return activations == "int8" or cpu_qgemm.isa() != "portable"


def c_available() -> bool:
    """True when the C kernel is built (building it on the first call)."""
    return _LIB.available()


def applies(path: str, w: QuantWeight, x: torch.Tensor) -> bool:
    """Whether `path` can compute this weight for this input."""
    if path == "c":
        return (
            w.scale.dtype in (torch.float32, torch.bfloat16)
            and (w.zero is None or w.zero.dtype == w.scale.dtype)
            and c_available()
        )
    if path == "f32tiles":
        return applies("c", w, x) and x.dtype in (torch.float32, torch.bfloat16)
    if path == "int4pack":
        g = w.group_size
        return w.bits == 4 and g in (32, 64, 128, 256) and x.dtype in _TORCH_DTYPES
    if path == "a8":
        return (
            w.scale.dtype in (torch.float32, torch.bfloat16)
            and x.dtype in (torch.float32, torch.bfloat16)
            and cpu_qgemm.supports(w.bits, w.group_size, w.k)
            and cpu_qgemm.available()
        )
    if path == "int8pack":
        return w.bits == 8 and w.group_size == w.k and w.zero is None and x.dtype in _TORCH_DTYPES
    if path == "dense":
        return dense_weights and x.shape[0] > dense_min_rows and x.dtype in _TORCH_DTYPES
    if path == "amxbf16":
        return (
            dense_weights
            and x.dtype == torch.bfloat16
            and cpu_dense.MIN_ROWS < x.shape[0] <= cpu_dense.MAX_ROWS
            and cpu_dense.supports(w.n, w.k)
            and cpu_dense.available()
        )
    if path == "amx4":
        return (
            x.dtype == torch.bfloat16
            and cpu_dense.MIN_ROWS < x.shape[0] <= cpu_dense.MAX_ROWS
            and cpu_dense.supports_int4(w)
            and cpu_dense.available()
        )
    return path == "dequant"


_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def choose(w: QuantWeight, x: torch.Tensor) -> str:
    forced = os.environ.get("PDSERVE_CPU_QUANT_KERNEL") or (
        kernel_choice if kernel_choice in PATHS else None
    )
    if forced:
        if forced not in PATHS:
            raise ValueError(f"PDSERVE_CPU_QUANT_KERNEL must be one of {PATHS}, not {forced!r}")
        if applies(forced, w, x):
            return forced  # else the usual choice: forcing int8pack must not break int4 layers
    int8 = int8_activations()
    if int8 and activations == "int8" and applies("a8", w, x):
        return "a8"
    if kernel_choice == "auto" and not forced:
        candidates = _tuned_order(w, x)
    else:
        candidates = _table_order(w.bits, x)
    for path in candidates:
        if (path != "a8" or int8) and applies(path, w, x):
            return path
    return "dequant"


def _tuned_order(w: QuantWeight, x: torch.Tensor) -> list[str]:
    from common.kernels import tune  # it imports this module

    rows = 2 if uniform_rows and x.shape[0] == 1 else x.shape[0]
    order = tune.order_for(w.bits, x.dtype, rows)
    if order is None:
        tune.tune_layer(w, x.dtype)
        order = tune.order_for(w.bits, x.dtype, rows) or []
    return order


def _table_order(bits: int, x: torch.Tensor) -> tuple[str, ...]:
    m = x.shape[0]
    for table_bits, max_m, candidates in TABLE:
        if table_bits == bits and m <= max_m:
            slow = _SLOW_IN_FLOAT32 if x.dtype == torch.float32 else ()
            return tuple(p for p in candidates if p not in slow)
    return ()


def path_for(w: QuantWeight, x: torch.Tensor) -> str:
    """The path `choose` picks for x's batch size, dtype, `activations` and `kernel_choice`, kept
    on the weight (so the environment variable counts when a layer first meets a batch size):
    this runs ~120 times a decode step, where Python overhead is a visible share of the step."""
    key = (x.shape[0], x.dtype, activations, kernel_choice, uniform_rows)
    path = w.paths.get(key)
    if path is None:
        path = w.paths[key] = choose(w, x)
    return path


def quant_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ W.T on the CPU through the path `choose` picks; the result has x's dtype."""
    return run_path(path_for(w, x), x, w)


def run_path(path: str, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ W.T through `path` (which must apply: see `applies`)."""
    if path == "c":
        return _c_matmul(x, w)
    if path == "f32tiles":
        return _f32tiles_matmul(x, w)
    if path == "a8":
        return cpu_qgemm.matmul_a8(x, a8_weights(w))
    if path == "int4pack":
        packed, scale_zero = copy_for(path, w, x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), packed, w.group_size, scale_zero
        )
    if path == "int8pack":
        scales = copy_for(path, w, x.dtype)
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), w.qweight, scales)
    if path == "dense":
        weight, packed = copy_for(path, w, x.dtype)
        if packed is not None:  # a split weight's two parts side by side (silu_mul_matmul's copy)
            return cpu_gemm.onednn(x, packed)
        return F.linear(x, weight)
    if path == "amxbf16":
        return cpu_dense.matmul(x if x.stride(1) == 1 else x.contiguous(), amx_weights(w))
    if path == "amx4":
        x = x if x.stride(1) == 1 else x.contiguous()
        return cpu_dense.matmul_int4(x, amx4_weights(w), w.group_size)
    return F.linear(x, w.dequantize(x.dtype))


def copy_for(path: str, w: QuantWeight, dtype: torch.dtype):
    """What `path` computes from for x of `dtype`: its copy of the weight (made on first use and
    kept on it), the C kernels' view for c and f32tiles, None for dequant (the weight as
    stored)."""
    if path == "a8":
        return a8_weights(w)
    if path == "amxbf16":
        return amx_weights(w)
    if path == "amx4":
        return amx4_weights(w)
    if path == "dense":
        return _prepared(w, path, dtype, _dense_copy)
    if path == "int4pack":
        return _prepared(w, path, dtype, _prepare_int4pack)
    if path == "int8pack":
        return _prepared(w, path, dtype, _int8pack_scales)
    if path in ("c", "f32tiles"):
        return c_weights(w)
    return None


def a8_weights(w: QuantWeight) -> cpu_qgemm.PackedWeight:
    """The weight in the a8 path's panels, made once and kept on it (the C decode layers call
    that kernel on it too)."""
    return _prepared(w, "a8", None, cpu_qgemm.pack)


def amx_weights(w: QuantWeight) -> torch.Tensor:
    """The weight dequantized to bfloat16 in the AMX tile layout, made once and kept on it (the
    C decode layers call that kernel on it too)."""
    return _prepared(w, "amxbf16", None, lambda w: cpu_dense.pack(w.dequantize(torch.bfloat16)))


def amx4_weights(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The 4-bit codes in the AMX tile order with their float32 scales and zeros
    (cpu_dense.pack_int4), made once and kept on the weight (the C decode layers call that
    kernel on it too)."""
    return _prepared(w, "amx4", None, cpu_dense.pack_int4)


def _prepared(w: QuantWeight, path: str, dtype: torch.dtype | None, make):
    """A repacked copy of the weight for `path`, made once per x dtype (None: any) and kept on it
    while the tensors it was made from are unchanged (their versions count in-place writes)."""
    versions = w.versions()
    hit = w.derived.get((path, dtype))
    if hit is None or hit[0] != versions:
        hit = w.derived[(path, dtype)] = (versions, make(w) if dtype is None else make(w, dtype))
    return hit[1]


def _dense_copy(
    w: QuantWeight, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...] | None]:
    """The weight dequantized to `dtype`, and oneDNN's prepacked form of it where torch has one
    for that dtype on this CPU (as common.model.layers.Linear packs dense weights): then the
    packed one alone is kept; for a split weight (QuantWeight.split), a tuple of its two parts'
    packed forms, which silu_mul_matmul multiplies by one at a time."""
    weight = w.dequantize(dtype).contiguous()
    if torch.backends.mkldnn.is_available() and dtype != torch.float16:
        try:
            packed = cpu_gemm.pack_onednn(weight, w.split)
            return torch.empty(0, w.k, dtype=dtype), packed  # not a view: the copy goes
        except RuntimeError:  # no bfloat16 oneDNN path on this CPU: the plain GEMM
            pass
    return weight, None


def silu_mul_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor | None:
    """SiLU(x @ A.T) * (x @ B.T) [M, w.split] for w = [A; B] split after w.split rows (a fused
    gate/up projection), where x's path is the dense one over oneDNN's packed parts
    (cpu_gemm.onednn_silu_mul: the SiLU and the product applied to the matmuls' float32 sums).
    None where the path is another or oneDNN has no packed form on this CPU: the caller
    multiplies, then applies them."""
    if not 0 < w.split < w.n or path_for(w, x) != "dense":
        return None
    _, packed = copy_for("dense", w, x.dtype)
    return cpu_gemm.onednn_silu_mul(x, packed) if isinstance(packed, tuple) else None


def _int8pack_scales(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    return w.scale[:, 0].to(dtype).contiguous()


def _prepare_int4pack(w: QuantWeight, dtype: torch.dtype):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.unpack().to(torch.int32), 1)
    zero = w.zero if w.zero is not None else torch.zeros_like(w.scale)
    # [K/group, N, 2] of (scale, zero): torch's w = (q - 8) * scale + zero, the same as ours
    scale_zero = torch.stack((w.scale, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scale_zero


def _c_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    # one call: the kernel converts/reorders x and writes x's dtype (torch ops per call cost more
    # than the matmul itself at decode sizes)
    m, k = x.shape
    if x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.float32).contiguous()
    bits, group, qweight, scale, zero, sdtype = c_weights(w)
    n = w.n
    out = torch.empty(m, n, dtype=x.dtype)
    rc = _LIB.get().quant_matmul(
        x.data_ptr(), x.stride(0), 0 if x.dtype == torch.float32 else 1, m, k, n, bits, group,
        qweight, scale, zero, sdtype, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"shape not supported by the CPU quantized kernel: {w} (rc {rc})")
    return out


def _f32tiles_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    k = w.k
    bits, group, qweight, scale, zero, sdtype = c_weights(w)
    threads = torch.get_num_threads()

    def fill(n0: int, n1: int, tile: torch.Tensor) -> None:
        rc = _LIB.get().dequantize_rows(
            n0, n1, k, bits, group, qweight, scale, zero, sdtype, tile.data_ptr(), threads
        )
        if rc != 0:
            raise ValueError(f"shape not supported by the CPU dequantize kernel: {w} (rc {rc})")

    return tiled_matmul(x, w.n, fill)


def c_weights(w: QuantWeight) -> tuple[int, int, int, int, int | None, int]:
    """(bits, group size, codes, scale, zero or None, scale dtype 0 float32 / 1 bfloat16): the
    C kernel's view of the weight, read once and kept on it (so never longer than the tensors
    the pointers point into, which it holds; it reads them in place, so writes show)."""
    weights = w.derived.get("c")
    if weights is None:
        zero = w.zero
        weights = w.derived["c"] = (
            w.bits,
            w.group_size,
            w.qweight.data_ptr(),
            w.scale.data_ptr(),
            None if zero is None else zero.data_ptr(),
            0 if w.scale.dtype == torch.float32 else 1,
        )
    return weights
