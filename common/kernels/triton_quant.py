"""Triton dequantize-GEMM for weight-only quantized linear layers (W4A16, W8A16) on GPU.

Owns `quant_matmul(x, qweight, scale, zero, bits, group_size)`: x [M, K] (bf16/fp16/fp32) times the
transposed quantized weight [N, K] of `common.model.quant.QuantizedTensor` -> [M, N] in x's dtype.
Quantized linear layers call it on CUDA; the tests run it on CPU under `TRITON_INTERPRET=1`
against the dequantized torch reference. Importing this module launches nothing and needs no GPU.

Design (decode, M = 1..64, is memory bound: the weight bytes are the cost):
- grid (N tile of BLOCK_N, K split, M tile of BLOCK_M). Each program streams its [BLOCK_N, K/split]
  slice of the packed weight once, dequantizes it in registers and multiplies it with every row of
  its M tile with `tl.dot` (M padded to 16, the tensor-core minimum: free when memory bound).
- int4: a [BLOCK_N, BLOCK_K/2] tile of bytes is loaded once and split into its low nibbles (even
  columns) and high nibbles (odd columns); x's even and odd columns are loaded separately (x is
  tiny and cached), so no interleaving is needed: acc += x_even @ lo^T + x_odd @ hi^T.
- BLOCK_K divides group_size, so each K tile needs one scale (and zero) per output row.
- filling the GPU: N = 2048 in tiles of 64 is 32 programs for 132 SMs, so the tiles narrow to 32
  and then the K range is split; splits write fp32 partials that one torch sum reduces
  (deterministic, unlike atomics), capped so the partials stay small next to the weight bytes.
For large M (prefill) this is correct but not tuned; callers may prefer dequantize + matmul there.
The block sizes come from `choose_config` (a heuristic; `benchmarks/gpu_quant.py --sweep` measures
the alternatives on a GPU).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    TILES_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_tiles = K // BLOCK_K
    t_begin = pid_s * TILES_PER_SPLIT
    t_end = tl.minimum(t_begin + TILES_PER_SPLIT, num_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The dot's input type: x's own dtype on the GPU (tensor cores); fp32 under the interpreter,
    # which multiplies bf16 operands as raw bits (numpy has no bf16).
    dot_dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        group = k0 // GROUP_SIZE
        s = tl.load(scale_ptr + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)
        s = s.to(tl.float32)[:, None]
        if HAS_ZERO:
            z = tl.load(zero_ptr + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)
            z = z.to(tl.float32)[:, None]
        if BITS == 4:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :] * stride_wk,
                mask=mask_n[:, None], other=0,
            )
            lo = ((packed & 0xF).to(tl.float32) - 8.0) * s
            hi = ((packed >> 4).to(tl.float32) - 8.0) * s
            if HAS_ZERO:
                lo += z
                hi += z
            offs_k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
            x_even = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0).to(dot_dtype)
            x_odd = tl.load(x_ptrs + stride_xk, mask=mask_m[:, None], other=0.0).to(dot_dtype)
            acc += tl.dot(x_even, tl.trans(lo.to(dot_dtype)), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(hi.to(dot_dtype)), input_precision="ieee")
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                mask=mask_n[:, None], other=0,
            )
            w = q.to(tl.float32) * s
            if HAS_ZERO:
                w += z
            xt = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mask_m[:, None], other=0.0,
            ).to(dot_dtype)
            acc += tl.dot(xt, tl.trans(w.to(dot_dtype)), input_precision="ieee")
    out_ptrs = (out_ptr + pid_s * stride_os
                + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class QuantMatmulConfig:
    """Launch parameters of one `quant_matmul` call."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=1)
def _num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 8  # interpreter: any small number keeps split-K exercised


def _block_k(group_size: int, bits: int) -> int:
    # One scale per K tile: BLOCK_K must divide the group. int4 splits a tile into even/odd
    # halves that each feed a tl.dot, whose K must be >= 16.
    smallest = 32 if bits == 4 else 16
    for bk in (128, 64, 32, 16):
        if bk >= smallest and group_size % bk == 0:
            return bk
    raise ValueError(
        f"quant_matmul: group_size {group_size} is not a multiple of {smallest} ({bits}-bit)"
    )


def choose_config(
    m: int, n: int, k: int, bits: int, group_size: int, num_sms: int | None = None
) -> QuantMatmulConfig:
    """Block sizes and K split for an [m, k] x [n, k]^T product (a heuristic, see module doc)."""
    num_sms = num_sms or _num_sms()
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    m_tiles = triton.cdiv(m, block_m)
    # Narrower N tiles first (more programs, no partials to reduce) when 64 leave SMs idle.
    block_n = 64 if triton.cdiv(n, 64) * m_tiles >= num_sms else 32
    block_k = _block_k(group_size, bits)
    num_tiles_k = k // block_k
    programs = triton.cdiv(n, block_n) * m_tiles
    split = 1
    weight_bytes = n * k * bits // 8
    # Then split K: up to two waves of programs over the SMs, at least two K tiles per split, and
    # fp32 partials (written and read back, mostly from L2) at most half the weight bytes.
    while (
        programs * split < 2 * num_sms
        and num_tiles_k // (split * 2) >= 2
        and (split * 2) * m * n * 4 * 2 <= weight_bytes // 2
    ):
        split *= 2
    return QuantMatmulConfig(block_m, block_n, block_k, split)


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group_size: int,
    config: QuantMatmulConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequantize(qweight, scale, zero)^T -> [..., N] in x's dtype.

    qweight: bits=4 uint8 [N, K//2] (low nibble = even column), bits=8 int8 [N, K]; scale and zero
    [N, K // group_size]; zero None = 0 (see `common.model.quant.QuantizedTensor`).
    """
    if bits not in (4, 8):
        raise ValueError(f"quant_matmul: unsupported bits {bits} (4 or 8)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = qweight.shape[0]
    expected = (n, k // 2) if bits == 4 else (n, k)
    if tuple(qweight.shape) != expected:
        raise ValueError(f"quant_matmul: qweight {tuple(qweight.shape)} != {expected} for K={k}")
    if k % group_size or tuple(scale.shape) != (n, k // group_size):
        raise ValueError(
            f"quant_matmul: scale {tuple(scale.shape)} does not match N={n}, K={k}, "
            f"group_size={group_size}"
        )
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(f"quant_matmul: zero {tuple(zero.shape)} != scale {tuple(scale.shape)}")
    # zero is read with scale's strides
    scale = scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    cfg = config or choose_config(m, n, k, bits, group_size)
    if group_size % cfg.block_k:
        raise ValueError(f"quant_matmul: block_k {cfg.block_k} must divide {group_size}")
    num_tiles_k = k // cfg.block_k
    tiles_per_split = triton.cdiv(num_tiles_k, cfg.split_k)
    split = triton.cdiv(num_tiles_k, tiles_per_split)  # no empty splits
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
        _quant_matmul_kernel[grid](
            x2, qweight, scale, zero if zero is not None else scale, out,
            m, n, k,
            x2.stride(0), x2.stride(1),
            qweight.stride(0), qweight.stride(1),
            scale.stride(0), scale.stride(1),
            out.stride(0) if split > 1 else 0, out.stride(-2), out.stride(-1),
            GROUP_SIZE=group_size,
            BITS=bits,
            HAS_ZERO=zero is not None,
            TILES_PER_SPLIT=tiles_per_split,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            UPCAST=_interpreted(),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if split > 1:
        out = out.sum(0).to(x.dtype)
    return out.reshape(*lead, n)
