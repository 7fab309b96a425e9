"""Echo and prompt logprobs through the router (common/api/choice.py, common/api/responses.py,
router/streaming.py) over real HTTP, with a fake decode worker whose prompt logprobs are known
(`fake_prompt_logprobs`): the shapes lm_eval and vLLM clients read.
"""

from __future__ import annotations

import json

import httpx
import pytest

from common.protocol import Generate
from tests.router.fake_worker import RouterThread, default_tokenizer, fake_prompt_logprobs

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def router():
    with RouterThread(colocated=True) as r:
        r.decode = r.worker("decode", "d0")
        yield r


def ids(text: str = PROMPT) -> list[int]:
    return default_tokenizer().encode(text)


def token(t: int) -> str:
    from common.api.detokenizer import token_text

    return token_text(default_tokenizer(), t)


def post(router: RouterThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "default", **body}, timeout=30)


def last_params(router: RouterThread):
    return router.decode.messages(Generate)[-1].params


def check_prompt_part(logprobs: dict, prompt: list[int], k: int) -> None:
    """The first len(prompt) entries of an echoed choice's logprobs: null first, then the fake
    worker's values, each token first in its top map followed by its k best alternatives."""
    n = len(prompt)
    assert logprobs["tokens"][:n] == [token(t) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for j, (lp, _, alts) in enumerate(fake_prompt_logprobs(prompt, k), 1):
        assert logprobs["token_logprobs"][j] == lp
        top = logprobs["top_logprobs"][j]
        assert list(top.items())[0] == (token(prompt[j]), lp)
        assert list(top.values())[1:] == [v for _, v in alts]


def test_echo_with_logprobs(router: RouterThread) -> None:
    r = post(router, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2,
                                         "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200, r.text
    assert last_params(router).prompt_logprobs == 2
    prompt = ids()
    (choice,) = r.json()["choices"]
    output = prompt[:3]  # the fake worker echoes the prompt's tokens
    assert choice["text"] == PROMPT + default_tokenizer().decode(output)
    lp = choice["logprobs"]
    check_prompt_part(lp, prompt, 2)
    assert lp["tokens"][len(prompt) :] == [token(t) for t in output]
    assert lp["token_logprobs"][len(prompt) :] == [-0.5] * 3
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    # as vLLM, echo with logprobs also reports the prompt logprobs field
    assert len(choice["prompt_logprobs"]) == len(prompt)
    assert r.json()["usage"]["completion_tokens"] == 3


def test_echo_max_tokens_0_is_the_prompt_alone(router: RouterThread) -> None:
    prompt = ids()
    r = post(router, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1,
                                         "max_tokens": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    assert last_params(router).max_tokens == 1  # computed, then dropped
    (choice,) = r.json()["choices"]
    assert choice["text"] == default_tokenizer().decode(prompt, skip_special_tokens=False)
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    check_prompt_part(choice["logprobs"], prompt, 1)
    assert r.json()["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 0,
        "total_tokens": len(prompt),
    }


def test_echo_without_logprobs_computes_none(router: RouterThread) -> None:
    r = post(router, "/v1/completions", {"prompt": [PROMPT, "Hi"], "echo": True, "n": 2,
                                         "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    assert last_params(router).prompt_logprobs is None
    choices = r.json()["choices"]
    assert [c["text"][: len(p)] for c, p in zip(choices, [PROMPT] * 2 + ["Hi"] * 2)] == [
        PROMPT,
        PROMPT,
        "Hi",
        "Hi",
    ]
    assert all(c["logprobs"] is None and "prompt_logprobs" not in c for c in choices)


def test_streamed_echo_comes_first(router: RouterThread) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert events[-1] == "[DONE]"
    prompt = ids()
    assert chunks[0]["text"].startswith(PROMPT)
    check_prompt_part(chunks[0]["logprobs"], prompt, 1)
    assert "".join(c["text"] for c in chunks) == PROMPT + default_tokenizer().decode(prompt[:3])
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert len(tokens) == len(prompt) + 3
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_prompt_logprobs_field_on_completions(router: RouterThread) -> None:
    r = post(router, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1})
    assert r.status_code == 200, r.text
    prompt = ids()
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    body = choice["prompt_logprobs"]
    assert body[0] is None and len(body) == len(prompt)
    for j, (lp, rank, alts) in enumerate(fake_prompt_logprobs(prompt, 2), 1):
        # the token itself first (its own rank), then the alternatives ranked 1..k
        expected = {
            str(prompt[j]): {"logprob": lp, "rank": rank, "decoded_token": token(prompt[j])}
        }
        for a, (alt, alt_lp) in enumerate(alts, 1):
            expected.setdefault(
                str(alt), {"logprob": alt_lp, "rank": a, "decoded_token": token(alt)}
            )
        assert body[j] == expected


def test_prompt_logprobs_on_chat(router: RouterThread) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    r = post(router, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0,
                                              "max_tokens": 2, "n": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    prompt = default_tokenizer().apply_chat_template(messages)
    body = r.json()["prompt_logprobs"]
    assert len(body) == len(prompt) and body[0] is None
    assert all(list(entry) == [str(t)] for entry, t in zip(body[1:], prompt[1:]))
    assert all("prompt_logprobs" not in c for c in r.json()["choices"])


def test_prompt_logprobs_refused_in_streams(router: RouterThread) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ]:
        r = post(router, path, {**body, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        # 0 is accepted (as vLLM) and costs nothing: a stream has no field for it
        r = post(router, path, {**body, "prompt_logprobs": 0, "stream": True, "max_tokens": 1})
        assert r.status_code == 200
        assert last_params(router).prompt_logprobs is None


def test_prompt_too_long_for_prompt_logprobs_is_a_400() -> None:
    # Prompt logprobs travel in bounded messages (common.protocol.MAX_KV_HEADER_BYTES): a longer
    # prompt is refused up front rather than by every decode worker's reservation.
    from common.api.prompts import engine_inputs
    from common.api.requests import RequestError, parse_request
    from common.sampling_params import MAX_PROMPT_LOGPROB_TOKENS

    prompt = [5] * (MAX_PROMPT_LOGPROB_TOKENS + 1)
    body = {"prompt": prompt, "prompt_logprobs": 0, "max_tokens": 1}
    request = parse_request("/v1/completions", body, ["default"])
    with pytest.raises(RequestError) as e:
        engine_inputs(request, default_tokenizer(), 2 * MAX_PROMPT_LOGPROB_TOKENS)
    assert e.value.code == 400 and e.value.param == "prompt_logprobs"
    body["prompt"] = prompt[1:]
    request = parse_request("/v1/completions", body, ["default"])
    assert len(engine_inputs(request, default_tokenizer(), 2 * MAX_PROMPT_LOGPROB_TOKENS)) == 1
