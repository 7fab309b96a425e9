"""The tiny random-weight models the tests build, defined once.

Owns the shape every test model shares (`TINY`: hidden 64, 2 layers, 4 query heads over 2 KV
heads), the per-family extras (`FAMILIES`), and the two builders: `build_tiny_model` (a 256-token
vocabulary, for numerics against transformers) and `build_tiny_chat_model` (SmolLM2's vocabulary,
tokenizer and chat template around random weights, for tests that send real text through the
server). Used by tests/conftest.py's fixtures, tests/e2e/conftest.py and the tests that need a
variant (weights, run-batch, speculation end to end). Benchmarks do not import it: they measure
real models (see DESIGN.md, "benchmarks never import tests/").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

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
# The default model's special tokens (SmolLM2): <|im_start|> is 1, <|im_end|> (eos) is 2.
CHAT_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_config(model_type: str = "llama", **overrides) -> PretrainedConfig:
    """The `TINY` shape for a transformers `model_type`, with `overrides` on top."""
    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def random_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A float32 model of `config` with weights drawn from `seed`, in eval mode."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def build_tiny_model(family: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight model of `family`, saved with save_pretrained into `path`; returns it."""
    model = random_model(tiny_config(family.split("-")[0], **FAMILIES[family]), seed)
    model.save_pretrained(path)
    return model


def build_tiny_chat_model(
    path: Path,
    seed: int = 0,
    initializer_range: float = 0.2,
    max_position_embeddings: int = 2048,
) -> Path:
    """A `TINY` Llama over the default model's vocabulary, with its tokenizer files, in `path`.

    Real text goes in and out (the tokenizer and chat template are SmolLM2's) while the model stays
    fast enough for many multi-process tests. A small `initializer_range` (0.02) gives a
    near-uniform model that repeats itself, which prompt-lookup speculation needs.
    """
    from common.model.model_files import resolve_model  # pulls the default model on first use

    hf_dir = resolve_model("default").hf_dir
    vocab_size = AutoConfig.from_pretrained(hf_dir).vocab_size
    config = tiny_config(
        "llama",
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        **CHAT_TOKENS,
    )
    random_model(config, seed).save_pretrained(path)
    for f in hf_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, path)
    return Path(path)
