"""What a loaded model's step reads and computes: the inputs of the floors in common.bench.limits.

Owns the model arithmetic the benchmarks share: the bytes one decode token reads (every linear's
weight once, a tied LM head once, plus the K/V of each sequence's context), the dtype each linear
multiplies in at a batch size (the kernels' own choice: `cpu_quant.path_for`,
`cpu_gemm.applies_dense`, or a oneDNN-prepacked Linear's weight dtype), and a step's compute
floor (each linear's 2 * M * N * K FLOPs at the best measured rate of the dtype it computes in;
attention's FLOPs are left out, its K/V reads are in the read floor). Called by
benchmarks/quantization.py, step_profile.py and offline_throughput.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.bench.limits import Limits
from common.kernels import cpu_gemm, cpu_qgemm, cpu_quant
from common.model.layers import Linear
from common.model.model_runner import kv_bytes_per_block
from common.model.quant import QuantEmbedding, QuantLinear

# cpu_quant's paths -> the dtype their products are computed in ("act": the activations' dtype)
PATH_DTYPES = {
    "c": "float32",  # float32 accumulation (integer dots at batch 1: read-bound there anyway)
    "f32tiles": "float32",
    "a8": "int8",  # int8 activations, int32 sums
    "int4pack": "act",
    "int8pack": "act",
    "dense": "act",  # the dequantized copy's 16-bit / float32 GEMM
    "dequant": "act",
}


def linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer that multiplies by a weight in a step, the LM head last;
    a quantized embedding only when the head is tied to it."""
    tied = getattr(model, "tie_word_embeddings", False)
    out, head = [], []
    for name, module in model.named_modules():
        if isinstance(module, QuantEmbedding):
            head += [(name, module)] if tied else []
        elif isinstance(module, QuantLinear | Linear):
            (head if name.endswith("lm_head") else out).append((name, module))
    return out + head[:1]  # a tied dense head is the embedding's weight: counted once


def weight_bytes(module: nn.Module) -> int:
    """The bytes a step streams for this layer's weight: a quantized one's codes, scales and
    zeros, the scales and zeros at 2 bytes where the int8-activation panels keep them in 16 bits
    (cpu_qgemm.sixteen_bit_scales: a GGUF weight's), the smallest form a kernel here reads."""
    if not isinstance(module, QuantLinear):
        return module.weight.nbytes
    qt = module.qt
    if cpu_qgemm.sixteen_bit_scales(qt.kernel_weight()) is None:
        return qt.nbytes
    scales = qt.scale.numel() + (0 if qt.zero is None else qt.zero.numel())
    return qt.qweight.nbytes + 2 * scales


def decode_read_bytes(model: nn.Module, hf_config, batch: int, context: int, kv_dtype) -> int:
    """Bytes a decode step reads: the weights once, each sequence's K and V at `context`."""
    kv = kv_bytes_per_block(hf_config, 1, kv_dtype) * context * batch
    return sum(weight_bytes(m) for _, m in linears(model)) + kv


def compute_dtype(module: nn.Module, m: int, act_dtype: torch.dtype) -> str:
    """The dtype `module` multiplies an [m, K] input of `act_dtype` in, as the kernels choose."""
    act = str(act_dtype).removeprefix("torch.")
    # the kernels' choice reads x's shape and dtype only: a broadcast row, no [m, K] buffer
    x = torch.zeros(1, module.in_features, dtype=act_dtype).expand(m, -1)
    if isinstance(module, QuantLinear):
        dtype = PATH_DTYPES.get(cpu_quant.path_for(module.kernel_weight(), x), "act")
        return act if dtype == "act" else dtype
    if getattr(module, "packed", None) is not None:  # oneDNN's prepacked matmul, in its dtype
        return str(module.weight.dtype).removeprefix("torch.")
    with torch.inference_mode():
        return "float32" if cpu_gemm.applies_dense(x, module.weight) else act


@dataclass
class StepFloor:
    """A step's floors in seconds; `limit_s` is the larger of the read and compute floors;
    `core_s` the cores' floor (Limits.core_floor_s; 0.0 where not measured)."""

    read_s: float
    compute_s: float
    dtypes: tuple[str, ...]  # the dtypes its linears compute in
    core_s: float = 0.0

    @property
    def limit_s(self) -> float:
        return max(self.read_s, self.compute_s)

    @property
    def cores_limit_s(self) -> float:
        """The limit, raised to the cores' floor where that is higher."""
        return max(self.limit_s, self.core_s)


def step_floor(
    limits: Limits,
    model: nn.Module,
    rows: int,
    act_dtype: torch.dtype,
    read_bytes: float,
    head_rows: int | None = None,
) -> StepFloor:
    """Floors of a step that reads `read_bytes` and multiplies `rows` tokens through every
    linear (the LM head `head_rows` of them: a prefill's last tokens; default `rows`)."""
    compute_s, flops_by_dtype = 0.0, {}
    for name, module in linears(model):
        m = (
            rows
            if head_rows is None or not name.endswith(("lm_head", "embed_tokens"))
            else head_rows
        )
        dtype = compute_dtype(module, m, act_dtype)
        flops = 2 * m * module.out_features * module.in_features
        compute_s += limits.compute_floor_s(flops, dtype, m)
        flops_by_dtype[dtype] = flops_by_dtype.get(dtype, 0) + flops
    return StepFloor(
        limits.read_floor_s(read_bytes),
        compute_s,
        tuple(flops_by_dtype),
        limits.core_floor_s(read_bytes, flops_by_dtype),
    )


def decode_floor(
    limits: Limits,
    model: nn.Module,
    hf_config,
    batch: int,
    context: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> StepFloor:
    """Floors of one decode step: `batch` sequences at `context` cached tokens each, the cache
    in `kv_dtype` (default: the activations' `dtype`)."""
    read = decode_read_bytes(model, hf_config, batch, context, kv_dtype or dtype)
    return step_floor(limits, model, batch, dtype, read)


def generate_floor_s(
    limits: Limits,
    model: nn.Module,
    hf_config,
    dtype: torch.dtype,
    prompts: int,
    prompt_len: int,
    output_len: int,
    kv_dtype: torch.dtype | None = None,
    cores: bool = False,
) -> float:
    """Least seconds to generate `output_len` tokens for each of `prompts` prompts at once: one
    prefill (weights read once, every prompt token through every linear, the head on the last
    tokens), then output_len - 1 decode steps, each taken at the mean context (the cache in
    `kv_dtype`, default `dtype`). Each step at its limit, or with `cores` at its
    `cores_limit_s` (the cores' floor where that is higher)."""
    weights = decode_read_bytes(model, hf_config, 0, 0, dtype)
    prefill = step_floor(limits, model, prompts * prompt_len, dtype, weights, head_rows=prompts)
    limit = (lambda f: f.cores_limit_s) if cores else (lambda f: f.limit_s)
    if output_len <= 1:
        return limit(prefill)
    context = prompt_len + output_len // 2
    decode = decode_floor(limits, model, hf_config, prompts, context, dtype, kv_dtype)
    return limit(prefill) + (output_len - 1) * limit(decode)
