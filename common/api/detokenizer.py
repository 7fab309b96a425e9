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

from common.api.tokenizer import Tokenizer, byte_level_chars

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so that its text (leading space,
# merges with the previous token) comes out as it would inside the whole sequence.
PROMPT_CONTEXT_TOKENS = 5


class Detokenizer:
    """Feed token ids with `add_token`; each call returns the new text that may be shown.

    Decoding looks at a small window of recent tokens (vLLM's prefix/read offsets): the text of
    the window minus the text of its first `read_offset` tokens (the prefix, already shown) is
    what the newest tokens added. So the cost per token does not grow with the sequence. The
    window starts at the prefix (tokens before it are dropped), and the prefix's text is kept
    until the window moves on: a streamed token costs one decode of the window. With a
    byte-level tokenizer (`Tokenizer.byte_pieces`) a window of plain tokens is decoded from
    its bytes, kept beside it, to the same text the tokenizer gives, without calling it.
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
        self._ids = context  # the decode window: the prefix (shown), then tokens not shown yet
        self._read_offset = len(context)  # tokens in the prefix
        self._prefix_text: str | None = None  # the prefix's text, once decoded
        self._pieces = tokenizer.byte_pieces()  # plain token -> its bytes, when decodable so
        self._window_bytes = self._bytes_of(context)  # the window's, while all plain
        self._prefix_num_bytes = 0 if self._window_bytes is None else len(self._window_bytes)
        self.num_output_tokens = 0
        self._text = ""  # output text decoded so far (cut at a stop string once one matched)
        self._parts: list[str] = []  # without stop strings: text decoded since `_text` was joined
        self._num_emitted = 0  # chars of `text` already returned (with stop strings)
        self.stop_reason: str | None = None  # the stop string that ended the output
        self.finished = False

    @property
    def text(self) -> str:
        """The output text decoded so far (cut at a stop string once one matched)."""
        parts = self._parts
        if parts:  # joined when asked for: a stream's per-token deltas cost no copy of it all
            parts.insert(0, self._text)
            self._text = "".join(parts)
            parts.clear()
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched (the request should be aborted, finish_reason 'stop')."""
        return self.stop_reason is not None

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it makes safe to show (often '')."""
        if self.finished:
            raise RuntimeError("add_token after the detokenizer finished")
        self._ids.append(token_id)
        window = self._window_bytes
        if window is not None:
            piece = self._pieces.get(token_id)  # type: ignore[union-attr]
            self._window_bytes = None if piece is None else window + piece
        self.num_output_tokens += 1
        delta = self._decode_new(False)
        if not self.stop:  # nothing can be held back or cut: shown as decoded
            if delta:
                self._parts.append(delta)
            return delta
        self._append(delta)
        if self.stop_reason is not None:
            self.finished = True
        return self._release()

    def finish(self) -> str:
        """The generation ended (no more tokens): return the rest of the text, nothing held back."""
        if self.finished:
            return ""
        delta = self._decode_new(True)
        self.finished = True
        if not self.stop:
            if delta:
                self._parts.append(delta)
            return delta
        self._append(delta)
        return self._release()

    def _decode_new(self, final: bool) -> str:
        ids, read, tokenizer = self._ids, self._read_offset, self.tokenizer
        prefix_text, window = self._prefix_text, self._window_bytes
        if window is not None:  # UTF-8 read as the Rust decoder reads it (from_utf8_lossy)
            if prefix_text is None:
                prefix = window[: self._prefix_num_bytes]
                prefix_text = self._prefix_text = prefix.decode("utf-8", "replace")
            new_text = window.decode("utf-8", "replace")
        else:
            if prefix_text is None:
                prefix_text = self._prefix_text = tokenizer.decode(
                    ids[:read], self.skip_special_tokens
                )
            new_text = tokenizer.decode(ids, self.skip_special_tokens)
        # A trailing U+FFFD is a character whose remaining bytes are in tokens not seen yet.
        if len(new_text) <= len(prefix_text) or (new_text[-1] == REPLACEMENT_CHAR and not final):
            return ""
        # The tokens just read become the prefix; those before it leave the window.
        del ids[:read]
        self._read_offset = len(ids)
        if window is not None:
            window = self._window_bytes = window[self._prefix_num_bytes :]
        elif self._pieces is not None:
            window = self._window_bytes = self._bytes_of(ids)
        if window is not None:
            self._prefix_num_bytes = len(window)
            self._prefix_text = None  # decoded from its bytes when next needed
        elif len(ids) == 1:  # the usual window: one token, whose text is remembered
            self._prefix_text = tokenizer.decode_token(ids[0], self.skip_special_tokens)
        else:
            self._prefix_text = None  # decoded when next needed
        return new_text[len(prefix_text) :]

    def _bytes_of(self, ids: list[int]) -> bytes | None:
        """The bytes of `ids` when every one is a plain token of a byte-level tokenizer."""
        pieces = self._pieces
        if pieces is None:
            return None
        out = [pieces.get(i) for i in ids]
        return None if None in out else b"".join(out)  # type: ignore[arg-type]

    def _append(self, delta: str) -> None:
        """Add decoded text, with stop strings: cut it at the first one that matches."""
        if not delta:
            return
        start = len(self._text)
        text = self._text = self._text + delta
        if self.num_output_tokens < self.min_tokens:
            return
        # Only a match ending inside the new delta is new; earlier text was checked already.
        search_from = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stop_reason = s
            self._text = text[: i + len(s) if self.include_stop_str_in_output else i]
            self._num_emitted = min(self._num_emitted, len(self._text))

    def _release(self) -> str:
        """With stop strings: the text not shown yet, less an end that may start one."""
        end = len(self._text)
        if not self.finished:
            end -= self._stop_prefix_len()
        if end <= self._num_emitted:
            return ""
        out = self._text[self._num_emitted : end]
        self._num_emitted = end
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of `text` that could be the start of a stop string."""
        text, held = self._text, 0
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
        byte_of = byte_level_chars()
        if piece is not None and all(c in byte_of for c in piece):
            return [byte_of[c] for c in piece]
    return list(token_text(tokenizer, token_id).encode("utf-8"))


def _is_byte_level(hf: object) -> bool:
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"
