"""common/api/choice.py: one choice's tokens, logprobs, text and finish reason as they arrive."""

from __future__ import annotations

import pytest

from common.api.choice import Choice
from common.api.detokenizer import REPLACEMENT_CHAR
from common.api.requests import parse_completion_request
from common.api.tokenizer import Tokenizer
from common.model.model_files import resolve_model
from common.sampling_params import SamplingParams

IM_END = 2
MULTIBYTE = "Café ☕ 日本語のテキスト 🤖🚀 done"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make_choice(tok: Tokenizer, logprobs: int | None = None, min_tokens: int = 0, **body) -> Choice:
    request = parse_completion_request({"prompt": "Once upon a time", **body}, ["default"])
    params = SamplingParams(max_tokens=64, logprobs=logprobs, min_tokens=min_tokens)
    return Choice(3, ids(tok, "Once upon a time"), params, request, tok)


def first_prefix_containing(tok: Tokenizer, token_ids: list[int], needle: str) -> int:
    """How many tokens it takes for the decoded text to contain `needle`."""
    return next(k for k in range(1, len(token_ids) + 1) if needle in tok.decode(token_ids[:k]))


def test_tokens_one_at_a_time_then_length(tok: Tokenizer) -> None:
    choice = make_choice(tok)
    out = ids(tok, " Hello world, how are you")
    deltas = [choice.add([t]) for t in out[:-1]]
    last = choice.add([out[-1]], finished=True, finish_reason="length")
    assert [d.first_token for d in deltas + [last]] == list(range(len(out)))
    assert "".join(d.text for d in deltas) + last.text == " Hello world, how are you"
    assert all(d.finish_reason is None for d in deltas)
    assert last.finish_reason == choice.finish_reason == "length" and choice.done
    result = choice.result()
    assert (result.index, result.text, result.token_ids) == (3, choice.text, out)
    assert result.logprobs is None and result.top_logprobs is None  # not asked for


def test_finished_without_a_reason_is_stop_and_done_choices_take_nothing(tok: Tokenizer) -> None:
    choice = make_choice(tok)
    assert choice.add([IM_END], finished=True).finish_reason == "stop"
    assert choice.text == ""  # the special token is skipped
    with pytest.raises(RuntimeError, match="done"):
        choice.add([5])


def test_stop_string_across_token_boundaries_in_one_batch(tok: Tokenizer) -> None:
    text, stop = " The quick brown fox jumps over the lazy dog.", "wn fox ju"
    out = ids(tok, text)
    assert not any(stop in tok.decode([t]) for t in out)  # it really spans tokens
    choice = make_choice(tok, logprobs=0, stop=stop)
    # The worker sent the whole tail at once; the choice ends at the token completing the stop.
    delta = choice.add(out, [-0.5] * len(out), [None] * len(out), finished=False)
    k = first_prefix_containing(tok, out, stop)
    assert k < len(out)
    assert delta.finish_reason == choice.finish_reason == "stop" and choice.done
    assert delta.text == choice.text == " The quick bro"
    assert choice.token_ids == out[:k]
    assert choice.logprobs == [-0.5] * k and len(choice.top_logprobs) == k  # aligned with ids


def test_stop_string_split_over_separate_adds(tok: Tokenizer) -> None:
    text, stop = " one two three four five", " three four"
    out = ids(tok, text)
    choice = make_choice(tok, stop=[stop, "zzz"])
    shown = []
    for t in out:
        delta = choice.add([t])
        shown.append(delta.text)
        if choice.done:
            break
    # " three" was held back (it could start the stop string) and is never shown.
    assert "".join(shown) == choice.text == " one two"
    assert all("three" not in s for s in shown)
    assert choice.finish_reason == "stop"
    assert len(choice.token_ids) == first_prefix_containing(tok, out, stop)


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    choice = make_choice(tok, stop=" c", include_stop_str_in_output=True)
    delta = choice.add(ids(tok, " a b c d e"))
    assert delta.text == choice.text == " a b c" and choice.finish_reason == "stop"


