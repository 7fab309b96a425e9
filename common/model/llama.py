"""The Llama / Mistral / Qwen2 / Qwen3 decoder family over a paged KV cache.

Embedding, N x (RMSNorm, attention, residual, RMSNorm, SwiGLU MLP, residual), RMSNorm, LM head.
Differences inside the family are switches read from the HF config: GQA, RoPE (incl. scaling types,
through transformers' own RoPE init functions), attention bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings. Q/K/V and gate/up projections are fused into one matmul each; with
quantized weights (a GGUF's blocks, or `--quantization int8|int4`) `load_weights` swaps projections
for common.model.quant's QuantLinear (parts concatenated along N). Called by the model runner,
which owns the KV cache tensors and the attention metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels import cpu_layer, cpu_ops
from common.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache
from common.model import row_passes
from common.model.layers import Linear, RMSNorm, RotaryEmbedding
from common.model.quant import (
    QUANTIZATION_MODES,
    QuantEmbedding,
    QuantizedTensor,
    QuantLinear,
    TiedQuantHead,
    cat_rows,
    quantize_rtn,
    resolve_group_size,
)

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        qkv_bias, o_bias = _attention_bias(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.k_cache = torch.empty(0)  # set by the model runner
        self.v_cache = torch.empty(0)
        # an 8-bit cache's scales [blocks, block_size, kv heads] (model runner); else None
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.backend = "torch"  # set through CausalLM.set_attention_backend

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        pad = x.shape[0] - meta.slot_mapping.shape[0]  # CausalLM's padding rows: no tokens
        if pad:
            qkv = qkv[:-pad]
        fused = cpu_ops.supports(qkv) and qkv.stride(-1) == 1
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_width:].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            normed = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
            qk = qk.copy_(normed) if fused else normed  # the fused rotary works inside qkv
        written = False
        if fused:  # q and k rotated in place in one pass, k and v stored in the same pass
            written = self.rotary.rotate_qkv_(qkv, self, meta)
        else:
            qk = self.rotary(qk)  # q and k rotated in one go
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if not written and self.k_cache.dtype != k.dtype:  # an 8-bit (or cast) cache: torch only
            write_kv_cache(
                k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scales, self.v_scales
            )
        elif not written:
            KV_WRITERS[self.backend](k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        attend = ATTENTION_BACKENDS[self.backend]
        out = attend(q, self.k_cache, self.v_cache, meta, self.scale, k, v, self.k_scales,
                     self.v_scales).flatten(1)  # fmt: skip
        if pad:
            out = torch.cat((out, out.new_zeros(pad, out.shape[1])))
        return self.o_proj(out)


def _torch_backend(q, k_cache, v_cache, meta, scale, new_k, new_v, k_scales, v_scales):
    return paged_attention(q, k_cache, v_cache, meta, scale, new_k, new_v, k_scales, v_scales)


def _triton_backend(q, k_cache, v_cache, meta, scale, new_k, new_v, k_scales, v_scales):
    from common.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton(
        q, k_cache, v_cache, meta, scale, k_scales=k_scales, v_scales=v_scales
    )


def _triton_kv_writer(k, v, k_cache, v_cache, slot_mapping):
    from common.kernels.triton_attention import write_kv_cache_triton

    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)  # skips negative (padding) slots


ATTENTION_BACKENDS = {"torch": _torch_backend, "triton": _triton_backend}
KV_WRITERS = {"torch": write_kv_cache, "triton": _triton_kv_writer}


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.gate_up_proj.split = self.intermediate  # kept by a quantized replacement
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_passes.run(self.gate_up_proj, self.down_proj, x, self._forward)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        silu_mul = getattr(self.gate_up_proj, "silu_mul", None)  # oneDNN's epilogue, where it can
        fused = silu_mul(x) if silu_mul is not None else None
        if fused is not None:
            return self.down_proj(fused)
        gate_up = self.gate_up_proj(x)
        if cpu_ops.supports(gate_up) and gate_up.stride(-1) == 1:
            return self.down_proj(cpu_ops.silu_mul(gate_up, self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the residual add happens inside the next RMSNorm
        (fused on the CPU); `residual` None on the first layer, where x is the stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, meta), residual)
        return self.mlp(h), residual

    def cpu_layer_weights(self) -> cpu_layer.LayerWeights:
        """This layer as the C decode layers take it (over its own tensors and KV cache)."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        return cpu_layer.LayerWeights(
            tuple(p.kernel_weight() if type(p) is QuantLinear else None for p in projections),
            tuple(p.bias for p in projections), tuple(n.weight for n in norms),
            tuple(n.eps for n in norms), attn.scale, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, mlp.intermediate, attn.k_cache, attn.v_cache, attn.k_scales,
            attn.v_scales, torch_attention=attn.backend == "torch",
        )  # fmt: skip


