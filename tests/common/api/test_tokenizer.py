"""common/api/tokenizer.py with the default model (SmolLM2, ChatML template)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from common.api.tokenizer import Tokenizer
from common.model.model_files import ModelSource, resolve_model

SMOLLM2_IM_END = 2


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model("default")


@pytest.fixture(scope="module")
def tok(source: ModelSource) -> Tokenizer:
    return Tokenizer.from_source(source)


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok.apply_chat_template(messages)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    # The template adds a default system turn, then the user turn, then the assistant prompt.
    assert ids.count(im_start) == 3
    assert ids.count(SMOLLM2_IM_END) == 2
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The ids are those of the rendered text (no extra BOS or re-splitting).
    assert ids == tok.encode(text, add_special_tokens=False)

    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without_prompt)] == without_prompt
    assert tok.decode(without_prompt, skip_special_tokens=False).endswith("<|im_end|>\n")


def test_encode_decode_round_trip(tok: Tokenizer) -> None:
    for text in ["Hello world", "  leading spaces\nand lines", "naïve café ☕ 日本語 🤖", "x=1+2"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens_skipped_on_decode(tok: Tokenizer) -> None:
    ids = tok.encode("Hi", add_special_tokens=False) + [SMOLLM2_IM_END]
    assert tok.decode(ids) == "Hi"
    assert tok.decode(ids, skip_special_tokens=False) == "Hi<|im_end|>"


def test_vocab_and_special_ids(tok: Tokenizer, source: ModelSource) -> None:
    assert tok.vocab_size == source.hf_config.vocab_size == 49152
    assert tok.bos_token_id == source.hf_config.bos_token_id
    assert SMOLLM2_IM_END in tok.eos_token_ids
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_eos_ids_union_config_generation_config_tokenizer(
    tmp_path: Path, source: ModelSource
) -> None:
    for f in source.hf_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, tmp_path)
    config = AutoConfig.for_model("llama", hidden_size=32, vocab_size=49152, eos_token_id=5)
    config.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    dir_source = ModelSource(
        path=tmp_path, kind="hf", hf_dir=tmp_path, hf_config=config, name=str(tmp_path)
    )
    # 2 comes from the tokenizer's own eos token.
    assert Tokenizer.from_source(dir_source).eos_token_ids == {2, 5, 7}


def test_no_chat_template_is_a_value_error(source: ModelSource) -> None:
    hf = AutoTokenizer.from_pretrained(source.hf_dir)
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf, {2}).apply_chat_template([{"role": "user", "content": "hi"}])
