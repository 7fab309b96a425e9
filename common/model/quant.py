"""The in-memory quantized weight format shared by the loaders and the kernels.

Minimal copy made on the `triton` branch so the compressed-tensors loader and the Triton kernel can
be tested before the quant helper's `common/model/quant.py` lands; the quant helper's module (same
fields, same dequantization, see /work/wt/QUANT-FORMAT.md) replaces this file at merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    """A weight [N, K] quantized along K in groups of `group_size` (K itself = per channel).

    bits=4: qweight uint8 [N, K//2], low nibble = column 2j, high nibble = column 2j+1, values
    0..15, w = (q - 8) * scale + zero. bits=8: qweight int8 [N, K], w = q * scale + zero.
    scale and zero are [N, K // group_size]; zero None means 0.
    """

    bits: int
    group_size: int
    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        if self.bits == 4:
            lo = (self.qweight & 0xF).to(torch.float32)
            hi = (self.qweight >> 4).to(torch.float32)
            q = torch.stack((lo, hi), dim=-1).reshape(n, k) - 8.0
        elif self.bits == 8:
            q = self.qweight.to(torch.float32)
        else:
            raise ValueError(f"unsupported bits {self.bits}")
        groups = q.view(n, k // self.group_size, self.group_size)
        w = groups * self.scale.float()[:, :, None]
        if self.zero is not None:
            w = w + self.zero.float()[:, :, None]
        return w.reshape(n, k).to(dtype)
