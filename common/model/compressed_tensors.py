"""compressed-tensors checkpoints (as llm-compressor writes them for vLLM): reading and writing.

Owns the mapping between compressed-tensors' weight-only integer layouts and pdserve's in-memory
`QuantizedTensor` (common/model/quant.py):
- `is_compressed_tensors(hf_config)`: config.json has `quantization_config.quant_method ==
  "compressed-tensors"`; `common.model.weights` then reads the directory with
  `iter_compressed_tensors`, which yields `(hf_name, Tensor | QuantizedTensor)`.
- `write_compressed_tensors(...)`: used by `pdserve quantize` (common/model/quantize.py) to write a
  round-to-nearest (RTN) W4A16 / W8A16 checkpoint in the same layout.

The layout (compressed-tensors `pack-quantized`, `int-quantized`/`naive-quantized`):
- a quantized Linear `X` stores `X.weight_packed` int32 [N, ceil(K / (32/b))] (pack-quantized) or
  `X.weight` int8 [N, K] (int-quantized), `X.weight_scale` [N, K/group] (channel: [N, 1]) in the
  model dtype, `X.weight_shape` int32 [2] = (N, K), and for asymmetric schemes
  `X.weight_zero_point` (pack-quantized: int32 packed along N, [ceil(N / (32/b)), groups]; older
  writers and int-quantized: int8 [N, groups]).
- values are signed q in [-2^(b-1), 2^(b-1)-1], w = (q - zp) * scale; packing stores u = q + 2^(b-1)
  and puts element i of each run of 32/b into bits [b*i, b*(i+1)) of the int32 (LSB first).
Conversion to ours: int4's packed word read as little-endian bytes IS our nibble layout (byte j of
word w holds columns 8w+2j (low nibble) and 8w+2j+1 (high), u = q + 8 in 0..15, and our
w = (u - 8) * s + zero); so qweight = the bytes, scale = s, zero = -zp * s. int8: q = u - 128,
w = q * s + zero, zero = -zp * s. In fp32 both equal (q - zp) * s exactly (small integers times a
16-bit scale), so dequantizing to the scale's dtype reproduces compressed-tensors' result
bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

QUANT_METHOD = "compressed-tensors"
READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_PARAM_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                   "weight_g_idx")
# Files of a model directory that a written checkpoint replaces rather than copies.
_WEIGHT_FILE_RE = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.safetensors\.index\.json$")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization, reduced to what pdserve supports."""

    bits: int
    strategy: str  # "group" or "channel"
    group_size: int | None  # None for channel
    symmetric: bool
    format: str
    targets: tuple[str, ...]


