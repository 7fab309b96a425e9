"""Tiny Llama, Qwen2 and Qwen3 tokenizers laid out as their checkpoints ship them.

Each directory holds what `load_hf_tokenizer` and AutoTokenizer read: tokenizer.json and
tokenizer_config.json as transformers' own class writes them (`LlamaTokenizer`: a SentencePiece-
style BPE with byte fallback, trained here on a few lines; `Qwen2Tokenizer`, which Qwen3 uses too:
byte-level BPE with NFC and Qwen's split pattern, over the default model's vocabulary and merges),
a chat template that renders tools, and the family's tiny config.json (Qwen3 also a
generation_config.json with two eos ids, as Qwen3 ships). `legacy_llama_tokenizer` rewrites a
Llama one into the layout older Llama 2 checkpoints have (the pipeline in the normalizer, no
pre-tokenizer), which `LlamaTokenizer` builds differently. Used by test_tokenizer.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.model.model_files import locate_model
from tests.common.api.tool_template import QWEN_TOOL_TEMPLATE
from tests.tiny_models import tiny_config

FAMILIES = ("llama", "qwen2", "qwen3")
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if tools %}[tools] {{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Hello world! How are you today? What is 2+2?",
    "naïve café résumé ☕ 日本語のテキスト 🤖 👋🏽",
    "def f(x):\n    return x * 2\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
]


def build_tiny_tokenizer(family: str, path: Path) -> Path:
    """A `family` ("llama", "qwen2" or "qwen3") tokenizer and tiny config in `path`."""
    tokenizer = _llama() if family == "llama" else _qwen(thinking=family == "qwen3")
    tokenizer.save_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<|im_end|>")}
    if family == "llama":
        config = tiny_config("llama", vocab_size=len(tokenizer), bos_token_id=ids["<s>"],
                             eos_token_id=ids["</s>"])  # fmt: skip
    else:
        config = tiny_config(family, vocab_size=len(tokenizer), eos_token_id=ids["<|im_end|>"])
    config.save_pretrained(path)
    if family == "qwen3":
        eos = [ids["<|im_end|>"], tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


def legacy_llama_tokenizer(llama_dir: Path, path: Path) -> Path:
    """A copy of a tiny Llama tokenizer with its tokenizer.json in the older layout."""
    shutil.copytree(llama_dir, path)
    saved = json.loads((path / "tokenizer.json").read_text())
    saved["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    saved["pre_tokenizer"] = None
    (path / "tokenizer.json").write_text(json.dumps(saved))
    return path


def _llama():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in model["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)  # as Llama 2
    tokenizer.chat_template = LLAMA_TEMPLATE
    return tokenizer


def _qwen(thinking: bool):
    from transformers import Qwen2Tokenizer

    smol = json.loads((locate_model("default").hf_dir / "tokenizer.json").read_text())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=smol["vocab"],
        merges=[tuple(m) for m in smol["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if thinking:  # Qwen3's: added, not special (decode keeps them)
        tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    return tokenizer
