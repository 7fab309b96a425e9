"""compressed-tensors checkpoints: the packing layout, the conversion to QuantizedTensor, and a
round trip through `pdserve quantize --method rtn`.

Tests `common/model/compressed_tensors.py` (and, through the CLI, `common/model/quantize.py`).
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from transformers import AutoConfig

from common.cli import main
from common.model.compressed_tensors import (
    WeightScheme,
    is_compressed_tensors,
    iter_compressed_tensors,
    pack_int32,
    parse_schemes,
    rtn_quantize,
    scheme_config,
    to_quantized_tensor,
    unpack_int32,
)
from common.model.quant import QuantizedTensor
from tests.conftest import build_tiny_model


def test_int4_packing_matches_the_documented_layout():
    # q = -8..7 is stored unsigned (q + 8 = 0..15), eight per int32, element i at bits 4i..4i+3.
    q = torch.arange(-8, 8, dtype=torch.int8)[None, :]
    words = pack_int32(q, 4)
    assert words.dtype == torch.int32
    assert words.tolist() == [[0x76543210, 0xFEDCBA98 - 2 ** 32]]
    assert torch.equal(unpack_int32(words, 4, 16), q)


def test_int8_packing_pads_the_last_word_with_zero_bits():
    # compressed-tensors' own example: [1, 2] -> unsigned [129, 130], padded with 0 -> 33409.
    q = torch.tensor([[1, 2]], dtype=torch.int8)
    assert pack_int32(q, 8).tolist() == [[33409]]
    assert torch.equal(unpack_int32(pack_int32(q, 8), 8, 2), q)


def test_zero_point_packs_along_the_output_dimension():
    zp = torch.tensor([[-8, 7], [1, 0], [-1, 3]], dtype=torch.int8)  # [N=3, groups=2]
    words = pack_int32(zp, 4, dim=0)
    assert words.shape == (1, 2)
    assert words.tolist() == [[(0 | 9 << 4 | 7 << 8), (15 | 8 << 4 | 11 << 8)]]
    assert torch.equal(unpack_int32(words, 4, 3, dim=0), zp)


def _compressed_tensors_helpers():
    """compressed-tensors' own pack/unpack functions, where the library is installed (it comes
    with the [quantize] extra); their module moved between releases."""
    pytest.importorskip("compressed_tensors")
    for module in ("compressed_tensors.compressors.pack_quantized.helpers",
                   "compressed_tensors.compressors.quantized_compressors.pack_quantized"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    pytest.skip("compressed-tensors without pack_to_int32")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_agrees_with_the_compressed_tensors_library(bits, dim):
    ct = _compressed_tensors_helpers()
    gen = torch.Generator().manual_seed(bits + dim)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (13, 37), generator=gen)
    q = q.to(torch.int8)
    words = pack_int32(q, bits, dim=dim)
    assert torch.equal(ct.pack_to_int32(q, bits, packed_dim=dim), words)
    assert torch.equal(ct.unpack_from_int32(words, bits, q.shape, packed_dim=dim), q)


def _compressed(q, scale, zp, bits, fmt):
    """A module's tensors as compressed-tensors stores them."""
    n, k = q.shape
    if fmt == "pack-quantized":
        parts = {"weight_packed": pack_int32(q, bits),
                 "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
        if zp is not None:
            parts["weight_zero_point"] = pack_int32(zp, bits, dim=0)
    else:
        parts = {"weight": q}
        if zp is not None:
            parts["weight_zero_point"] = zp
    parts["weight_scale"] = scale
    return parts


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_conversion_reproduces_compressed_tensors_dequantization(fmt, bits, strategy, symmetric):
    n, k = 5, 48
    group_size = 16 if strategy == "group" else None
    groups = k // (group_size or k)
    gen = torch.Generator().manual_seed(bits + 2 * symmetric)
    qmax = (1 << (bits - 1)) - 1
    q = torch.randint(-qmax - 1, qmax + 1, (n, k), generator=gen).to(torch.int8)
    scale = (torch.rand(n, groups, generator=gen) * 0.1 + 0.01).to(torch.bfloat16)
    zp = None if symmetric else torch.randint(-qmax - 1, qmax + 1, (n, groups),
                                              generator=gen).to(torch.int8)
    scheme = WeightScheme(bits, strategy, group_size, symmetric, fmt, ("Linear",))
    qt = to_quantized_tensor(_compressed(q, scale, zp, bits, fmt), scheme, "m")
    assert isinstance(qt, QuantizedTensor)
    assert qt.shape == (n, k) and qt.bits == bits and qt.group_size == (group_size or k)
    assert qt.qweight.shape == ((n, k // 2) if bits == 4 else (n, k))
    assert qt.qweight.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert (qt.zero is None) == symmetric
    # compressed-tensors dequantizes in the scale's dtype: (q - zp) * s, each step rounded to bf16.
    qg = q.view(n, groups, -1).to(torch.bfloat16)
    if zp is not None:
        qg = qg - zp.to(torch.bfloat16)[:, :, None]
    expected = (qg * scale[:, :, None]).reshape(n, k)
    assert torch.equal(qt.dequantize(torch.bfloat16), expected)


def test_int8_with_odd_k_unpacks_through_the_generic_path():
    q = torch.randint(-128, 128, (3, 15), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    scale = torch.rand(3, 1)
    scheme = WeightScheme(8, "channel", None, True, "pack-quantized", ("Linear",))
    qt = to_quantized_tensor(_compressed(q, scale, None, 8, "pack-quantized"), scheme, "m")
    assert torch.equal(qt.qweight, q)
    torch.testing.assert_close(qt.dequantize(), q.float() * scale, rtol=0, atol=0)


def _config(**weights) -> dict:
    qc = scheme_config(4, 128, True, ["lm_head"])
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=3), "3-bit"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="float", num_bits=8),
         "weight type 'float'"),
        (lambda qc: qc["config_groups"]["group_0"].update(
            input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                               "dynamic": True}), "input_activations quantization"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
         "strategy 'tensor'"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(actorder="group"),
         "actorder 'group'"),
        (lambda qc: qc["config_groups"]["group_0"].update(format="float-quantized"),
         "format 'float-quantized'"),
        (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}),
         "sparsity format"),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
         "kv_cache_scheme"),
        (lambda qc: qc.update(quantization_status="frozen"), "quantization_status 'frozen'"),
    ],
)
def test_unsupported_configs_are_named(change, message):
    qc = _config()
    parse_schemes(qc)  # the unchanged config is supported
    change(qc)
    with pytest.raises(ValueError, match=message):
        parse_schemes(qc)


