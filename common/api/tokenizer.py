"""Text <-> token ids and the chat template, over a Hugging Face tokenizer.

Owns loading a model's tokenizer (`load_hf_tokenizer`: AutoTokenizer's, without importing torch
wherever the result is the same, as it is for the default model), which token ids end a
generation (`eos_token_ids`) and turning OpenAI chat messages into prompt ids. The router and
run-batch tokenize with it; the workers take its `eos_token_ids`; the engine only sees ids.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from common.model.model_files import ModelFiles

log = logging.getLogger(__name__)


class Tokenizer:
    """A model's tokenizer: `hf` is the underlying transformers tokenizer."""

    def __init__(self, hf: Any, eos_token_ids: set[int]) -> None:
        self.hf = hf
        self.eos_token_ids = eos_token_ids
        self._renders_tools: bool | None = None  # renders_tools(), once known
        # The Rust tokenizer under a fast one, when transformers' decode adds nothing to it (no
        # clean-up of spaces): 4x cheaper, and the router decodes twice per streamed token.
        backend = getattr(hf, "_tokenizer", None) if getattr(hf, "is_fast", False) else None
        cleans_up = bool(getattr(hf, "clean_up_tokenization_spaces", False))
        self._backend = backend if hasattr(backend, "decode") and not cleans_up else None
        self._token_texts: dict[tuple[int, bool], str] = {}  # decode_token's, at most 2 x vocab
        self._byte_pieces: dict[int, bytes] | None | bool = False  # byte_pieces(), once known

    @classmethod
    def from_source(cls, source: ModelFiles) -> Tokenizer:
        hf = load_hf_tokenizer(source)
        return cls(hf, _eos_token_ids(source, hf))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None and type(ids) is list:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id])`, remembered: the detokenizer's window before its newest token is
        usually that one token, so a streamed token costs one decode, not two."""
        key = (token_id, skip_special_tokens)
        text = self._token_texts.get(key)
        if text is None:
            text = self._token_texts[key] = self.decode([token_id], skip_special_tokens)
        return text

    def byte_pieces(self) -> dict[int, bytes] | None:
        """Each plain (not added) token's bytes, where `decode` of plain tokens is exactly their
        bytes joined and read as UTF-8, invalid sequences replaced (U+FFFD per maximal invalid
        part, as Python's "replace" reads them): the Rust decoder of a byte-level BPE tokenizer,
        GPT-2's kind. The detokenizer then decodes a window of such tokens without a call into
        the tokenizer. None for any other tokenizer (or a subclass with its own `decode`)."""
        if self._byte_pieces is False:
            self._byte_pieces = self._read_byte_pieces()
        return self._byte_pieces  # type: ignore[return-value]

    def _read_byte_pieces(self) -> dict[int, bytes] | None:
        backend = self._backend
        decoder = getattr(backend, "decoder", None)
        if type(decoder).__name__ != "ByteLevel" or type(self).decode is not Tokenizer.decode:
            return None
        byte_of = byte_level_chars()
        to_bytes = {ord(c): b for c, b in byte_of.items()}
        # A token with a character outside the table is decoded as its own UTF-8 by the Rust
        # decoder: left out here (the detokenizer asks the tokenizer for windows holding one).
        mapped = re.compile("[" + re.escape("".join(byte_of)) + "]*").fullmatch
        added = backend.get_added_tokens_decoder()
        return {
            token_id: piece.translate(to_bytes).encode("latin-1")
            for piece, token_id in backend.get_vocab(with_added_tokens=False).items()
            if token_id not in added and mapped(piece)
        }

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Prompt ids for OpenAI-style messages (and `tools`, OpenAI's tool objects), as the
        model's own chat template renders them."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions with a prompt")
        out = self.hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        # transformers versions differ: a list, a BatchEncoding, or a batch of one.
        if isinstance(out, Mapping):
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], list):
            (out,) = out
        return [int(i) for i in out]

    def renders_tools(self) -> bool:
        """Whether the chat template reads `tools` (one that ignores them cannot offer them)."""
        if self._renders_tools is None:
            import jinja2
            from jinja2 import meta

            try:
                template = self.hf.get_chat_template(tools=[])
            except ValueError:  # no chat template at all
                self._renders_tools = False
                return False
            try:
                env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
                self._renders_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
            except jinja2.TemplateError:  # HF's own extensions ({% generation %}): by the name
                self._renders_tools = re.search(r"\btools\b", template) is not None
        return self._renders_tools


def load_hf_tokenizer(source: ModelFiles) -> Any:
    """The transformers tokenizer of a model's files: AutoTokenizer's, without torch where it can.

    AutoTokenizer imports torch (it reads the model's config with transformers' config classes);
    the tokenizers-backed class that tokenizer_config.json names (`TokenizersBackend`,
    `Qwen2Tokenizer`, `LlamaTokenizer`...) does not. Such a class takes the vocabulary, merges and
    post-processor from tokenizer.json but may build the rest of its pipeline in code, and
    AutoTokenizer picks either that class or the file as it is: so the class is used where what
    it builds is the file's pipeline (both then agree), AutoTokenizer otherwise, the reason logged.
    """
    from transformers import TokenizersBackend

    hf_dir = source.hf_dir
    tokenizer_json = hf_dir / "tokenizer.json"
    name = source.read_json("tokenizer_config.json").get("tokenizer_class") or ""
    name = name.removesuffix("Fast")  # PreTrainedTokenizerFast is TokenizersBackend
    if not tokenizer_json.is_file():
        reason = "no tokenizer.json"
    elif not name:
        reason = "tokenizer_config.json names no tokenizer class"
    else:
        import transformers

        generic = name in ("TokenizersBackend", "PreTrainedTokenizer")
        cls = TokenizersBackend if generic else getattr(transformers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):
            reason = f"{name} is not a tokenizers-backed class"
        else:
            hf = cls.from_pretrained(hf_dir)
            if generic or _builds_the_file(hf, source.read_json("tokenizer.json")):
                return hf
            reason = f"{name} builds another pipeline than tokenizer.json's"
    log.info("loading the tokenizer of %s with AutoTokenizer (imports torch): %s", hf_dir, reason)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def _builds_the_file(hf: Any, saved: dict[str, Any]) -> bool:
    """Whether `hf`'s Rust pipeline is `saved`'s, tokenizer.json's (vocabulary and merges aside:
    every class takes those from the file)."""
    from tokenizers import Tokenizer as RustTokenizer

    # The file read back by the tokenizers library, so that settings an older version left out
    # compare as their defaults; an empty BPE vocabulary reads back in microseconds.
    model = saved.get("model", {})
    if model.get("type") == "BPE":
        saved = {**saved, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []}
    read_back = json.loads(RustTokenizer.from_str(json.dumps(saved)).to_str())
    built = json.loads(hf.backend_tokenizer.to_str())
    return _pipeline(built) == _pipeline(read_back)


def _pipeline(tokenizer_json: dict[str, Any]) -> dict[str, Any]:
    model = {k: v for k, v in tokenizer_json["model"].items() if k not in ("vocab", "merges")}
    parts = ("normalizer", "pre_tokenizer", "decoder")
    return {"model": model, **{k: tokenizer_json.get(k) for k in parts}}


def _eos_token_ids(source: ModelFiles, hf_tokenizer: Any) -> set[int]:
    """Every id that should end generation: config.json's, generation_config.json's and the
    tokenizer's eos tokens together."""
    ids: set[int] = set()

    def add(value: int | list[int] | None) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)

    add(source.read_json("config.json").get("eos_token_id"))
    add(source.read_json("generation_config.json").get("eos_token_id"))
    add(hf_tokenizer.eos_token_id)
    return ids


@lru_cache(maxsize=1)
def byte_level_chars() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table that byte-level BPE vocabularies use."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
