"""Large-batch CPU matmuls in float32 over a weight made one tile of rows at a time.

On a CPU without AVX512-BF16 (or AMX), torch's bfloat16 and float16 matmuls and the quantized
kernels (csrc/quant_matmul.c, torch's int4pack) run a prefill-sized batch at a third to a half of
the float32 GEMM's rate (oneDNN/MKL sgemm; measured on an AVX2 host, 2 threads, 1536x576 at batch
512: sgemm ~100 GFLOP/s, bf16 ~25, the int4 kernels ~50). `tiled_matmul` instead fills a float32
tile of W's rows (at most `TILE_BYTES`, one buffer per thread, reused: it stays in the L3 cache and
costs no allocation) and multiplies it in float32; filling a tile (a 16-bit copy or a
dequantization) costs ~0.1 ms against milliseconds of GEMM once the batch reaches `MIN_ROWS`
(`MIN_ROWS_DENSE` for 16-bit weights).
Results are float32 products of the very weights the 16-bit or dequantized reference uses,
rounded once to x's dtype. Called by common.kernels.cpu_quant (the "f32tiles" path) and
common.model.layers.Linear (16-bit dense weights). Also the one place that calls oneDNN's
prepacked matmul (`onednn`, `onednn_silu_mul`) for both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

TILE_BYTES = 4 << 20
MIN_ROWS = 128  # quantized weights: from this batch (tokens) on the tiles win here
# 16-bit dense weights: torch's bf16 matmul is slower still, so the tiles win sooner (interleaved,
# 2 threads: 3072x576 at 16 / 64 / 128 rows 1.07 vs 1.66, 4.2 vs 6.7, 5.5 vs 12.6 ms; the 49152-row
# LM head breaks even at 32 and wins from 64: 66 vs 99 ms)
MIN_ROWS_DENSE = 64
_tiles = threading.local()  # each thread's tile buffer


def tiled_matmul(
    x: torch.Tensor,
    n: int,
    fill: Callable[[int, int, torch.Tensor], None],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias), W [n, K], where `fill(n0, n1, tile)` writes W's rows n0..n1 into
    `tile` ([n1 - n0, K] float32, contiguous). Summed in float32, rounded once to x's dtype."""
    m, k = x.shape
    x32 = x.to(torch.float32).contiguous()
    rows = max(1, min(n, TILE_BYTES // (4 * k)))
    buf = getattr(_tiles, "buf", None)
    if buf is None or buf.numel() < rows * k:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = _tiles.buf = torch.empty(rows * k, dtype=torch.float32)
    out = torch.empty(m, n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        tile = buf[: (n1 - n0) * k].view(n1 - n0, k)
        fill(n0, n1, tile)
        if n1 - n0 == n:
            torch.mm(x32, tile.t(), out=out)
        else:
            out[:, n0:n1] = torch.mm(x32, tile.t())
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def applies_dense(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a 16-bit dense linear of this batch runs faster through `dense_matmul` (which
    autograd cannot see through: never where gradients are wanted)."""
    return (
        x.numel() >= MIN_ROWS_DENSE * x.shape[-1]  # first: small batches stop here
        and x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for 16-bit x and weight, in float32 over tiles of weight's rows
    (each converted exactly), the bias added in float32, rounded once to x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])

    def fill(n0: int, n1: int, tile: torch.Tensor) -> None:
        tile.copy_(weight[n0:n1])

    out = tiled_matmul(x2, weight.shape[0], fill, bias)
    return out.reshape(*lead, weight.shape[0])


def pack_onednn(weight: torch.Tensor, split: int = 0) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """oneDNN's prepacked form of weight [N, K] (RuntimeError where it has none for this dtype
    on this CPU); with 0 < split < N, its rows [:split] and [split:] packed apart, which
    `onednn_silu_mul` takes."""
    if 0 < split < weight.shape[0]:
        parts = weight.split([split, weight.shape[0] - split])
        return tuple(torch.ops.mkldnn._reorder_linear_weight(p.contiguous(), None) for p in parts)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def onednn(
    x: torch.Tensor,
    packed: torch.Tensor | tuple[torch.Tensor, ...],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T (+ bias) over `pack_onednn`'s form of W; split parts (no bias) side by side."""
    if isinstance(packed, tuple):
        assert bias is None, "a split weight is packed without its bias"
        return torch.cat([onednn(x, p) for p in packed], dim=-1)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_silu_mul(x: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """SiLU(x @ A.T) * (x @ B.T) over `pack_onednn`'s split form of [A; B]: the first matmul
    applies the SiLU to its float32 sums before they are rounded to x's dtype (oneDNN's eltwise
    post-op), the second multiplies its float32 sums by that result (its binary post-op), so
    the gate/up product is never written and read back. One rounding fewer than the fused
    matmul then cpu_ops.silu_mul (the gate's). Measured (default model, 2 threads, 30 layers at
    2,048 rows): 126-131 ms that way, 100-101 ms this; at 300 rows 22.5-23.8 against 18.1-19.7."""
    gate = torch.ops.mkldnn._linear_pointwise(x, parts[0], None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, parts[1], None, "mul")
