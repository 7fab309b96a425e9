"""common/api/detokenizer.py with the default model's tokenizer (byte-level BPE, like GPT-2)."""

from __future__ import annotations

import pytest

from common.api.detokenizer import REPLACEMENT_CHAR, Detokenizer, token_bytes, token_text
from common.api.tokenizer import Tokenizer, byte_level_chars
from common.model.model_files import resolve_model

IM_END = 2
MULTIBYTE = "Café ☕ costs 5€. 日本語のテキスト 🤖🚀 and 한국어 too 👩‍👩‍👧!"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: Detokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens until done (or a stop string hits); every delta, the final flush included."""
    deltas = []
    for t in token_ids:
        deltas.append(detok.add_token(t))
        if detok.finished:
            return deltas
    deltas.append(detok.finish())
    return deltas


def test_multibyte_characters_come_out_whole(tok: Tokenizer) -> None:
    out = ids(tok, MULTIBYTE)
    # The text really does split characters across tokens.
    assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    for context in ([], prompt):
        detok = Detokenizer(tok, context)
        deltas = stream(detok, out)
        assert "".join(deltas) == tok.decode(out) == MULTIBYTE == detok.text
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        assert deltas[-1] == ""  # nothing was held back at the end


def test_first_token_keeps_its_leading_space_after_a_prompt(tok: Tokenizer) -> None:
    prompt, out = ids(tok, "The capital of France is"), ids(tok, " Paris, of course.")
    assert "".join(stream(Detokenizer(tok, prompt), out)) == " Paris, of course."


def test_decode_window_stays_small(tok: Tokenizer) -> None:
    """Each token decodes a few recent tokens, not the whole sequence."""
    widths = []

    class Recording(Tokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            widths.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    out = ids(tok, MULTIBYTE * 20)
    recording = Recording(tok.hf, tok.eos_token_ids)
    assert "".join(stream(Detokenizer(recording, ids(tok, "Hi")), out)) == MULTIBYTE * 20
    assert len(out) > 400 and max(widths) <= 8


def test_one_decode_per_token_once_a_token_text_is_known(tok: Tokenizer) -> None:
    """The window before the newest token is usually one token, whose text is remembered."""
    calls = []

    class Recording(Tokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(list(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    recording = Recording(tok.hf, tok.eos_token_ids)
    text = "the cat sat on the mat and the cat sat on the hat " * 8
    out = ids(tok, text)
    assert "".join(stream(Detokenizer(recording, ids(tok, "Hi")), out)) == text
    distinct = len(set(out))
    assert len(calls) <= len(out) + distinct + 2  # not 2 x len(out)
    assert len(out) > 3 * distinct  # (the text repeats: remembered texts are reused)
    assert recording.decode_token(out[0]) == tok.decode([out[0]])


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    out = ids(tok, "Hello there") + [IM_END]
    assert "".join(stream(Detokenizer(tok), out)) == "Hello there"
    kept = stream(Detokenizer(tok, skip_special_tokens=False), out)
    assert "".join(kept) == "Hello there<|im_end|>"


def check_stop(
    tok: Tokenizer, text: str, stop: list[str], expected: str, reason: str, **kwargs
) -> list[str]:
    detok = Detokenizer(tok, ids(tok, "Once upon a time"), stop=stop, **kwargs)
    deltas = stream(detok, ids(tok, text))
    assert detok.stopped and detok.stop_reason == reason
    assert "".join(deltas) == detok.text == expected
    return deltas


def test_single_stop_string(tok: Tokenizer) -> None:
    check_stop(tok, "Hello world. Goodbye world.", ["Goodbye"], "Hello world. ", "Goodbye")


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "one two three four five"
    check_stop(tok, text, ["five", "four", "three"], "one two ", "three")
    check_stop(tok, text, ["zzz", " four", "five"], "one two three", " four")


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    text, stop = "The quick brown fox jumps over the lazy dog.", "wn fox ju"
    assert not any(stop in tok.decode([t]) for t in ids(tok, text))  # it really spans tokens
    check_stop(tok, text, [stop], "The quick bro", stop)


def test_stop_string_at_the_very_start(tok: Tokenizer) -> None:
    deltas = check_stop(tok, "Hello world", ["Hello"], "", "Hello")
    assert deltas == [""]  # stopped on the first token, having shown nothing


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    check_stop(tok, "ab 日本語のテキスト", ["のテ"], "ab 日本語", "のテ")


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    check_stop(tok, "a b c d e", [" c"], "a b c", " c", include_stop_str_in_output=True)


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    text = "stop here, then stop again later"
    check_stop(tok, text, ["stop"], "stop here, then ", "stop", min_tokens=3)


def test_deltas_never_show_part_of_a_matching_stop_string(tok: Tokenizer) -> None:
    # "three" starts like the stop string: held back, then released when " five" rules it out.
    text = "one two three five six three four seven"
    deltas = check_stop(tok, text, ["three four"], "one two three five six ", "three four")
    assert deltas == ["one", " two", " ", "three five", " six", " ", ""]


def test_held_back_stop_prefix_is_released_when_generation_ends(tok: Tokenizer) -> None:
    detok = Detokenizer(tok, stop=["three four"])
    deltas = [detok.add_token(t) for t in ids(tok, "one two three")]
    assert "".join(deltas) == "one two "  # " three" might still become "three four"
    assert detok.finish() == "three"
    assert not detok.stopped and detok.text == "one two three"


def test_empty_stop_string_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        Detokenizer(tok, stop=[""])


def test_token_bytes_and_text_for_logprobs(tok: Tokenizer) -> None:
    out = ids(tok, MULTIBYTE)
    assert b"".join(bytes(token_bytes(tok, t)) for t in out) == MULTIBYTE.encode()
    assert token_text(tok, IM_END) == "<|im_end|>"
    assert token_bytes(tok, IM_END) == list(b"<|im_end|>")


class AskingTokenizer(Tokenizer):
    """The same tokenizer with a `decode` of its own: no byte pieces, every window decoded by it."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return super().decode(token_ids, skip_special_tokens)


