"""Shared fixtures: tiny random-weight models built with transformers, saved to a temp dir."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=255,
    bos_token_id=1,
    pad_token_id=0,
)
# Extra settings per family: q/k/v bias comes with qwen2, q/k norm with qwen3.
FAMILIES = {
    "llama": dict(tie_word_embeddings=False),
    "llama-rope-scaled": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        tie_word_embeddings=True,
    ),
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),
}


def build_tiny_model(family: str, path, seed: int = 0):
    """A random-weight model of `family`, saved with save_pretrained into `path`; returns it."""
    model_type = family.split("-")[0]
    cfg = AutoConfig.for_model(model_type, **TINY, **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_model(request, tmp_path_factory):
    """(family, HF model, model dir) for each supported family."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, build_tiny_model(request.param, path), path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-single")
    return build_tiny_model("llama", path), path
