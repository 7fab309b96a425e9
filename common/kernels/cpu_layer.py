"""A decode step's decoder layers in one C call on the CPU (`csrc/decode_layer.c`).

At batch 1 a quantized model's decode step spends as long in Python and torch dispatch between
the per-layer ops (RMSNorm, projections, rotary, attention, SiLU, about 12 calls a layer) as in
streaming its weights. `DecodeLayers.run` hands all the layers to C instead: the C functions the
per-op path calls (`fused_ops.c`, `quant_matmul.c`, `quant_gemm.c`, `paged_decode.c`, linked into
one library), in the same order with the same rounding, so a decode step's outputs equal the
per-op path's.

It applies to decode steps (one new token per sequence), to steps of at most `MAX_MULTI_ROWS`
new tokens in all (verifying drafts, short prefill chunks) and to verify-shaped steps (at most
`VERIFY_QUERY_LEN` new tokens per sequence, `MAX_VERIFY_ROWS` in all): each row attends on its
own with its sequence's block table, causally, on the CPU with float32 or bfloat16 activations, a
KV cache in that dtype or 8-bit (int8 / fp8 with scales: quantized and read in C), the torch
attention backend, and every projection quantized and served at this batch size by the C kernel
or the int8-activation GEMM or the AMX bfloat16 one over a dense copy or over the 4-bit codes
(`cpu_quant.path_for`: c, a8, amxbf16 or amx4, each called from C); anything else
returns None and the caller runs the per-op path. The model side describes each layer as a
`LayerWeights` (tensors, kernel weights and numbers; nothing here knows the model's classes) and
keeps them in a `DecodeLayers`, which holds the C structs made from them per (layers run, batch
size, dtype, cpu_quant's switches): the structs' raw pointers live exactly as long as the tensors
they point into. The step's positions,
slots and block tables are read once per step. `PDSERVE_CPU_LAYER=0` (or `enabled = False`) turns
it off. Steps of up to `TEAM_ROWS` rows whose projections are all a8 run every layer in one
OpenMP region, its threads meeting at the C code's own barrier instead of opening ~5 regions a
layer (`csrc/decode_layer.c`, "The team"; `PDSERVE_CPU_TEAM=0` or `team_rows = 0` turns it off).
Called by `common.model.llama.CausalLM.forward`.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.kernels import cpu_attention, cpu_dense, cpu_ops, cpu_qgemm, cpu_quant
from common.kernels.cbuild import CLibrary
from common.kernels.quant_weight import QuantWeight

if TYPE_CHECKING:
    from collections.abc import Sequence

    from common.kernels.attention import AttentionMetadata

_SOURCE = Path(__file__).parent / "csrc" / "decode_layer.c"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
enabled = os.environ.get("PDSERVE_CPU_LAYER", "1") != "0"
MAX_STACKS = 64  # (layers run, batch size, dtype) kept per model: batch sizes are few
# A step with several new tokens for a sequence (a verify, a short prefill chunk) runs here too
# up to this many rows in all: each row attends through the decode kernel on its own (causal by
# its length), which beats the per-op path's dispatch at a few rows, not a long prompt's attention
MAX_MULTI_ROWS = 16
# ... and a step of at most VERIFY_QUERY_LEN new tokens per sequence (verifying k <= 7 drafts) up
# to MAX_VERIFY_ROWS rows. Measured (default model, bfloat16, 2 threads, 256 tokens of context):
# 4 x 5 rows 45 ms here vs 101 ms per-op, 12 x 5 118 vs 247, 16 x 5 40 vs 92, 32 x 5 83 vs 198,
# 64 x 5 152 vs 371; but one sequence's 64-token chunk at 1,024 tokens of context 246 vs 169
# (each row rereads the sequence's KV), hence the two limits.
VERIFY_QUERY_LEN, MAX_VERIFY_ROWS = 8, 512
# Decode steps of up to this many sequences keep the C layers: the dense path (which they cannot
# run) serves only larger batches (common.model.model_runner; cpu_quant.set_dense_weights). A
# verify step of more rows runs here where the tune put c, a8, amxbf16 or amx4 first at its size.
DENSE_FLOOR_ROWS = 64
# Steps of up to this many rows whose projections all take the a8 GEMM run their layers in one
# OpenMP region, the threads meeting at the C code's own barrier (csrc/decode_layer.c, "The
# team"); 0 (or PDSERVE_CPU_TEAM=0) runs each projection and attention in a region of its own.
# Read per call. The same bits either way. Measured on a 2-core AMD EPYC (Zen 4), default model,
# 2 threads, 256-token prompts, medians, team time against the regions': whole engine steps
# alternated one by one, 1 sequence 0.971-0.975x, 4 sequences 0.967, 8 0.960, 16 0.980; the
# model's forward alone alternated, 1 row 0.944-0.969, a 5-row verify 0.932, 8 rows 0.955-0.975,
# 16 sequences 0.987-1.028, 32 sequences 0.993 (not taken).
TEAM_ROWS = 16
team_rows = TEAM_ROWS if os.environ.get("PDSERVE_CPU_TEAM", "1") != "0" else 0
_FUSED_PATHS = ("c", "a8", "amxbf16", "amx4")  # the cpu_quant paths the C layers run projections by
_p, _i, _f, _l = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long


class _Proj(ctypes.Structure):
    _fields_ = [("qweight", _p), ("scale", _p), ("zero", _p), ("bias", _p), ("bits", _i),
                ("group_size", _i), ("sdtype", _i), ("n", _i), ("k", _i), ("a8", _i)]  # fmt: skip


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
                ("max_blocks", _i), ("dtype", _i), ("threads", _i),
                ("team_rows", _i)]  # fmt: skip


_LIB = CLibrary(
    _SOURCE,
    ["-O3", "-fopenmp"],
    {
        "decode_layers": [ctypes.POINTER(_Layer), _i, ctypes.POINTER(_Step), _p, _p],
        # its own copy of quant_gemm.c's prefetch level (common.kernels.prefetch)
        "qgemm_set_prefetch": [_i],
        "qgemm_prefetch": [],
        "decode_layers_team_steps": [],
    },
    "the CPU decode layer",
    parts=[cpu_ops._LIB, cpu_attention._LIB, cpu_quant._LIB, cpu_qgemm._LIB, cpu_dense._LIB],
)


def available() -> bool:
    """True when the library is built (building it on the first call)."""
    return _LIB.available()


@dataclass(eq=False)
class LayerWeights:
    """One pre-norm decoder layer (RMSNorm, attention with fused QKV and rotary, RMSNorm, SwiGLU
    MLP with fused gate/up) as the C code takes it, built by the model side over its tensors."""

    projections: tuple[QuantWeight | None, ...]  # qkv, o, gate_up, down (None: not quantized)
    biases: tuple[torch.Tensor | None, ...]  # of the same four
    norms: tuple[torch.Tensor, ...]  # input, post-attention, then q and k (per head) if any
    norm_eps: tuple[float, ...]  # of the same norms
    scale: float  # of the attention scores
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    k_cache: torch.Tensor  # [blocks, block_size, kv heads, head_dim]
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None  # an 8-bit cache's [blocks, block_size, kv heads]
    v_scales: torch.Tensor | None
    torch_attention: bool  # the layer attends with the torch backend (the C code is its twin)


class DecodeLayers:
    """A model's decoder layers for the C call: their descriptions and the C structs made from
    them, which point into the tensors the descriptions hold. Made by the model side, replaced
    when its tensors change (.to(), new KV caches)."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        self.layers = list(layers)
        # per key: the C structs and the repacked weights (a8 panels) they point into, or None
        self._stacks: dict[tuple, tuple[ctypes.Array, list] | None] = {}

    def run(
        self, num_layers: int, x: torch.Tensor, meta: AttentionMetadata, positions: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The first `num_layers` layers of a decode step in one C call, x the embedding output,
        `positions` (int64) the step's and `cos` / `sin` the rotary tables: (last MLP output,
        residual stream, which is x updated in place); None when this step or any of the layers
        is not one the C code takes. One call for all the layers saves ~25 us of Python a layer
        at batch 1 over one per layer."""
        if not num_layers or not step_applies(x, meta):
            return None
        stack = self._stack(num_layers, x)
        if stack is None:
            return None
        step = _step(meta, positions, cos, sin, x)
        step.team_rows = team_rows  # read per call: the step's struct is kept
        out = torch.empty_like(x)
        rc = _LIB.get().decode_layers(stack, num_layers, step, x.data_ptr(), out.data_ptr())
        if rc != 0:
            raise RuntimeError(
                f"the CPU decode layers failed at layer {rc // 1000} (code {rc % 1000})"
            )
        return out, x

    def _stack(self, num_layers: int, x: torch.Tensor) -> ctypes.Array | None:
        # the projections' paths depend on the rows and on cpu_quant's switches
        key = (num_layers, x.shape[0], x.dtype, cpu_quant.activations, cpu_quant.kernel_choice)
        if key not in self._stacks:
            if len(self._stacks) >= MAX_STACKS:
                self._stacks.clear()
            # the a8 panels are the weight's derived copies, remade (and the old ones dropped)
            # when the weight is written in place: the structs keep those they point into
            panels: list = []
            plans = [_make_plan(layer, x, panels) for layer in self.layers[:num_layers]]
            ok = len(plans) == num_layers and all(p is not None for p in plans)
            self._stacks[key] = ((_Layer * num_layers)(*plans), panels) if ok else None
        entry = self._stacks[key]
        return None if entry is None else entry[0]

    def num_stacks(self) -> int:
        """How many (layers run, batch size, dtype) the C code takes so far."""
        return sum(stack is not None for stack in self._stacks.values())


def step_applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """A step of CPU activations the C layers take (one token per sequence, up to MAX_MULTI_ROWS
    rows in all, or up to MAX_VERIFY_ROWS rows of at most VERIFY_QUERY_LEN per sequence), with the
    switches on (tests and benchmarks flip them: read per call, never cached)."""
    rows, query_len = x.shape[0], meta.max_query_len
    return (
        enabled
        and cpu_ops.enabled
        and cpu_attention.enabled
        and x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.is_contiguous()
        and (
            query_len == 1
            or rows <= MAX_MULTI_ROWS
            or (query_len <= VERIFY_QUERY_LEN and rows <= MAX_VERIFY_ROWS)
        )
    )


def _make_plan(layer: LayerWeights, x: torch.Tensor, panels: list) -> _Layer | None:
    """The layer's weights and caches for the C call; None when the C code does not take it.
    The a8 panels its structs point into are added to `panels`."""
    k_cache, k_scales, v_scales = layer.k_cache, layer.k_scales, layer.v_scales
    kv8 = k_scales is not None and v_scales is not None
    projections = layer.projections
    if not (
        cpu_ops.available()
        and layer.torch_attention
        and k_cache.dim() == 4
        and (
            k_cache.dtype == x.dtype
            or (kv8 and k_cache.dtype in cpu_attention._KV_DTYPES)
            or (k_cache.dtype == torch.float16 and k_scales is None)  # converted in the C code
        )
        and (not kv8 or (k_scales.is_contiguous() and v_scales.is_contiguous()))
        and k_cache.is_contiguous()
        and layer.v_cache.is_contiguous()
        and layer.num_heads % layer.num_kv_heads == 0
        and layer.num_heads // layer.num_kv_heads <= 64
        and layer.head_dim % 2 == 0
        and layer.head_dim <= 1024
        and x.shape[1] <= cpu_ops.MAX_HIDDEN
        and len(projections) == len(layer.biases) == 4
        and len(layer.norms) in (2, 4)
        and all(w is not None and cpu_quant.path_for(w, x) in _FUSED_PATHS for w in projections)
        and all(b is None or _fits(b, x) for b in layer.biases)
        and all(_fits(n, x) for n in layer.norms)
        and all(eps == layer.norm_eps[0] for eps in layer.norm_eps)
        and available()
    ):
        return None
    qkv, o, gate_up, down = (_proj(w, b, x, panels) for w, b in zip(projections, layer.biases))
    q_norm, k_norm = [n.data_ptr() for n in layer.norms[2:]] or [None, None]
    return _Layer(
        qkv, o, gate_up, down, layer.norms[0].data_ptr(), layer.norms[1].data_ptr(), q_norm,
        k_norm, layer.norm_eps[0], layer.scale, x.shape[1], layer.num_heads, layer.num_kv_heads,
        layer.head_dim, layer.intermediate, k_cache.shape[1], k_cache.data_ptr(),
        layer.v_cache.data_ptr(), k_cache.numel() // (layer.num_kv_heads * layer.head_dim),
        k_scales.data_ptr() if kv8 else None, v_scales.data_ptr() if kv8 else None,
        cpu_attention._KV_DTYPES[k_cache.dtype] if kv8
        else cpu_attention.KV_FLOAT16 if k_cache.dtype != x.dtype else _DTYPES[x.dtype],
    )  # fmt: skip


def _fits(t: torch.Tensor, x: torch.Tensor) -> bool:
    return t.dtype == x.dtype and t.is_contiguous()


def _proj(w: QuantWeight, bias: torch.Tensor | None, x: torch.Tensor, panels: list) -> _Proj:
    """The projection through the path cpu_quant chose for x's rows (c, a8, amxbf16 or amx4):
    pointers into the weight's own tensors (`c_weights`) or into its a8 panels, AMX tiles or
    tile-ordered codes, which go into `panels`."""
    bias_ptr = None if bias is None else bias.data_ptr()
    path = cpu_quant.path_for(w, x)
    if path == "amxbf16":  # dense bfloat16 tiles: no scales, 16 bits a weight
        packed = cpu_quant.amx_weights(w)
        panels.append(packed)
        return _Proj(packed.data_ptr(), None, None, bias_ptr, 16, 0, 0, w.n, w.k, 2)
    if path == "amx4":  # 4-bit codes in tile order, float32 scales (and zeros)
        codes, scale, zero = cpu_quant.amx4_weights(w)
        panels.append((codes, scale, zero))
        zero_ptr = None if zero is None else zero.data_ptr()
        return _Proj(codes.data_ptr(), scale.data_ptr(), zero_ptr, bias_ptr, 4, w.group_size, 0,
                     w.n, w.k, 3)  # fmt: skip
    if path == "a8":
        packed = cpu_quant.a8_weights(w)
        panels.append(packed)
        zero = None if packed.zero is None else packed.zero.data_ptr()
        return _Proj(packed.codes.data_ptr(), packed.scale.data_ptr(), zero, bias_ptr,
                     packed.bits, packed.group_size, packed.scale_format, w.n, w.k, 1)  # fmt: skip
    bits, group, qweight, scale, zero, sdtype = cpu_quant.c_weights(w)
    return _Proj(qweight, scale, zero, bias_ptr, bits, group, sdtype, w.n, w.k, 0)


def _step(
    meta: AttentionMetadata, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    x: torch.Tensor,
) -> _Step:  # fmt: skip
    """What every layer of this step shares, made once a step and kept on `meta` with the
    tensors it points into (checked by identity: a new tensor is a new step)."""
    cached = meta.__dict__.get("_cpu_layer_step")
    if cached is not None:
        (p, c, s, dtype, m), step = cached[:2]
        if p is positions and c is cos and s is sin and dtype == x.dtype and m == x.shape[0]:
            return step
    tables, lens = _row_tables(meta)
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    step = _Step(
        positions.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), cos.shape[0], x.shape[0], tables.shape[1], _DTYPES[x.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    key = (positions, cos, sin, x.dtype, x.shape[0])
    meta.__dict__["_cpu_layer_step"] = (key, step, (tables, lens, slots))
    return step


def _row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table and length (int32): a sequence's own for a decode token; for the
    q new tokens of a sequence of length L, its table q times with lengths L - q + 1 .. L, so
    each token attends to the positions up to its own."""
    tables = meta.block_tables.to(torch.int32)
    if meta.max_query_len == 1:
        return tables.contiguous(), meta.seq_lens.to(torch.int32).contiguous()
    counts = torch.tensor(meta.query_lens_cpu)
    lens = [
        length - q + 1 + j
        for q, length in zip(meta.query_lens_cpu, meta.seq_lens_cpu)
        for j in range(q)
    ]
    rows = tables.repeat_interleave(counts, dim=0).contiguous()
    return rows, torch.tensor(lens, dtype=torch.int32)
