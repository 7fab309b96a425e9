"""common/api/tokenizer.py with the default model (SmolLM2, ChatML template), and its loader
against AutoTokenizer for the default model and tiny Llama, Qwen2 and Qwen3 tokenizers."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from common.api.tokenizer import Tokenizer
from common.model.model_files import ModelFiles, ModelSource, locate_model, resolve_model
from tests.common.api.tiny_tokenizers import FAMILIES, build_tiny_tokenizer, legacy_llama_tokenizer

ROOT = Path(__file__).resolve().parents[3]

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


# ---- load_hf_tokenizer against AutoTokenizer: the default model and tiny Llama / Qwen2 / Qwen3 --

TEXTS = [
    "Hello world",
    "  leading spaces\nand\n\nlines\r\n\ttabs   trailing  ",
    "naïve café ☕ 日本語 🤖 👋🏽 👨‍👩‍👧 e\u0301 ﬁ ① Ⅻ مرحبا",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>Hello</s> <s> x a<s>b",
    '<think>hmm</think><tool_call>\n{"name": "f"}\n</tool_call><|endoftext|>',
    "",
    " ",
    "\n\n",
    "def f(x):\n    return x * 2  # 12345678901234567890\n",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city ☀️",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATS = [
    [{"role": "user", "content": "What is 2+2? 🤖 <|im_start|>"}],
    [
        {"role": "system", "content": "Be brief.\n"},
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "Hello! 👋"},
        {"role": "user", "content": "Weather in Paris?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"sunny": true}'},
    ],
]


@pytest.fixture(scope="module", params=["default", *FAMILIES])
def model_files(request, tmp_path_factory) -> ModelFiles:
    if request.param == "default":
        return locate_model("default")
    path = build_tiny_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    return ModelFiles(path=path, kind="hf", hf_dir=path, name=request.param)


def auto_tokenizer(files: ModelFiles) -> Tokenizer:
    """The tokenizer as it was loaded before load_hf_tokenizer: AutoTokenizer, and the eos ids of
    transformers' config, generation config and the tokenizer."""
    from transformers import GenerationConfig

    hf = AutoTokenizer.from_pretrained(files.hf_dir)
    eos = {AutoConfig.from_pretrained(files.hf_dir).eos_token_id, hf.eos_token_id}
    if (files.hf_dir / "generation_config.json").is_file():
        eos |= set(GenerationConfig.from_pretrained(files.hf_dir).eos_token_id)
    return Tokenizer(hf, {i for i in eos if i is not None})


def test_the_light_tokenizer_is_auto_tokenizers(model_files: ModelFiles) -> None:
    import random

    light, auto = Tokenizer.from_source(model_files), auto_tokenizer(model_files)
    assert type(light.hf) is type(auto.hf)  # the class AutoTokenizer picks, loaded directly
    assert light.eos_token_ids == auto.eos_token_ids and light.eos_token_ids
    assert light.bos_token_id == auto.bos_token_id
    assert light.vocab_size == auto.vocab_size
    assert light.hf.get_vocab() == auto.hf.get_vocab()
    assert light.hf.all_special_ids == auto.hf.all_special_ids
    for text in TEXTS:
        for special in (True, False):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert light.decode(ids, skip) == auto.decode(ids, skip), (text, skip)
    rng = random.Random(0)
    special_ids = sorted(light.hf.all_special_ids)
    for _ in range(300):  # any ids: split characters, special and added tokens among them
        ids = [rng.choice(special_ids) if rng.random() < 0.1 else rng.randrange(light.vocab_size)
               for _ in range(rng.randint(1, 12))]  # fmt: skip
        for skip in (True, False):
            assert light.decode(ids, skip) == auto.hf.decode(ids, skip_special_tokens=skip), ids
    assert light.renders_tools() == auto.renders_tools()
    for messages in CHATS:
        for tools in (None, TOOLS):
            for prompt in (True, False):
                got = light.apply_chat_template(messages, add_generation_prompt=prompt, tools=tools)
                want = auto.apply_chat_template(messages, add_generation_prompt=prompt, tools=tools)
                assert got == want, (messages, tools, prompt)


def test_a_class_that_builds_another_pipeline_loads_with_auto_tokenizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """LlamaTokenizer with an older Llama 2 tokenizer.json: the class builds its own pre-tokenizer
    where the file normalizes, and the two split text differently (" ", "a<s>b"), so AutoTokenizer
    decides: the same ids as AutoTokenizer, never the file's."""
    llama = build_tiny_tokenizer("llama", tmp_path / "llama")
    legacy = legacy_llama_tokenizer(llama, tmp_path / "legacy")
    files = ModelFiles(path=legacy, kind="hf", hf_dir=legacy, name="legacy")
    from transformers import PreTrainedTokenizerFast

    as_file = PreTrainedTokenizerFast.from_pretrained(legacy)
    with caplog.at_level(logging.INFO, logger="common.api.tokenizer"):
        light = Tokenizer.from_source(files)
    assert "builds another pipeline than tokenizer.json's" in caplog.text
    auto = auto_tokenizer(files)
    assert any(auto.encode(t) != as_file.encode(t) for t in TEXTS)  # the case is real
    assert [light.encode(t) for t in TEXTS] == [auto.encode(t) for t in TEXTS]


def test_no_tokenizer_json_loads_with_auto_tokenizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vocab.json and merges.txt, as older checkpoints ship them: AutoTokenizer converts them."""
    hf_dir = build_tiny_tokenizer("qwen2", tmp_path / "qwen2")
    before = AutoTokenizer.from_pretrained(hf_dir)
    model = json.loads((hf_dir / "tokenizer.json").read_text())["model"]
    (hf_dir / "vocab.json").write_text(json.dumps(model["vocab"]))
    (hf_dir / "merges.txt").write_text("".join(f"{a} {b}\n" for a, b in model["merges"]))
    (hf_dir / "tokenizer.json").unlink()
    with caplog.at_level(logging.INFO, logger="common.api.tokenizer"):
        light = Tokenizer.from_source(ModelFiles(hf_dir, "hf", hf_dir, "qwen2"))
    assert "no tokenizer.json" in caplog.text
    assert [light.encode(t) for t in TEXTS] == [before.encode(t) for t in TEXTS]


_LOAD_AND_USE = """
import json, sys
from pathlib import Path
from common.api.tokenizer import Tokenizer
from common.model.model_files import ModelFiles, locate_model
tools = json.loads(sys.argv[1])
sources = [locate_model("default")] + [ModelFiles(Path(d), "hf", Path(d), d) for d in sys.argv[2:]]
for source in sources:
    tok = Tokenizer.from_source(source)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert tok.decode(tok.encode("héllo 🤖")) == "héllo 🤖"
    tok.renders_tools()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_loading_the_tokenizer_imports_no_torch(tmp_path: Path) -> None:
    """The router's start: the default model located (its sidecar cached) and every tokenizer
    above loaded and used, in a fresh interpreter that then has no torch."""
    dirs = [str(build_tiny_tokenizer(f, tmp_path / f)) for f in FAMILIES]
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_USE, json.dumps(TOOLS), *dirs],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