def test_is_compressed_tensors():
    assert is_compressed_tensors({"quantization_config": _config()})
    assert not is_compressed_tensors({"quantization_config": {"quant_method": "gptq"}})
    assert not is_compressed_tensors({})


def test_rtn_matches_compressed_tensors_minmax_parameters():
    w = torch.tensor([[-1.5, 0.25, 3.0, 0.5]])
    q, scale, zp = rtn_quantize(w, 4, None, True, torch.float32)
    assert zp is None and scale.item() == pytest.approx(3.0 / 7.5)
    assert q.tolist() == [[-4, 1, 7, 1]]  # 3.0 / 0.4 = 7.5 rounds to 8, clamped to 7
    q, scale, zp = rtn_quantize(w, 4, None, False, torch.float32)
    assert scale.item() == pytest.approx(4.5 / 15)
    assert zp.tolist() == [[-3]]  # round(-8 - (-1.5 / 0.3)) = round(-3)
    assert q.tolist() == [[-8, -2, 7, -1]]


SCHEMES = [
    # (scheme, --group-size or None, asymmetric, --dtype)
    ("W4A16", 32, False, "float32"),
    ("W4A16", 0, True, "bfloat16"),
    ("W4A16", 64, True, "float32"),
    ("W8A16", None, False, "bfloat16"),
    ("W8A16", 16, True, "bfloat16"),
]


@pytest.mark.parametrize("scheme, group_size, asymmetric, dtype", SCHEMES)
def test_quantize_rtn_round_trip(tmp_path, scheme, group_size, asymmetric, dtype):
    src, out = tmp_path / "src", tmp_path / "out"
    model = build_tiny_model("llama", src)
    (src / "tokenizer_config.json").write_text("{}")
    argv = ["quantize", "--model", str(src), "--scheme", scheme, "--method", "rtn", "-o", str(out),
            "--dtype", dtype]
    if group_size is not None:
        argv += ["--group-size", str(group_size)]
    if asymmetric:
        argv.append("--asymmetric")
    assert main(argv) == 0
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    config = AutoConfig.from_pretrained(out)
    assert is_compressed_tensors(config)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]

    bits = 4 if scheme == "W4A16" else 8
    torch_dtype = getattr(torch, dtype)
    original = {k: v.detach() for k, v in model.state_dict().items()}
    loaded = dict(iter_compressed_tensors(out, config))
    assert set(loaded) == set(original)
    num_quantized = 0
    for name, value in loaded.items():
        w = original[name]
        if not isinstance(value, QuantizedTensor):
            assert torch.equal(value, w.to(torch_dtype)), name  # embeddings, norms, lm_head
            assert ".layers." not in name or w.dim() == 1
            continue
        num_quantized += 1
        assert value.bits == bits and "proj" in name
        q, scale, zp = rtn_quantize(w, bits, group_size or None, not asymmetric, torch_dtype)
        assert value.scale.dtype == torch.float32
        scale = scale.float()
        n, k = w.shape
        qg = q.view(n, scale.shape[1], -1).float()
        if zp is not None:
            qg = qg - zp.float()[:, :, None]
        reference = (qg * scale[:, :, None]).reshape(n, k)
        if asymmetric and dtype == "float32":
            # (q - 8) * s + (-zp * s) rounds twice with a 24-bit scale: an ulp from (q - zp) * s.
            torch.testing.assert_close(value.dequantize(), reference, rtol=2e-7, atol=1e-7)
        else:
            # With 16-bit scales (the usual checkpoint) or no zero point, every product is exact.
            assert torch.equal(value.dequantize(torch.float32), reference), name
        # Within half a step of the original: min-max RTN covers 0 and both ends of each group, up
        # to the rounding of the stored scale (unit roundoff u): the 2^bits - 1 steps of the range
        # then span (2^bits - 1)(1 ± u) steps, so an end value can fall that far past a last level.
        step = scale.repeat_interleave(k // scale.shape[1], dim=1)
        roundoff = torch.finfo(torch_dtype).eps / 2
        bound = step * (0.5 + (2 ** bits - 1) * roundoff) * (1 + 1e-5)
        assert ((value.dequantize() - w).abs() <= bound).all(), name
    assert num_quantized == 2 * 7  # q, k, v, o, gate, up, down in each of the two layers
