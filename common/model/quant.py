"""Weight-only quantization: the in-memory format, round-to-nearest quantization, quantized layers.

Owns `QuantizedTensor` (int4 with a group-wise scale and zero point, or int8 per channel / per
group; activations 16/32-bit, or int8 per token in `common.kernels.cpu_qgemm`), RTN quantization of
a dense weight, and the two modules the Llama family swaps in when its checkpoint or
`--quantization` asks for it: `QuantLinear` (projections, LM head) and `QuantEmbedding` (row lookup,
dequantized per row). The matmul dispatches on the device: CPU -> `common.kernels.cpu_quant`, CUDA
-> `common.kernels.triton_quant.quant_matmul` (imported lazily, never on CPU), anything else ->
dequantize then matmul (the reference every kernel is tested against); the CPU kernels take the
weight as a `common.kernels.quant_weight.QuantWeight` (`kernel_weight`), and `kernel_weights`
lists a model's quantized matmuls that way for common.kernels.tune. Called by `common.model.llama`
(load_weights) and the weight loaders in `common.model.weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels import cpu_quant
from common.kernels.quant_weight import QuantWeight

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# Tried in this order when --quantization-group-size is 0 (auto) for int4: the largest that divides
# the layer's input size. 128 is what GPTQ/AWQ checkpoints use; SmolLM2's hidden size 576 needs 64.
INT4_AUTO_GROUPS = (128, 64, 32)


@dataclass
class QuantizedTensor:
    """A [N, K] weight stored as int4/int8 codes with per-group scale (and zero) along K.

    bits=4: qweight uint8 [N, K//2], low nibble = column 2j, high nibble = column 2j+1 (0..15),
            w = (q - 8) * scale + zero
    bits=8: qweight int8 [N, K], w = q * scale + (zero or 0)
    scale, zero: [N, K // group_size], float32 (or the model dtype); zero None means 0.
    """

    bits: int
    group_size: int
    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.bits not in (4, 8):
            raise ValueError(f"only 4- and 8-bit weights are supported, not {self.bits}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(
                f"group size {self.group_size} does not divide the input dimension {k}"
            )
        want_q = (n, k // 2) if self.bits == 4 else (n, k)
        if tuple(self.qweight.shape) != want_q or tuple(self.scale.shape) != (
            n,
            k // self.group_size,
        ):
            raise ValueError(
                f"{self.bits}-bit weight {self.shape}: qweight {tuple(self.qweight.shape)} and "
                f"scale {tuple(self.scale.shape)} do not fit (group {self.group_size})"
            )

    @property
    def nbytes(self) -> int:
        zero = 0 if self.zero is None else self.zero.nbytes
        return self.qweight.nbytes + self.scale.nbytes + zero

    def kernel_weight(self) -> QuantWeight:
        """This weight as the CPU kernels take it (over the same tensors)."""
        n, k = self.shape
        return QuantWeight(self.bits, self.group_size, self.qweight, self.scale,
                                     self.zero, n, k)  # fmt: skip

    def unpack(self) -> torch.Tensor:
        """The codes as int16 [N, K]: 0..15 for int4, -128..127 for int8."""
        return self.kernel_weight().unpack()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight in `dtype`, computed in float32 then rounded once."""
        return self.kernel_weight().dequantize(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize only the rows `index` (an embedding lookup)."""
        sub = QuantizedTensor(
            self.bits,
            self.group_size,
            self.qweight[index],
            self.scale[index],
            None if self.zero is None else self.zero[index],
            (index.numel(), self.shape[1]),
        )
        return sub.dequantize(dtype)


def resolve_group_size(k: int, bits: int, requested: int) -> int:
    """The group size for a K-wide weight: `requested`, or for 0 the auto choice.

    Auto: int8 per channel (group = K), int4 the largest of 128/64/32 that divides K.
    """
    if requested > 0:
        if k % requested:
            raise ValueError(
                f"--quantization-group-size {requested} does not divide the input dimension {k} "
                f"(choose a divisor of {k}, or 0 for automatic)"
            )
        return requested
    if bits == 8:
        return k
    for g in INT4_AUTO_GROUPS:
        if k % g == 0:
            return g
    raise ValueError(f"int4 needs an input dimension divisible by 32, this weight has {k}")


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """Round-to-nearest quantization of a dense [N, K] weight.

    int4: asymmetric per group (min..max onto 0..15, zero point as a float).
    int8: symmetric per group (or per channel with group_size = K), codes -127..127.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if bits == 4:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: any scale
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        q = q.reshape(n, k)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return QuantizedTensor(4, group_size, packed.contiguous(), scale, lo + 8 * scale, (n, k))
    if bits == 8:
        scale = w.abs().amax(dim=-1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
        return QuantizedTensor(8, group_size, q, scale, None, (n, k))
    raise ValueError(f"only 4- and 8-bit quantization is supported, not {bits}")


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Concatenate along N (the fused q/k/v and gate/up projections); formats must agree."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.shape[1], p.zero is None) != (
            first.bits,
            first.group_size,
            first.shape[1],
            first.zero is None,
        ):
            raise ValueError(
                f"cannot fuse {first.bits}-bit group-{first.group_size} with {p.bits}-bit "
                f"group-{p.group_size} weights"
            )
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return QuantizedTensor(
        first.bits,
        first.group_size,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scale for p in parts]),
        zero,
        (sum(p.shape[0] for p in parts), first.shape[1]),
    )


def quant_matmul_reference(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """x [M, K] @ W.T by dequantizing W to x's dtype first: the reference every kernel matches."""
    return F.linear(x, qt.dequantize(x.dtype))


class QuantLinear(nn.Module):
    """A linear layer over a QuantizedTensor weight (codes, scale and zero are buffers).

    `.to(dtype)` converts scale/zero (float buffers) and leaves the integer codes alone, so the
    format holds after the model runner's cast. The CPU kernels take the weight as
    `kernel_weight()` and keep what they derive from it (pointers, repacked copies) there.
    `split` (a fused gate/up projection's first part, its rows; 0 otherwise) lets `silu_mul`
    compute SiLU(gate) * up in the matmul's own pass.
    """

    def __init__(
        self, qt: QuantizedTensor, bias: torch.Tensor | None = None, split: int = 0
    ) -> None:
        super().__init__()
        self.split = split
        self.bits, self.group_size = qt.bits, qt.group_size
        self.out_features, self.in_features = qt.shape
        self.register_buffer("qweight", qt.qweight.contiguous())
        self.register_buffer("scale", qt.scale.contiguous())
        self.register_buffer("zero", None if qt.zero is None else qt.zero.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        self._kernel_weight: QuantWeight | None = None

    def _apply(self, fn, recurse=True):
        # .to() / .float() / .cuda() may replace the buffers: let go of the old ones now
        self._kernel_weight = None
        return super()._apply(fn, recurse)

    def kernel_weight(self) -> QuantWeight:
        """The weight as the CPU kernels take it, over the current buffers: a new one (and so
        nothing the kernels derived from the old) whenever a buffer was replaced."""
        w, buffers = self._kernel_weight, self._buffers
        if (
            w is None
            or w.qweight is not buffers["qweight"]
            or w.scale is not buffers["scale"]
            or w.zero is not buffers["zero"]
        ):
            w = self._kernel_weight = self.qt.kernel_weight()
            w.split = self.split
        return w

    @property
    def qt(self) -> QuantizedTensor:
        return QuantizedTensor(
            self.bits,
            self.group_size,
            self.qweight,
            self.scale,
            self.zero,
            (self.out_features, self.in_features),
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, int{self.bits}, "
            f"group={self.group_size}, bias={self.bias is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = None
        if x.dim() != 2:  # decode batches are already [tokens, K]: no reshape per call
            lead, x = x.shape[:-1], x.reshape(-1, self.in_features)
        if x.device.type == "cpu":
            out = cpu_quant.quant_matmul(x, self.kernel_weight())
        elif x.device.type == "cuda" and _triton_quant() is not None:
            kernel = _triton_quant()
            out = kernel(x, self.qweight, self.scale, self.zero, self.bits, self.group_size)
        else:
            out = quant_matmul_reference(x, self.qt)
        if self.bias is not None:
            out = out + self.bias
        return out if lead is None else out.reshape(*lead, self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(x @ gate.T) * (x @ up.T) [M, split] for a fused gate/up weight, the SiLU and the
        product applied by the matmuls themselves where the CPU path allows it
        (cpu_quant.silu_mul_matmul); None elsewhere (the caller multiplies, then applies them)."""
        if not self.split or self.bias is not None or x.dim() != 2 or x.device.type != "cpu":
            return None
        return cpu_quant.silu_mul_matmul(x, self.kernel_weight())


class QuantEmbedding(QuantLinear):
    """A quantized embedding table: forward looks rows up and dequantizes only those.

    A tied LM head (`TiedQuantHead`) multiplies by the same buffers through `linear`.
    """

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(qt)
        self.register_buffer("dtype_marker", torch.empty(0, dtype=dtype))  # follows .to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.qt.rows(flat, self.dtype_marker.dtype)
        return rows.reshape(*ids.shape, self.in_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return QuantLinear.forward(self, x)


class TiedQuantHead(nn.Module):
    """The LM head tied to a QuantEmbedding: its buffers, not a copy (so .to() moves them once)."""

    def __init__(self, embedding: QuantEmbedding) -> None:
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: the model owns it once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding.linear(x)


def kernel_weights(models: Iterable[nn.Module | None]) -> list[tuple[str, QuantWeight]]:
    """(module name, kernel weight) of every quantized matmul of the models: their QuantLinear
    layers and a tied quantized LM head (not an embedding only looked up). What
    common.kernels.tune measures at an engine's start."""
    found = []
    for model in models:
        for name, module in model.named_modules() if model is not None else ():
            if isinstance(module, TiedQuantHead):
                found.append((name, module.embedding.kernel_weight()))
            elif type(module) is QuantLinear:
                found.append((name, module.kernel_weight()))
    return found


_TRITON_UNSET = object()
_triton_fn = _TRITON_UNSET


def _triton_quant():
    """common.kernels.triton_quant.quant_matmul, or None (then the reference path runs)."""
    global _triton_fn
    if _triton_fn is _TRITON_UNSET:
        try:
            from common.kernels.triton_quant import quant_matmul
        except ImportError as exc:
            import logging

            logging.getLogger(__name__).warning(
                "no Triton quantized matmul (%s): dequantizing per call instead", exc
            )
            quant_matmul = None
        _triton_fn = quant_matmul
    return _triton_fn
