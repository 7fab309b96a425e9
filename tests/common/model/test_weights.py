"""common/model/weights.py: tensors and names equal what HF transformers loads, for HF dirs and
GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from common.model.model_files import ModelSource, resolve_model
from common.model.quant import QuantizedTensor
from common.model.weights import GGUF_NATIVE, gguf_tensor_arrays, iter_weights
from tests.tiny_models import random_model, tiny_config


def _tiny_model(model_type: str, **overrides) -> torch.nn.Module:
    return random_model(tiny_config(model_type, **overrides))


def _permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to Llama q/k rows: per head, (half, pair) -> (pair, half).
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    model: torch.nn.Module, arch: str, path: Path, qtype: gguf.GGMLQuantizationType | None = None
) -> None:
    """A GGUF of `model` laid out the way llama.cpp's converter writes one.

    float32, or with `qtype` every 2-D weight (projections, embedding, head) quantized to it.
    """
    config = model.config
    name_map = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.numpy().copy()
        if arch == "llama" and ".q_proj." in hf_name:
            w = _permute_like_llama_cpp(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            w = _permute_like_llama_cpp(w, config.num_key_value_heads)
        name = f"{name_map.get_name(base)}.{suffix}"
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_source(path: Path, model: torch.nn.Module) -> ModelSource:
    return ModelSource(
        path=path, kind="gguf", hf_dir=path.parent, hf_config=model.config, name=str(path)
    )


def _assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].device.type == "cpu"
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


def test_default_gguf_matches_transformers_gguf_loader(hf_default_model: torch.nn.Module) -> None:
    source = resolve_model("default")
    ours = dict(iter_weights(source))
    # Q4_1 projections and the Q8_0 embedding come quantized; dequantized they are bit-exact
    kinds = {(q.bits, q.group_size) for q in ours.values() if isinstance(q, QuantizedTensor)}
    assert kinds == {(4, 32), (8, 32)}
    assert isinstance(ours["model.embed_tokens.weight"], QuantizedTensor)
    ours = {n: t.dequantize() if isinstance(t, QuantizedTensor) else t for n, t in ours.items()}
    reference = dict(hf_default_model.state_dict())
    # SmolLM2 ties lm_head to the embedding: the GGUF has no output.weight, so we yield none.
    assert "lm_head.weight" not in ours
    assert source.hf_config.tie_word_embeddings
    reference.pop("lm_head.weight")
    assert len(ours) == 2 + 9 * source.hf_config.num_hidden_layers
    _assert_same_weights(ours, reference)


def test_hf_dir_yields_the_saved_tensors(tmp_path: Path) -> None:
    model = _tiny_model("llama", tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf"
    _assert_same_weights(dict(iter_weights(source)), model.state_dict())


@pytest.mark.parametrize(
    "arch, overrides",
    [
        # llama with biases: llama.cpp permutes q/k biases too; GQA permutes k with kv heads.
        ("llama", dict(attention_bias=True, tie_word_embeddings=False)),
        ("qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases, not permuted
        ("qwen3", dict(head_dim=16, tie_word_embeddings=False)),  # q_norm / k_norm
    ],
)
def test_gguf_round_trip_recovers_hf_weights(tmp_path: Path, arch: str, overrides: dict) -> None:
    model = _tiny_model(arch, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(model, arch, path)
    reference = model.state_dict()
    if model.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    _assert_same_weights(dict(iter_weights(_gguf_source(path, model))), reference)


def test_unsupported_gguf_arch_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'"):
        list(iter_weights(_gguf_source(path, _tiny_model("llama"))))


def test_unknown_gguf_tensor_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_head_count(4)
    writer.add_tensor("blk.0.attn_qkv.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        list(iter_weights(_gguf_source(path, _tiny_model("llama"))))


def test_hf_dir_without_safetensors_is_an_error(tmp_path: Path) -> None:
    model = _tiny_model("llama")
    source = ModelSource(
        path=tmp_path, kind="hf", hf_dir=tmp_path, hf_config=model.config, name=str(tmp_path)
    )
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        list(iter_weights(source))


def _synthetic_rows() -> np.ndarray:
    """Rows of 32-blocks covering the edge cases: normal, tiny, constant, zero, all-positive."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 128)).astype(np.float32)
    rows[1] *= 1e-4
    rows[2, :32] = 0.75  # constant block
    rows[3, 32:64] = 0.0
    rows[4] = np.abs(rows[4]) + 3.0  # min far from zero: Q4_1's m large against d
    rows[5] *= 60.0
    return rows


@pytest.mark.parametrize("qtype", sorted(GGUF_NATIVE))
def test_native_gguf_blocks_are_bit_exact(qtype: str) -> None:
    """Our QuantizedTensor of GGUF blocks dequantizes to exactly gguf's own float32 values."""
    gtype = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(_synthetic_rows(), gtype)
    arrays = gguf_tensor_arrays(blocks, gtype)
    bits = GGUF_NATIVE[qtype][0]
    zero = torch.from_numpy(arrays[2]) if len(arrays) > 2 else None
    qt = QuantizedTensor(
        bits, 32, torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1]), zero, (6, 128)
    )
    reference = gguf.quants.dequantize(blocks, gtype)
    ours = qt.dequantize().numpy()
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