def test_held_back_stop_prefix_is_released_when_the_generation_ends(tok: Tokenizer) -> None:
    choice = make_choice(tok, stop="three four")
    first = choice.add(ids(tok, " one two three"))
    assert first.text == " one two "  # "three" might still become "three four"
    last = choice.add([], finished=True, finish_reason="length")
    assert last.text == "three" and choice.text == " one two three"
    assert last.first_token == len(choice.token_ids)  # it carried no tokens
    assert choice.finish_reason == "length"


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    choice = make_choice(tok, min_tokens=3, stop="stop")
    for t in ids(tok, "stop here, then stop again"):
        choice.add([t])
        if choice.done:
            break
    assert choice.text == "stop here, then " and choice.finish_reason == "stop"


def test_multibyte_characters_split_over_tokens_come_out_whole(tok: Tokenizer) -> None:
    out = ids(tok, MULTIBYTE)
    assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in out)  # characters really are split
    choice = make_choice(tok)
    deltas = [choice.add([t]) for t in out]
    assert any(d.text == "" for d in deltas)  # a token holding only part of a character
    assert not any(REPLACEMENT_CHAR in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == choice.text == MULTIBYTE
    assert choice.add([], finished=True, finish_reason="length").text == ""


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    choice = make_choice(tok, stop="のテ")
    assert choice.add(ids(tok, "ab 日本語のテキスト")).text == "ab 日本語"
    assert choice.done


def test_logprobs_follow_the_tokens_and_slice_by_delta(tok: Tokenizer) -> None:
    out = ids(tok, " Hello world again")
    choice = make_choice(tok, logprobs=1)
    assert choice.want_logprobs
    top = [[(t, -0.25)] for t in out]
    choice.add(out[:2], [-0.1, -0.2], top[:2])
    # A sender with fewer logprobs than tokens: the missing ones read as unknown.
    delta = choice.add(out[2:], [-0.3], [], finished=True, finish_reason="length")
    assert choice.logprobs == [-0.1, -0.2, -0.3] + [None] * (len(out) - 3)
    assert choice.top_logprobs == top[:2] + [None] * (len(out) - 2)
    part = choice.result(delta.first_token, delta.text)
    assert part.token_ids == out[2:] and part.text == delta.text
    assert part.logprobs == choice.logprobs[2:] and part.top_logprobs == choice.top_logprobs[2:]
    assert part.finish_reason == "length"
    # logprobs=0 still asks for the sampled tokens' logprobs, with no alternatives.
    assert make_choice(tok, logprobs=0).want_logprobs


def test_choice_keeps_what_dispatch_needs(tok: Tokenizer) -> None:
    choice = make_choice(tok, logprobs=2)
    assert choice.prompt_token_ids == ids(tok, "Once upon a time")
    assert choice.params.logprobs == 2 and choice.index == 3 and not choice.done


@pytest.mark.parametrize("seed", range(3))
def test_text_only_choices_add_as_the_general_path_does(tok: Tokenizer, seed: int) -> None:
    """A choice without logprobs, echo or tools takes `add`'s short path: the same deltas, token
    ids, text and finish reason as a choice with logprobs (the general path) given the same."""
    import random

    rng = random.Random(seed)
    texts = [MULTIBYTE, " the cat sat on the mat. STOP and more", " one two three four five six"]
    for _ in range(40):
        out = ids(tok, rng.choice(texts)) + rng.choice([[], [IM_END]])
        body = rng.choice([{}, {"stop": ["STOP"]}, {"stop": ["e", "☕"]}, {"stop": [" t"]}])
        body["include_stop_str_in_output"] = rng.random() < 0.3
        min_tokens = rng.choice([0, 4])
        plain = make_choice(tok, None, min_tokens, **body)
        general = make_choice(tok, 0, min_tokens, **body)
        assert plain._plain and not general._plain
        i = 0
        while i < len(out) and not plain.done:
            k = rng.choice([1, 1, 2, 3])
            part, i = out[i : i + k], i + k
            finished = i >= len(out) and rng.random() < 0.8
            reason = "length" if finished else None
            a = plain.add(part, finished=finished, finish_reason=reason)
            b = general.add(part, finished=finished, finish_reason=reason)
            assert (a.text, a.first_token) == (b.text, b.first_token)
            assert a.finish_reason == b.finish_reason
        assert plain.token_ids == general.token_ids and plain.text == general.text
        assert plain.finish_reason == general.finish_reason
