"""A decode step's decoder layers in one C call on the CPU (`csrc/decode_layer.c`).

At batch 1 a quantized model's decode step spends as long in Python and torch dispatch between
the per-layer ops (RMSNorm, projections, rotary, attention, SiLU, about 12 calls a layer) as in
streaming its weights. `run_layers` hands all the layers to C instead: the same C functions the
per-op path calls (`fused_ops.c`, `quant_matmul.c`, `paged_decode.c`, linked into one library),
in the same order with the same rounding, so outputs equal the per-op path's.

It applies to pure decode steps (one new token per sequence) on the CPU with float32 or
bfloat16 activations, a KV cache in that dtype or 8-bit (int8 / fp8 with scales: quantized and
read in C), the torch attention backend, and every projection quantized and served by
the C kernel at this batch size (`cpu_quant.path_for`); anything else returns None and the
caller runs the per-op path. The layers' weight pointers are read once per (batch size, dtype)
and dropped by the model's `_apply`; the step's positions, slots and block tables once per step.
`PDSERVE_CPU_LAYER=0` (or `enabled = False`) turns it off. Called by
`common.model.llama.CausalLM.forward`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.kernels import cpu_attention, cpu_ops, cpu_quant
from common.kernels.cbuild import CLibrary

if TYPE_CHECKING:
    from collections.abc import Sequence

    from common.kernels.attention import AttentionMetadata
    from common.model.llama import CausalLM, DecoderLayer

_SOURCE = Path(__file__).parent / "csrc" / "decode_layer.c"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
enabled = os.environ.get("PDSERVE_CPU_LAYER", "1") != "0"

_MISSING = object()
_p, _i, _f, _l = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long


class _Proj(ctypes.Structure):
    _fields_ = [("qweight", _p), ("scale", _p), ("zero", _p), ("bias", _p), ("bits", _i),
                ("group_size", _i), ("sdtype", _i), ("n", _i), ("k", _i)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                ("eps", _f), ("scale", _f), ("hidden", _i), ("heads", _i), ("kv_heads", _i),
                ("head_dim", _i), ("intermediate", _i), ("block_size", _i), ("k_cache", _p),
                ("v_cache", _p), ("num_slots", _l), ("k_scales", _p), ("v_scales", _p),
                ("kv_dtype", _i)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("positions", _p), ("slot_mapping", _p), ("cos", _p), ("sin", _p),
                ("block_tables", _p), ("seq_lens", _p), ("max_pos", _l), ("tokens", _i),
                ("max_blocks", _i), ("dtype", _i), ("threads", _i)]  # fmt: skip


_LIB = CLibrary(
    _SOURCE,
    ["-O3"],
    {
        "decode_layers": [ctypes.POINTER(_Layer), _i, ctypes.POINTER(_Step), _p, _p],
    },
    "the CPU decode layer",
    parts=[cpu_ops._LIB, cpu_attention._LIB, cpu_quant._LIB],
)


def available() -> bool:
    """True when the library is built (building it on the first call)."""
    return _LIB.available()


def run_layers(
    model: CausalLM, layers: Sequence[DecoderLayer], x: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decoder `layers` of a decode step in one C call, x the embedding output: (last MLP
    output, residual stream, which is x updated in place); None when this step or any of the
    layers is not one the C code takes. One call for all the layers saves ~25 us of Python a
    layer at batch 1 over one per layer."""
    if not layers or not _step_applies(x, meta):
        return None
    attn = layers[0].self_attn
    key = (len(layers), x.shape[0], x.dtype, attn.k_cache.data_ptr())
    stacks = model.cpu_stacks
    stack = stacks.get(key, _MISSING)
    if stack is _MISSING:
        if len(stacks) >= 512:
            stacks.clear()
        plans = [_make_plan(layer, x) for layer in layers]
        stack = None
        if all(p is not None for p in plans):
            stack = (_Layer * len(plans))(*plans)
        stacks[key] = stack
    if stack is None:
        return None
    step = _step(meta, layers[0], x)
    out = torch.empty_like(x)
    rc = _LIB.get().decode_layers(stack, len(layers), step, x.data_ptr(), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"the CPU decode layers failed at layer {rc // 1000} (code {rc % 1000})")
    return out, x


