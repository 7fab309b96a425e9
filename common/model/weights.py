"""Reading model weights, one tensor at a time, under Hugging Face transformers parameter names.

Owns the two on-disk formats: HF safetensors directories (tensors as stored) and GGUF files
(dequantized to float32, renamed from GGUF's `blk.N.*` names, Llama q/k un-permuted). The model code
calls `iter_weights` and copies each tensor into its own (possibly fused) parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from common.model.model_files import ModelSource

# GGUF architectures we load, and whether their q/k projections were permuted by llama.cpp's
# converter (it reorders Llama's rotary halves into interleaved pairs; Qwen's are left as in HF).
GGUF_ARCHS = {"llama": True, "qwen2": False, "qwen3": False}

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed rotary frequencies some Llama 3 GGUFs carry; we derive them from the config instead.
_GGUF_SKIPPED = {"rope_freqs.weight"}


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, CPU tensor) for every weight of the model, one at a time.

    `lm_head.weight` comes only when the checkpoint has it (not when tied to the embedding).
    """
    if source.kind == "hf":
        yield from _iter_safetensors(source.path)
    elif source.kind == "gguf":
        yield from _iter_gguf(source.path)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def gguf_hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for a tensor we do not load."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    if gguf_name in _GGUF_SKIPPED:
        return None
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _iter_gguf(gguf_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    arch = _read_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHS)})"
        )
    num_heads = int(_read_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_read_field(reader, f"{arch}.attention.head_count_kv", num_heads))

    for tensor in reader.tensors:
        name = gguf_hf_name(tensor.name)
        if name is None:
            continue
        # dequantize gives numpy order, i.e. HF's [out, in]; GGUF lists the dims reversed.
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if GGUF_ARCHS[arch]:
            if ".self_attn.q_proj." in name:
                weights = _unpermute_rotary(weights, num_heads)
            elif ".self_attn.k_proj." in name:
                weights = _unpermute_rotary(weights, num_kv_heads)
        if not weights.flags.writeable or not weights.flags.c_contiguous:
            weights = np.array(weights)  # off the read-only memmap, torch wants its own memory
        yield name, torch.from_numpy(weights)


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (pair, half) back to (half, pair).

    The converter reshapes each head's rows as [2 halves, head_dim/2] and swaps the two axes, so
    that rotary pairs are adjacent; swapping back restores HF's rotate_half layout.
    """
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2)).reshape(weights.shape)


def _read_field(reader, key: str, default=None):
    """A scalar or string metadata value of a GGUF file."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file has no metadata key {key!r}")
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0].item()
