"""The Llama family's building blocks: Linear (oneDNN prepacking on CPU, float32 GEMM tiles for
16-bit prefill batches), RMSNorm (with the residual add fused), rotary embedding (q and k rotated,
and K/V stored, in one pass on CPU).

The fused CPU paths come from `common.kernels.cpu_ops`, with the eager torch ops as the fallback.
Used by `common.model.llama`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels import cpu_gemm, cpu_ops
from common.kernels.attention import AttentionMetadata

if TYPE_CHECKING:  # the attention layer whose caches the fused rotary writes
    from common.model.llama import Attention


class Linear(nn.Linear):
    """nn.Linear that can switch to oneDNN's prepacked-weight matmul on CPU (pack_for_cpu).

    `split` (set by the MLP on its fused gate/up projection: the gate's rows; 0 otherwise) packs
    the two parts apart, so that `silu_mul` has oneDNN apply SiLU(gate) * up to the float32
    sums as it writes them (cpu_quant.silu_mul_matmul does the same for quantized weights)."""

    packed: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
    split: int = 0

    def pack_for_cpu(self) -> None:
        # Prepacked weights skip oneDNN's per-call reorder: about 2x faster at decode batch sizes.
        # oneDNN's bf16 path needs AVX512 or AVX-NE-CONVERT; elsewhere the plain matmul stays.
        split = self.split if self.bias is None else 0
        try:
            self.packed = cpu_gemm.pack_onednn(self.weight.detach(), split)
        except RuntimeError:
            self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            if cpu_gemm.applies_dense(x, self.weight):  # a 16-bit prefill: float32 GEMM tiles
                return cpu_gemm.dense_matmul(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        return cpu_gemm.onednn(x, self.packed, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(x @ gate.T) * (x @ up.T) for a split weight packed in parts, the SiLU and the
        product applied by oneDNN's post-ops; None otherwise (the caller applies them)."""
        if not isinstance(self.packed, tuple):
            return None
        return cpu_gemm.onednn_silu_mul(x, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual), the sum made in place
        on the CPU's fused path (the caller hands over its residual stream)."""
        if (
            cpu_ops.supports(x)
            and x.stride(-1) == 1
            and self.weight.dtype == x.dtype
            and x.shape[-1] <= cpu_ops.MAX_HIDDEN
        ):
            if x.dim() != 2:  # Qwen3's per-head q/k norms: [T, heads, D] as rows of D
                rows = x.reshape(-1, x.shape[-1])
                return cpu_ops.add_rms_norm(rows, self.weight, self.eps).view(x.shape)
            out = cpu_ops.add_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, cast back before the weight: the order HF uses, so bf16 rounds alike
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, computed once in float32."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if not rope:  # transformers < 5 keeps these as separate attributes
            rope = dict(getattr(config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            theta = float(rope["rope_theta"])
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK RoPE scaling is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # plain attributes, not buffers: model.to(dtype) must not round them to bf16
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def set_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """This step's positions; the eager path looks its cos/sin up once, on first use."""
        self.positions = positions.long().contiguous()  # what the fused kernel reads
        self.dtype = dtype
        self.step_cos = self.step_sin = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] at this step's positions (half-split layout, as HF)."""
        if self.step_cos is None:  # cast once per step, reused by every layer
            self.step_cos = self.cos[self.positions].to(self.dtype)[:, None, :]
            self.step_sin = self.sin[self.positions].to(self.dtype)[:, None, :]
        return _rotate(x, self.step_cos, self.step_sin)

    def rotate_qkv_(self, qkv: torch.Tensor, attn: Attention, meta: AttentionMetadata) -> bool:
        """The fused CPU path: rotate q and k inside qkv [T, (H + 2*Hkv) * D] in one pass and,
        when the torch KV writer is in use, store k and v in their cache slots in the same pass.
        Returns whether the cache was written; False means the caller writes it."""
        store = (
            attn.backend == "torch"
            and attn.k_cache.is_contiguous()
            and attn.k_cache.dtype == qkv.dtype  # an 8-bit cache is quantized by the torch writer
        )
        cpu_ops.rope_qk(
            qkv, self.positions, self.cos, self.sin, attn.num_heads,
            attn.num_kv_heads, attn.head_dim, attn.k_cache if store else None,
            attn.v_cache if store else None, meta.slot_mapping if store else None,
        )  # fmt: skip
        return store


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