def byte_tokens(tok: Tokenizer) -> list[int]:
    """Plain tokens that are one byte, or whose bytes are not whole UTF-8 by themselves."""
    pieces = tok.byte_pieces()
    assert pieces is not None
    return sorted(
        i for i, b in pieces.items()
        if len(b) == 1 or b.decode("utf-8", "replace") != b.decode("utf-8", "ignore")
    )  # fmt: skip


def test_byte_pieces_decode_as_the_tokenizer_does(tok: Tokenizer) -> None:
    import random

    from tokenizers import decoders

    pieces = tok.byte_pieces()
    assert pieces is not None and AskingTokenizer(tok.hf, tok.eos_token_ids).byte_pieces() is None
    added = set(tok.hf.added_tokens_decoder)
    assert len(pieces) == len(tok.hf) - len(added) and not added & set(pieces)
    for token_id, piece in pieces.items():  # every plain token alone
        assert piece.decode("utf-8", "replace") == tok.decode([token_id]), token_id
    rng, odd = random.Random(0), byte_tokens(tok)
    assert len(odd) > 200
    for _ in range(3000):  # windows of a few tokens, split and invalid characters among them
        window = [rng.choice(odd) if rng.random() < 0.7 else rng.choice(list(pieces))
                  for _ in range(rng.randint(1, 4))]  # fmt: skip
        joined = b"".join(pieces[i] for i in window)
        assert joined.decode("utf-8", "replace") == tok.decode(window), window
    # Python's "replace" and the Rust decoder's lossy UTF-8 on any bytes at all.
    char_of = {b: c for c, b in byte_level_chars().items()}
    rust = decoders.ByteLevel()
    for _ in range(3000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        assert raw.decode("utf-8", "replace") == rust.decode(["".join(char_of[b] for b in raw)])


@pytest.mark.parametrize("seed", range(4))
def test_byte_path_gives_the_tokenizers_deltas(tok: Tokenizer, seed: int) -> None:
    """Windows decoded from bytes give each token's delta exactly as the tokenizer's decode does:
    split and invalid characters, special and unknown tokens, stop strings, the final flush."""
    import random

    rng = random.Random(seed)
    asking, odd = AskingTokenizer(tok.hf, tok.eos_token_ids), byte_tokens(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])  # ends in special tokens
    prompts = [[], ids(tok, "Once upon a time"), chat]
    for _ in range(150):
        unknown, vocab = len(tok.hf) + 3, len(tok.hf)
        out = [rng.choice(odd) if r < 0.4 else IM_END if r < 0.45 else unknown if r < 0.47
               else rng.randrange(vocab) for r in (rng.random() for _ in range(40))]  # fmt: skip
        out = rng.choice([out, ids(tok, MULTIBYTE)])
        kwargs = {
            "skip_special_tokens": rng.random() < 0.7,
            "stop": rng.choice([[], ["☕"], ["e", "日本"], [" t", "\ufffd"]]),
            "include_stop_str_in_output": rng.random() < 0.3,
            "min_tokens": rng.choice([0, 0, 5]),
        }
        prompt = rng.choice(prompts)
        fast, slow = Detokenizer(tok, prompt, **kwargs), Detokenizer(asking, prompt, **kwargs)
        assert stream(fast, out) == stream(slow, out)
        assert (fast.text, fast.stop_reason) == (slow.text, slow.stop_reason)