def quantization_config(hf_config: Any) -> dict | None:
    """The `quantization_config` of a transformers config object or a config.json dict."""
    qc = hf_config.get("quantization_config") if isinstance(hf_config, dict) else getattr(
        hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc


def is_compressed_tensors(hf_config: Any) -> bool:
    """True when the checkpoint was written by compressed-tensors (any format: the iterator then
    names what it cannot read rather than loading packed tensors as plain weights)."""
    qc = quantization_config(hf_config)
    return bool(qc) and qc.get("quant_method") == QUANT_METHOD


def parse_schemes(qc: dict) -> list[WeightScheme]:
    """Validate a compressed-tensors quantization_config; ValueError names what is unsupported."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors: quantization_status {status!r} is not supported "
                         "(only 'compressed' checkpoints)")
    if qc.get("kv_cache_scheme"):
        raise ValueError(
            "compressed-tensors: kv_cache_scheme (quantized KV cache) is not supported")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"compressed-tensors: sparsity format {sparsity['format']!r} is not "
                         "supported (dense weights only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors: quantization_config has no config_groups")
    schemes = []
    for name, group in groups.items():
        where = f"compressed-tensors config group {name!r}"
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise ValueError(
                    f"{where}: {act} quantization (e.g. W8A8, FP8 activations) is not supported; "
                    "pdserve serves weight-only W4A16 / W8A16 (activations stay 16-bit)")
        w = group.get("weights")
        if not w:
            raise ValueError(f"{where}: no weight quantization")
        fmt = group.get("format") or qc.get("format")
        if fmt not in READ_FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported (supported: "
                             f"{', '.join(READ_FORMATS)})")
        if w.get("type", "int") != "int":
            raise ValueError(f"{where}: weight type {w.get('type')!r} (e.g. fp8/nvfp4) is not "
                             "supported; integer weights only")
        bits = w.get("num_bits")
        if bits not in (4, 8):
            raise ValueError(f"{where}: {bits}-bit weights are not supported (4 or 8 bits)")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{where}: weight strategy {strategy!r} is not supported "
                             "(group or channel)")
        if w.get("dynamic"):
            raise ValueError(f"{where}: dynamic weight quantization is not supported")
        if w.get("actorder") == "group":
            raise ValueError(f"{where}: actorder 'group' (activation reordering with g_idx) is not "
                             "supported; re-quantize with actorder 'weight' or none")
        group_size = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and not group_size:
            raise ValueError(f"{where}: strategy 'group' without a group_size")
        schemes.append(WeightScheme(bits, strategy, group_size, bool(w.get("symmetric", True)),
                                    fmt, tuple(group.get("targets") or ())))
    return schemes


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def scheme_for(module: str, schemes: list[WeightScheme]) -> WeightScheme:
    """The scheme a quantized module uses: a target naming it (exactly or `re:`) wins over a
    class-name target such as `Linear` (the only quantized class here)."""
    if len(schemes) == 1:
        return schemes[0]
    named = [s for s in schemes if any(_matches(t, module) for t in s.targets)]
    if named:
        return named[0]
    by_class = [s for s in schemes if "Linear" in s.targets]
    if by_class:
        return by_class[0]
    raise ValueError(f"compressed-tensors: no config group targets quantized module {module!r}")


def pack_int32(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Signed q [R, C] (int8) -> int32 words along `dim`, in pack-quantized order."""
    per_word = 32 // bits
    u = (q.to(torch.int64) + (1 << (bits - 1))).movedim(dim, 1)
    pad = -u.shape[1] % per_word
    u = torch.nn.functional.pad(u, (0, pad)).view(u.shape[0], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (u << shifts).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> signed int8 values, `length` of them along dim."""
    per_word = 32 // bits
    w = words.movedim(dim, 1).to(torch.int64)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    u = (w[:, :, None] >> shifts) & ((1 << bits) - 1)
    q = u.reshape(w.shape[0], -1)[:, :length] - (1 << (bits - 1))
    return q.to(torch.int8).movedim(1, dim).contiguous()


def to_quantized_tensor(tensors: dict[str, torch.Tensor], scheme: WeightScheme, module: str):
    """One module's compressed-tensors tensors (keys without the module prefix) ->
    QuantizedTensor."""
    from common.model.quant import QuantizedTensor

    bits = scheme.bits
    if "weight_g_idx" in tensors:
        raise ValueError(f"{module}: weight_g_idx (activation reordering) is not supported")
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        n, k = (int(v) for v in tensors["weight_shape"].tolist())
        if packed.dtype != torch.int32 or packed.shape[0] != n:
            raise ValueError(f"{module}: weight_packed {packed.dtype} {tuple(packed.shape)} does "
                             f"not hold an int32 [{n}, *] packing")
        if k % 2 or sys.byteorder != "little":
            q = unpack_int32(packed, bits, k)
            nibbles = None
        else:
            # The int32 words' little-endian bytes are already our layout (module docstring).
            raw = packed.contiguous().view(torch.uint8)[:, : k * bits // 8]
            nibbles = raw.contiguous() if bits == 4 else None
            q = None if bits == 4 else (raw ^ 0x80).view(torch.int8).contiguous()
    else:
        q = tensors["weight"]
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"{module}: {scheme.format} weight is {q.dtype}, expected int8 [N, K]")
        n, k = q.shape
        nibbles = None
    group_size = scheme.group_size if scheme.strategy == "group" else k
    if k % group_size:
        raise ValueError(f"{module}: group_size {group_size} does not divide K={k}")
    groups = k // group_size
    scale = tensors["weight_scale"]
    if scale.numel() != n * groups:
        raise ValueError(f"{module}: weight_scale {tuple(scale.shape)} does not match "
                         f"[{n}, {groups}] for K={k}, group_size {group_size}")
    scale = scale.reshape(n, groups).to(torch.float32)
    zp = tensors.get("weight_zero_point")
    zero = None
    if zp is not None:
        if zp.dtype == torch.int32:  # pack-quantized packs it along N; int8 = stored unpacked
            zp = unpack_int32(zp.reshape(-1, groups), bits, n, dim=0)
        zp = zp.reshape(n, groups).to(torch.float32)
        zero = None if not zp.any() else -zp * scale
    elif not scheme.symmetric:
        raise ValueError(f"{module}: asymmetric scheme without weight_zero_point")
    if bits == 4:
        if nibbles is None:
            if k % 2:
                raise ValueError(f"{module}: int4 needs an even K, got {k}")
            u = (q.to(torch.int16) + 8).to(torch.uint8)
            nibbles = u[:, 0::2] | (u[:, 1::2] << 4)
        qweight = nibbles
    else:
        qweight = q
    return QuantizedTensor(bits=bits, group_size=group_size, qweight=qweight, scale=scale,
                           zero=zero, shape=(n, k))


def iter_compressed_tensors(model_dir: Path, hf_config: Any) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, Tensor | QuantizedTensor) for every weight of a compressed-tensors directory.

    Quantized modules (those with a `weight_scale`) come as `<module>.weight` QuantizedTensors;
    everything else (embeddings, norms, an ignored lm_head) as stored.
    """
    from safetensors import safe_open

    schemes = parse_schemes(quantization_config(hf_config))
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                where[key] = f
    quantized = {key.rsplit(".", 1)[0] for key in where if key.endswith(".weight_scale")}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in files}
        yield from _iter_modules(where, handles, quantized, schemes)


def _iter_modules(where, handles, quantized, schemes) -> Iterator[tuple[str, Any]]:
    for key in sorted(where):
        module, _, param = key.rpartition(".")
        if module in quantized:
            if param in _PARAM_SUFFIXES[1:] or (param == "weight" and f"{module}.weight_packed"
                                                in where):
                continue  # read with the module's weight
            if param in ("weight_packed", "weight"):
                parts = {p: handles[where[f"{module}.{p}"]].get_tensor(f"{module}.{p}")
                         for p in ("weight_packed", "weight", *_PARAM_SUFFIXES[1:])
                         if f"{module}.{p}" in where}
                yield f"{module}.weight", to_quantized_tensor(parts, scheme_for(module, schemes),
                                                              module)
                continue
        yield key, handles[where[key]].get_tensor(key)


def rtn_quantize(
    weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest with compressed-tensors' min-max parameters -> (q int8 [N, K] signed,
    scale [N, groups] in scale_dtype, zero point int8 [N, groups] or None when symmetric).

    symmetric: s = max|w| / ((2^b - 1) / 2), zp = 0; asymmetric: s = (max - min) / (2^b - 1) with
    the range widened to include 0, zp = round(qmin - min / s). q = clamp(round(w / s) + zp).
    """
    n, k = weight.shape
    group_size = group_size or k
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    lo = w.amin(-1).clamp(max=0)
    hi = w.amax(-1).clamp(min=0)
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        scale = (torch.maximum(-lo, hi) / ((qmax - qmin) / 2)).clamp(min=eps)
    else:
        scale = ((hi - lo) / (qmax - qmin)).clamp(min=eps)
    # Quantize with the scale as stored, so dequantizing the checkpoint is exactly this rounding.
    scale = scale.to(scale_dtype)
    s = scale.to(torch.float32)
    zp = None if symmetric else torch.round(qmin - lo / s).clamp(qmin, qmax)
    q = torch.round(w / s[..., None]) + (0 if zp is None else zp[..., None])
    q = q.clamp(qmin, qmax).to(torch.int8).reshape(n, k)
    return q, scale, None if zp is None else zp.to(torch.int8)


def scheme_config(bits: int, group_size: int | None, symmetric: bool,
                  ignore: Iterable[str]) -> dict:
    """The quantization_config llm-compressor writes for a W{bits}A16 preset (pack-quantized)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": bits, "type": "int", "symmetric": symmetric,
                "strategy": "group" if group_size else "channel", "group_size": group_size,
                "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
                "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def compress_weight(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, bits: int,
                    module: str) -> dict[str, torch.Tensor]:
    """A module's pack-quantized tensors from RTN (or GPTQ) output."""
    out = {
        f"{module}.weight_packed": pack_int32(q, bits),
        f"{module}.weight_scale": scale.contiguous(),
        f"{module}.weight_shape": torch.tensor(list(q.shape), dtype=torch.int32),
    }
    if zp is not None:
        out[f"{module}.weight_zero_point"] = pack_int32(zp, bits, dim=0)
    return out


