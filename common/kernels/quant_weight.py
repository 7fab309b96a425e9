"""A quantized weight as the kernels take it (`QuantWeight`): its format, and what they keep on it.

The model side (common.model.quant: `QuantizedTensor.kernel_weight`, `QuantLinear.kernel_weight`)
builds one over its own tensors; common.kernels.cpu_quant, cpu_qgemm, cpu_layer and tune take it,
so that no kernel knows the model's classes. Holding the tensors is the point: what the kernels
derive from a weight (raw pointers, repacked copies) is kept on it, so it never outlives the
tensors it points into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False, repr=False)
class QuantWeight:
    """A quantized [n, k] weight, built by the model side over its own tensors.

    bits=4: qweight uint8 [n, k/2], low nibble column 2j, high nibble 2j+1, w = (q - 8) * scale
            + zero; bits=8: qweight int8 [n, k], w = q * scale + (zero or 0);
    scale, zero: [n, k / group_size], zero None means 0.
    What the kernels derive from it lives on it, so never longer than the tensors it points into:
    `derived` (the C kernel's raw pointers, repacked copies keyed by the tensors' versions: an
    in-place change of the weight makes new ones) and `paths` (the path per batch size).
    split: 0, or the rows of a first matrix stacked above a second (a fused gate/up projection,
    whose SiLU of the first times the second cpu_quant.silu_mul_matmul computes in one pass)."""

    bits: int
    group_size: int
    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    n: int
    k: int
    split: int = 0
    derived: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        zero = "" if self.zero is None else ", zero"
        return f"QuantWeight(int{self.bits} [{self.n}, {self.k}], group {self.group_size}{zero})"

    def versions(self) -> tuple[int, ...]:
        """The tensors' version counters: they change with every in-place write."""
        tensors = (self.qweight, self.scale, self.zero)
        return tuple(-1 if t is None or t.is_inference() else t._version for t in tensors)

    def unpack(self) -> torch.Tensor:
        """The codes as int16 [n, k]: 0..15 for int4, -128..127 for int8."""
        q = self.qweight.to(torch.int16)
        if self.bits == 8:
            return q
        return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(self.n, self.k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [n, k] weight in `dtype`, computed in float32 then rounded once."""
        q = self.unpack().to(torch.float32)
        if self.bits == 4:
            q = q - 8
        groups = self.k // self.group_size
        w = q.view(self.n, groups, self.group_size) * self.scale.to(torch.float32)[..., None]
        if self.zero is not None:
            w = w + self.zero.to(torch.float32)[..., None]
        return w.reshape(self.n, self.k).to(dtype)
