"""common/model/weights.py: tensors and names equal what HF transformers loads, for HF dirs and
GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.model.model_files import ModelSource, resolve_model
from common.model.weights import iter_weights
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


def _write_gguf(model: torch.nn.Module, arch: str, path: Path) -> None:
    """A float32 GGUF of `model` laid out the way llama.cpp's converter writes one."""
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
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", w)
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


def test_default_gguf_matches_transformers_gguf_loader() -> None:
    source = resolve_model("default")
    ours = dict(iter_weights(source))
    reference = AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32
    ).state_dict()
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