# A CPU step of more rows than PAD_MIN_ROWS runs its decoder layers on a multiple of PAD_ROWS
# rows, the real ones followed by zeros. There its matmuls are oneDNN's (a quantized layer's dense
# path; a dense layer's always), and oneDNN builds a matmul for each new row count: measured on the
# default model, 2 threads, a 300-token prompt's step took 98-107 ms at a row count new to the
# process and 80-85 ms at one seen before (700 tokens: 208-227 against 175-198 ms). Prompt steps'
# row counts vary with the prompts and the decode rows beside them, so most were new; padded, they
# take one of 56 counts from 288 to 2,048, for at most 31 rows of extra work.
PAD_ROWS = 32
PAD_MIN_ROWS = 256  # at most this many rows, the quantized layers' own kernels (no oneDNN)


class CausalLM(nn.Module):
    """The whole decoder. forward() gives hidden states; compute_logits() the vocabulary scores."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.layers_run = 0  # decoder layers run so far, all steps together
        self.between_layers: Callable[[], None] | None = None  # after each layer run in Python
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.config = config
        self.rotary = rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.cpu_layers: cpu_layer.DecodeLayers | None = None  # the C decode layers' view

    def _apply(self, fn, recurse=True):
        self.cpu_layers = None  # .to() may replace the tensors it holds
        return super()._apply(fn, recurse)

    def cpu_decode_layers(self) -> cpu_layer.DecodeLayers:
        """The decoder layers as the C decode layers take them; made again when a layer's KV
        cache is not the one it was made with (the model runner binds them after loading)."""
        cached, attns = self.cpu_layers, self.__dict__.get("_cpu_attns", ())
        if cached is None or any(w.k_cache is not a.k_cache for w, a in zip(cached.layers, attns)):
            self._cpu_attns = [layer.self_attn for layer in self.layers]  # a plain list: fast
            cached = self.cpu_layers = cpu_layer.DecodeLayers(
                [layer.cpu_layer_weights() for layer in self.layers]
            )
        return cached

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm; `num_layers` stops early (the early-exit draft)."""
        x = self.embed_tokens(input_ids)
        self.rotary.set_positions(positions, x.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        fused = None
        if cpu_layer.step_applies(x, meta):  # a CPU decode step: the layers in one C call
            rotary = self.rotary
            fused = self.cpu_decode_layers().run(
                len(layers), x, meta, rotary.positions, rotary.cos, rotary.sin
            )
        if fused is not None:
            self.layers_run += len(layers)
            return self.norm(*fused)[0]
        rows = x.shape[0]
        pad = -rows % PAD_ROWS if x.device.type == "cpu" and rows > PAD_MIN_ROWS else 0
        if pad:  # zero rows, which attention skips (Attention.forward) and stay finite elsewhere
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        residual = None
        for layer in layers:
            x, residual = layer(x, residual, meta)
            self.layers_run += 1  # progress inside a long step (the workers' liveness reads it)
            if self.between_layers is not None:  # e.g. borrowed cores handed back (runtime.cores)
                self.between_layers()
        x = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return x[:rows] if pad else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def build_padded_matmuls(self, max_rows: int) -> int:
        """Run the first decoder layer's projections once at every padded row count a CPU step
        of up to `max_rows` rows can take, on zeros: oneDNN builds (and keeps) its matmul for
        each count now rather than in the first step that meets it (20-30 ms each). Their
        shapes are every layer's, so one layer builds them all. Returns the counts run."""
        layer = self.layers[0]
        attn, dtype = layer.self_attn, layer.input_layernorm.weight.dtype
        hidden = self.config.hidden_size
        first = (PAD_MIN_ROWS // PAD_ROWS + 1) * PAD_ROWS  # the smallest count a step pads to
        counts = range(first, max_rows + PAD_ROWS, PAD_ROWS)
        for rows in counts:
            x = torch.zeros(rows, hidden, dtype=dtype)
            attn.qkv_proj(x)
            attn.o_proj(torch.zeros(rows, attn.num_heads * attn.head_dim, dtype=dtype))
            layer.mlp(x)
        return len(counts)

    def set_attention_backend(self, name: str) -> None:
        """This model's paged-attention implementation ('torch' on CPU, 'triton' on GPU); each
        model keeps its own, so engines in one process may differ."""
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}")
        for layer in self.layers:
            layer.self_attn.backend = name
        self.cpu_layers = None

    def pack_for_cpu(self) -> None:
        """Prepack every projection (and the LM head) for oneDNN; call after the final .to()."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
                     quantization: str = "none", group_size: int = 0) -> None:  # fmt: skip
        """Copy HF-named weights in, fusing q/k/v and gate/up; every parameter must be filled.

        `quantization` (see common.model.quant.QUANTIZATION_MODES): 'auto' keeps quantized
        checkpoint tensors as they are, 'none' dequantizes them, 'int8'/'int4' quantize dense
        projection weights on load (round to nearest; `group_size` 0 = automatic). Projections
        whose weights end up quantized become QuantLinear; a quantized embedding (and the head
        tied to it) stays quantized unless 'none'.
        """
        if quantization not in QUANTIZATION_MODES:
            raise ValueError(f"--quantization must be one of {QUANTIZATION_MODES}")
        params = dict(self.named_parameters())
        linears = {n for n, m in self.named_modules() if isinstance(m, Linear)}
        pending: dict[str, list[tuple[int, QuantizedTensor]]] = {}  # module -> (row, part)
        filled: set[str] = set()
        for hf_name, tensor in weights:
            name, offset = _fused_target(hf_name, self.config)
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
            module = name.rsplit(".", 1)[0]
            projection = name.endswith(".weight") and module in linears and module != "lm_head"
            tensor = _apply_quantization(hf_name, tensor, quantization, group_size, projection)
            param = params[name]
            if isinstance(tensor, QuantizedTensor):
                want = param.shape if offset is None else (offset[1], param.shape[1])
                if tuple(tensor.shape) != tuple(want):
                    raise ValueError(f"{hf_name}: shape {tensor.shape}, expected {tuple(want)}")
                pending.setdefault(module, []).append((0 if offset is None else offset[0], tensor))
                filled.add(name if offset is None else f"{name}[{offset[0]}]")
                continue
            if offset is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                filled.add(name)
            else:
                start, size = offset
                if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
                    raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} does not fit {name}")
                param[start : start + size].copy_(tensor)
                filled.add(f"{name}[{start}]")
        missing = [
            n for n in params if n not in filled and not any(f.startswith(n + "[") for f in filled)
        ]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
        for module, parts in pending.items():
            self._install_quantized(module, parts, params[f"{module}.weight"])

    def _install_quantized(
        self, module: str, parts: list[tuple[int, QuantizedTensor]], dense: torch.Tensor
    ) -> None:
        """Swap a projection (or the embedding) for its quantized form.

        A fused projection whose parts do not all share one format (some dense, or different
        bits/groups, as in llama.cpp's mixed files) is dequantized into the dense weight instead.
        """
        parts.sort(key=lambda p: p[0])
        try:
            qt = cat_rows([p for _, p in parts])
        except ValueError:
            qt = None
        if qt is None or qt.shape != tuple(dense.shape):
            log.warning("%s: mixed dense/quantized parts, served dequantized", module)
            for start, part in parts:
                dense[start : start + part.shape[0]].copy_(part.dequantize(torch.float32))
            return
        if module == "embed_tokens":
            self.embed_tokens = QuantEmbedding(qt)
            if self.tie_word_embeddings:
                self.lm_head = TiedQuantHead(self.embed_tokens)
            return
        old = self.get_submodule(module)
        self.set_submodule(module, QuantLinear(qt, old.bias, getattr(old, "split", 0)))


def _apply_quantization(
    hf_name: str,
    tensor: torch.Tensor | QuantizedTensor,
    mode: str,
    group_size: int,
    projection: bool,
) -> torch.Tensor | QuantizedTensor:
    """What `--quantization mode` makes of one checkpoint tensor (see load_weights).

    A checkpoint already quantized to other bits than asked is an error (requantizing int4 to
    int8 gains no quality, int8 to int4 loses some silently): use auto or none.
    """
    if isinstance(tensor, QuantizedTensor):
        if mode == "none":
            return tensor.dequantize(torch.float32)
        if mode in ("int4", "int8") and projection:
            bits = int(mode[3:])
            if tensor.bits != bits or (group_size and group_size != tensor.group_size):
                raise ValueError(
                    f"{hf_name}: the checkpoint holds int{tensor.bits} weights in groups of "
                    f"{tensor.group_size}, but --quantization {mode}"
                    + (f" --quantization-group-size {group_size}" if group_size else "")
                    + " was asked: use --quantization auto to serve them as stored, or none to "
                    "dequantize them"
                )
        return tensor
    if mode in ("int4", "int8") and projection and tensor.dim() == 2:
        bits = int(mode[3:])
        try:
            group = resolve_group_size(tensor.shape[1], bits, group_size)
        except ValueError as exc:
            raise ValueError(f"{hf_name}: {exc}") from None
        return quantize_rtn(tensor, bits, group)
    return tensor


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_bias(config) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): Qwen2 always has q/k/v bias; Llama-style configs say so explicitly."""
    if config.model_type == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _fused_target(hf_name: str, config) -> tuple[str, tuple[int, int] | None]:
    """Map an HF parameter name to ours, with (row offset, rows) when part of a fused matrix."""
    head_dim = head_dim_of(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    for part, start, size in (
        ("q_proj", 0, q_size),
        ("k_proj", q_size, kv_size),
        ("v_proj", q_size + kv_size, kv_size),
    ):
        if f".self_attn.{part}." in hf_name:
            return hf_name.replace(part, "qkv_proj"), (start, size)
    inter = config.intermediate_size
    for part, start in (("gate_proj", 0), ("up_proj", inter)):
        if f".mlp.{part}." in hf_name:
            return hf_name.replace(part, "gate_up_proj"), (start, inter)
    return hf_name, None