def test_default_model_q4_1_blocks_are_bit_exact_against_gguf() -> None:
    reader = gguf.GGUFReader(resolve_model("default").path)
    checked = 0
    for tensor in reader.tensors:
        gtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        if gtype.name not in GGUF_NATIVE:
            continue
        arrays = [torch.from_numpy(np.array(a)) for a in gguf_tensor_arrays(tensor.data, gtype)]
        bits = GGUF_NATIVE[gtype.name][0]
        n, k = arrays[1].shape[0], arrays[1].shape[1] * 32
        zero = arrays[2] if len(arrays) > 2 else None
        qt = QuantizedTensor(bits, 32, arrays[0], arrays[1], zero, (n, k))
        reference = gguf.quants.dequantize(tensor.data, gtype)
        assert np.array_equal(qt.dequantize().numpy().view(np.uint32), reference.view(np.uint32))
        checked += 1
    assert checked == 1 + 7 * 30  # the Q8_0 embedding and every layer's Q4_1 projections


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_gguf_round_trip_unpermutes_quantized_rows(tmp_path: Path, qtype: str) -> None:
    """A Llama GGUF quantized to qtype: we yield QuantizedTensors, q/k rows un-permuted, equal to
    gguf's dequantization of the file moved back to HF order."""
    model = _tiny_model("llama", tie_word_embeddings=False)
    gtype = gguf.GGMLQuantizationType[qtype]
    path = tmp_path / "tiny-q.gguf"
    _write_gguf(model, "llama", path, gtype)
    ours = dict(iter_weights(_gguf_source(path, model)))
    for hf_name, tensor in model.state_dict().items():
        got = ours[hf_name]
        if tensor.dim() == 1:
            assert torch.equal(got, tensor)
            continue
        assert isinstance(got, QuantizedTensor) and got.bits == GGUF_NATIVE[qtype][0]
        # the expected values: quantize the HF-order weight the way the file did (permuted), then
        # dequantize with gguf and permute back
        w = tensor.numpy()
        heads = {".q_proj.": 4, ".k_proj.": 2}
        h = next((v for k, v in heads.items() if k in hf_name), None)
        if h is not None:
            w = _permute_like_llama_cpp(w, h)
        expected = gguf.quants.dequantize(gguf.quants.quantize(w, gtype), gtype)
        if h is not None:
            half = expected.shape[0] // h // 2
            expected = expected.reshape(h, half, 2, -1).swapaxes(1, 2).reshape(expected.shape)
        assert np.array_equal(got.dequantize().numpy(), expected), hf_name


def test_unsupported_gguf_type_is_dequantized_with_a_warning(tmp_path: Path, caplog) -> None:
    model = _tiny_model("llama", tie_word_embeddings=False)
    path = tmp_path / "tiny-q5.gguf"
    _write_gguf(model, "llama", path, gguf.GGMLQuantizationType.Q5_0)
    with caplog.at_level("WARNING"):
        ours = dict(iter_weights(_gguf_source(path, model)))
    assert "Q5_0" in caplog.text
    assert all(isinstance(t, torch.Tensor) for t in ours.values())
    reference = model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert (ours["model.layers.0.mlp.down_proj.weight"] - reference).abs().max() < 0.05


def test_flag_mismatch_with_a_quantized_checkpoint(tmp_path: Path) -> None:
    from common.model.llama import CausalLM
    from common.model.quant import QuantLinear

    model = _tiny_model("llama", tie_word_embeddings=False)
    path = tmp_path / "tiny-q41.gguf"
    _write_gguf(model, "llama", path, gguf.GGMLQuantizationType.Q4_1)
    source = _gguf_source(path, model)
    with pytest.raises(
        ValueError, match="holds int4 weights in groups of 32, but --quantization int8"
    ):
        CausalLM(model.config, 64).load_weights(iter_weights(source), "int8")
    with pytest.raises(ValueError, match="--quantization-group-size 64"):
        CausalLM(model.config, 64).load_weights(iter_weights(source), "int4", 64)
    for mode, quantized in (("auto", True), ("int4", True), ("none", False)):
        ours = CausalLM(model.config, 64)
        ours.load_weights(iter_weights(source), mode)
        assert isinstance(ours.layers[0].mlp.down_proj, QuantLinear) == quantized
        assert isinstance(ours.lm_head, QuantLinear) == quantized  # the file quantizes the head


def test_unsupported_quantized_hf_checkpoint_is_named(tmp_path: Path) -> None:
    model = _tiny_model("llama")
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    model.save_pretrained(tmp_path)
    source = ModelSource(
        path=tmp_path, kind="hf", hf_dir=tmp_path, hf_config=model.config, name=str(tmp_path)
    )
    with pytest.raises(ValueError, match="'gptq'"):
        list(iter_weights(source))