def is_quantizable(name: str, tensor: torch.Tensor, ignore: Iterable[str]) -> bool:
    """Linear weights of the decoder layers; embeddings, norms and ignored modules stay 16-bit."""
    module = name.rpartition(".")[0]
    return (name.endswith(".weight") and tensor.dim() == 2 and "embed" not in module
            and not any(_matches(t, module) for t in ignore))


def write_compressed_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], hf_dir: Path, out_dir: Path, bits: int,
    group_size: int | None, symmetric: bool = True, ignore: Iterable[str] = ("lm_head",),
    dtype: torch.dtype | None = None,
) -> Path:
    """Quantize `weights` (HF names, 16/32-bit) with RTN and write a compressed-tensors checkpoint.

    hf_dir supplies config.json and the tokenizer files (copied); the config gains the
    quantization_config. 16-bit tensors and scales are stored in `dtype` (default: each tensor's
    own). Returns out_dir.
    """
    from safetensors.torch import save_file

    ignore = list(ignore)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if not isinstance(tensor, torch.Tensor):  # a QuantizedTensor from a quantized source
            tensor = tensor.dequantize(dtype or torch.float32)
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if is_quantizable(name, tensor, ignore):
            try:
                q, scale, zp = rtn_quantize(tensor, bits, group_size, symmetric, target)
            except ValueError as e:
                raise ValueError(f"{name} {tuple(tensor.shape)}: {e}") from None
            tensors.update(compress_weight(q, scale, zp, bits, name.rpartition(".")[0]))
        else:
            tensors[name] = tensor.to(target).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    config["quantization_config"] = scheme_config(bits, group_size, symmetric, ignore)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in Path(hf_dir).iterdir():
        if f.is_file() and f.name != "config.json" and not _WEIGHT_FILE_RE.match(f.name):
            shutil.copy2(f, out_dir / f.name)
    return out_dir