def _step_applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """A decode step (one token per sequence) of CPU activations the C layers take, with the
    switches on (tests and benchmarks flip them: read per call, never cached)."""
    return (
        enabled
        and cpu_ops.enabled
        and cpu_attention.enabled
        and x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.is_contiguous()
        and meta.max_query_len == 1
    )


def _make_plan(layer: DecoderLayer, x: torch.Tensor) -> _Layer | None:
    """The layer's weights and caches for the C call; None when the C code does not take it."""
    from common.model.quant import QuantLinear

    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.qk_norm:
        norms += [attn.q_norm, attn.k_norm]
    k_cache, k_scales, v_scales = attn.k_cache, attn.k_scales, attn.v_scales
    kv8 = k_scales is not None and v_scales is not None
    if not (
        cpu_ops.available()
        and attn.backend == "torch"
        and k_cache.dim() == 4
        and (k_cache.dtype == x.dtype or (kv8 and k_cache.dtype in cpu_attention._KV_DTYPES))
        and (not kv8 or (k_scales.is_contiguous() and v_scales.is_contiguous()))
        and k_cache.is_contiguous()
        and attn.v_cache.is_contiguous()
        and attn.num_heads % attn.num_kv_heads == 0
        and attn.num_heads // attn.num_kv_heads <= 64
        and attn.head_dim % 2 == 0
        and attn.head_dim <= 1024
        and x.shape[1] <= cpu_ops.MAX_HIDDEN
        and all(isinstance(p, QuantLinear) for p in projections)
        and all(cpu_quant.path_for(p, x) == "c" for p in projections)
        and all(p.bias is None or _fits(p.bias, x) for p in projections)
        and all(_fits(n.weight, x) and n.eps == layer.input_layernorm.eps for n in norms)
        and available()
    ):
        return None
    qkv, o, gate_up, down = (_proj(p) for p in projections)
    q_norm = attn.q_norm.weight.data_ptr() if attn.qk_norm else None
    k_norm = attn.k_norm.weight.data_ptr() if attn.qk_norm else None
    return _Layer(
        qkv, o, gate_up, down, layer.input_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(), q_norm, k_norm,
        layer.input_layernorm.eps, attn.scale, x.shape[1], attn.num_heads, attn.num_kv_heads,
        attn.head_dim, mlp.intermediate, k_cache.shape[1], k_cache.data_ptr(),
        attn.v_cache.data_ptr(), k_cache.numel() // (attn.num_kv_heads * attn.head_dim),
        k_scales.data_ptr() if kv8 else None, v_scales.data_ptr() if kv8 else None,
        cpu_attention._KV_DTYPES[k_cache.dtype] if kv8 else _DTYPES[x.dtype],
    )  # fmt: skip


def _fits(t: torch.Tensor, x: torch.Tensor) -> bool:
    return t.dtype == x.dtype and t.is_contiguous()


def _proj(layer) -> _Proj:
    bits, group, qweight, scale, zero, sdtype = cpu_quant.c_weights(layer)
    bias = None if layer.bias is None else layer.bias.data_ptr()
    n, k = layer.out_features, layer.in_features
    return _Proj(qweight, scale, zero, bias, bits, group, sdtype, n, k)


def _step(meta: AttentionMetadata, layer: DecoderLayer, x: torch.Tensor) -> _Step:
    """What every layer of this step shares, made on the step's first layer and kept on `meta`
    with the tensors it points into."""
    rotary = layer.self_attn.rotary
    key = (id(rotary), rotary.positions.data_ptr(), x.dtype, x.shape[0])
    cached = meta.__dict__.get("_cpu_layer_step")
    if cached is not None and cached[0] == key:
        return cached[1]
    tables = meta.block_tables.to(torch.int32).contiguous()
    lens = meta.seq_lens.to(torch.int32).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    positions = rotary.positions  # int64, contiguous (set_positions)
    step = _Step(
        positions.data_ptr(), slots.data_ptr(), rotary.cos.data_ptr(), rotary.sin.data_ptr(),
        tables.data_ptr(), lens.data_ptr(), rotary.cos.shape[0], x.shape[0], tables.shape[1],
        _DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    meta.__dict__["_cpu_layer_step"] = (key, step, (tables, lens, slots, positions))
    return step
