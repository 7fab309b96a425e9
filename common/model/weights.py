"""Reading model weights, one tensor at a time, under Hugging Face transformers parameter names.

Owns the two on-disk formats: HF safetensors directories (tensors as stored; compressed-tensors
checkpoints through `common.model.compressed_tensors`) and GGUF files (renamed from GGUF's `blk.N.*`
names, Llama q/k rows un-permuted). GGUF Q4_0, Q4_1 and Q8_0 tensors come out as
`common.model.quant.QuantizedTensor`s built straight from the block bytes (never a float copy);
F32/F16/BF16 as they are; other quantized types dequantized to float32 with a warning. The model
code calls `iter_weights` and copies each tensor into its own (possibly fused) parameters or
quantized layers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from common.model.model_files import ModelSource
from common.model.quant import QuantizedTensor

log = logging.getLogger(__name__)
Weight = torch.Tensor | QuantizedTensor

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


def iter_weights(source: ModelSource) -> Iterator[tuple[str, Weight]]:
    """Yield (HF parameter name, CPU tensor or QuantizedTensor) for every weight, one at a time.

    `lm_head.weight` comes only when the checkpoint has it (not when tied to the embedding).
    """
    if source.kind == "hf":
        yield from _iter_safetensors(source.path, source.hf_config)
    elif source.kind == "gguf":
        yield from _iter_gguf(source.path)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")


def _iter_safetensors(model_dir: Path, hf_config=None) -> Iterator[tuple[str, Weight]]:
    from safetensors import safe_open

    qconfig = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if qconfig is not None:
        try:
            from common.model import compressed_tensors
        except ImportError:
            compressed_tensors = None
        if compressed_tensors is not None and compressed_tensors.is_compressed_tensors(hf_config):
            yield from compressed_tensors.iter_compressed_tensors(model_dir, hf_config)
            return
        method = qconfig.get("quant_method") if isinstance(qconfig, dict) else qconfig
        raise ValueError(
            f"{model_dir}: quantized checkpoint ({method!r}) is not supported; pdserve loads "
            "compressed-tensors checkpoints (llm-compressor), GGUF Q4_0/Q4_1/Q8_0 and 16-bit ones"
        )

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


def _iter_gguf(gguf_path: Path) -> Iterator[tuple[str, Weight]]:
    from gguf import GGMLQuantizationType, GGUFReader

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
        qtype = GGMLQuantizationType(tensor.tensor_type)
        # Rows in numpy order, i.e. HF's [out, in]; GGUF lists the dims reversed.
        parts = gguf_tensor_arrays(tensor.data, qtype, tensor.name)
        if GGUF_ARCHS[arch]:  # whole rows move, so quantized rows (codes, scale, zero) move alike
            if ".self_attn.q_proj." in name:
                parts = [_unpermute_rotary(a, num_heads) for a in parts]
            elif ".self_attn.k_proj." in name:
                parts = [_unpermute_rotary(a, num_kv_heads) for a in parts]
        # off the read-only memmap: torch wants its own writable memory
        tensors = [torch.from_numpy(np.array(a, copy=True, order="C")) for a in parts]
        if len(tensors) == 1:
            yield name, tensors[0]
        else:
            yield name, _quantized_from_parts(qtype, tensors)


# GGUF block types mapped natively: (bits, values per block, bytes per block)
GGUF_NATIVE = {"Q4_0": (4, 32, 18), "Q4_1": (4, 32, 20), "Q8_0": (8, 32, 34)}
_GGUF_DENSE = {"F32", "F16", "BF16"}
_warned_types: set[str] = set()


def gguf_tensor_arrays(data: np.ndarray, qtype, tensor_name: str = "") -> list[np.ndarray]:
    """A GGUF tensor's data as numpy arrays with rows in HF order.

    Dense types and types we dequantize: [weight]. Q4_0/Q4_1/Q8_0: [codes, scale, zero] in
    QuantizedTensor's layout (zero omitted for Q4_0/Q8_0), computed from the block bytes:
      Q4_1 w = d*q + m  ->  scale d, zero m + 8d (so w = (q - 8)*scale + zero)
      Q4_0 w = d*(q-8)  ->  scale d, no zero
      Q8_0 w = d*q      ->  int8 codes, scale d, no zero
    A block's 16 bytes hold values j (low nibble) and j+16 (high nibble); ours pair 2j and 2j+1.
    """
    name = qtype.name
    if name in _GGUF_DENSE:
        return [np.asarray(data).astype(np.float32, copy=False)]
    if name not in GGUF_NATIVE:
        from gguf.quants import dequantize

        if name not in _warned_types:
            _warned_types.add(name)
            log.warning(
                "GGUF type %s (first: %s) has no native quantized layout here: dequantizing it "
                "to 16-bit (supported natively: %s)",
                name,
                tensor_name,
                ", ".join(GGUF_NATIVE),
            )
        return [np.asarray(dequantize(data, qtype), dtype=np.float32)]
    _, block, block_bytes = GGUF_NATIVE[name]
    raw = np.asarray(data)
    rows = raw.shape[0] if raw.ndim > 1 else 1
    blocks = raw.reshape(rows, -1, block_bytes)  # [N, groups, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return [codes, d]
    qs = blocks[..., 4:] if name == "Q4_1" else blocks[..., 2:]
    values = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [N, groups, 32], element order
    packed = (values[..., 0::2] | (values[..., 1::2] << 4)).reshape(rows, -1)
    if name == "Q4_0":
        return [packed, d]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return [packed, d, m + np.float32(8) * d]


def _quantized_from_parts(qtype, tensors: list[torch.Tensor]) -> QuantizedTensor:
    bits, block, _ = GGUF_NATIVE[qtype.name]
    codes, scale = tensors[0], tensors[1]
    zero = tensors[2] if len(tensors) > 2 else None
    k = codes.shape[1] * (2 if bits == 4 else 1)
    return QuantizedTensor(bits, block, codes, scale, zero, (codes.shape[0], k))


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
