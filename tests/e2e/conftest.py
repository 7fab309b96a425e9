"""A small random-weight Llama that carries the default model's real tokenizer and chat template.

Fast enough for many multi-process tests while keeping real text in and out: vocabulary and special
tokens are SmolLM2's, the weights are random (hidden 64, 2 layers).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.api.tokenizer import Tokenizer
from common.model.model_files import resolve_model


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat-llama")
    tokenizer = Tokenizer.from_source(resolve_model("default"))
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer.hf),
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return path
