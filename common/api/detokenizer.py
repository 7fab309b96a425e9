"""Incremental detokenization and stop strings for one sequence.

Owns turning a stream of generated token ids into text deltas that are safe to show: whole
characters only (a multi-byte character split across tokens comes out once it is complete), special
tokens skipped if asked, and stop strings applied the OpenAI way (the output ends just before the
first stop string; a delta never shows text that a stop string later claims). Also owns the
per-token strings and bytes that logprobs report. Used by `pdserve run-batch` and the router's
stream assembly.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from common.api.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so that its text (leading space,
# merges with the previous token) comes out as it would inside the whole sequence.
PROMPT_CONTEXT_TOKENS = 5


class Detokenizer:
    """Feed token ids with `add_token`; each call returns the new text that may be shown.

    Decoding looks at a small window of recent tokens (vLLM's prefix/read offsets): the text of
    `ids[prefix_offset:]` minus the text of `ids[prefix_offset:read_offset]` is what the newest
    tokens added. So the cost per token does not grow with the sequence.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids = context  # the decode window's tokens: prompt context, then output
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""  # output text decoded so far (cut at a stop string once one matched)
        self._num_emitted = 0  # chars of `text` already returned
        self.stop_reason: str | None = None  # the stop string that ended the output
        self.finished = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched (the request should be aborted, finish_reason 'stop')."""
        return self.stop_reason is not None

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it makes safe to show (often '')."""
        if self.finished:
            raise RuntimeError("add_token after the detokenizer finished")
        self._ids.append(token_id)
        self.num_output_tokens += 1
        self._append(self._decode_new(final=False))
        if self.stopped:
            self.finished = True
        return self._release()

    def finish(self) -> str:
        """The generation ended (no more tokens): return the rest of the text, nothing held back."""
        if self.finished:
            return ""
        self._append(self._decode_new(final=True))
        self.finished = True
        return self._release()

    def _decode_new(self, final: bool) -> str:
        ids, skip = self._ids, self.skip_special_tokens
        if self._read_offset - self._prefix_offset == 1:  # the usual window: one token, known
            prefix_text = self.tokenizer.decode_token(ids[self._prefix_offset], skip)
        else:
            prefix_text = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip)
        new_text = self.tokenizer.decode(ids[self._prefix_offset :], skip)
        # A trailing U+FFFD is a character whose remaining bytes are in tokens not seen yet.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        # Keep the window from growing: drop tokens before the new prefix offset.
        if self._prefix_offset > 0:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def _append(self, delta: str) -> None:
        if not delta:
            return
        start = len(self.text)
        self.text += delta
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return
        # Only a match ending inside the new delta is new; earlier text was checked already.
        search_from = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stop_reason = s
            self.text = self.text[: i + len(s) if self.include_stop_str_in_output else i]
            self._num_emitted = min(self._num_emitted, len(self.text))

    def _release(self) -> str:
        end = len(self.text)
        if not self.finished:
            end -= self._stop_prefix_len()
        if end <= self._num_emitted:
            return ""
        out = self.text[self._num_emitted : end]
        self._num_emitted = end
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of `text` that could be the start of a stop string."""
        text, held = self.text, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A single token's text as logprobs show it (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    """A single token's raw UTF-8 bytes (part of a character for a split multi-byte character)."""
    hf = tokenizer.hf
    if _is_byte_level(hf):
        piece = hf.convert_ids_to_tokens(token_id)
        byte_of = _unicode_to_byte()
        if piece is not None and all(c in byte_of for c in piece):
            return [byte_of[c] for c in piece]
    return list(token_text(tokenizer, token_id).encode("utf-8"))


def _is_byte_level(hf: object) -> bool:
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
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
