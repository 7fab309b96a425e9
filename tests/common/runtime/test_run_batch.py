"""common/runtime/run_batch.py and `pdserve run-batch` on a tiny random model with SmolLM2's
tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.api.tokenizer import Tokenizer
from common.cli import main
from common.config import EngineConfig
from common.engine.engine import Engine
from common.model.model_files import resolve_model
from common.runtime.run_batch import BatchRunner
from tests.tiny_models import build_tiny_chat_model

MAX_MODEL_LEN = 384  # room for a generic tools section (about 190 tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama over SmolLM2's vocabulary, with its tokenizer and chat template."""
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-smol"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_source(resolve_model(str(model_dir)))


@pytest.fixture(scope="module")
def engine(model_dir: Path, tok: Tokenizer) -> Engine:
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
    )
    return Engine(config, eos_token_ids=tok.eos_token_ids)


def line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def completion(custom_id: str, **body) -> str:
    return line(custom_id, "/v1/completions", **{"model": "tiny", **body})


def chat(custom_id: str, **body) -> str:
    return line(custom_id, "/v1/chat/completions", **{"model": "tiny", **body})


def run(engine: Engine, tok: Tokenizer, lines: list[str]) -> list[dict]:
    out: list[str] = []
    BatchRunner(engine, tok, ["tiny"]).run(lines, out.append)
    assert engine.pool.num_free == engine.pool.num_blocks  # every request's blocks came back
    return [json.loads(o) for o in out]


def ok_body(result: dict) -> dict:
    assert result["error"] is None and result["response"]["status_code"] == 200, result
    return result["response"]["body"]


def token_ids(choice: dict) -> list[int]:
    """Output ids, from logprobs requested with return_tokens_as_token_ids."""
    entries = choice["logprobs"]["content"] if "message" in choice else None
    tokens = [e["token"] for e in entries] if entries else choice["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_cli_writes_one_line_per_input_line_in_order(
    model_dir: Path, tok: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    lines = [
        completion("c1", prompt="The sky is", max_tokens=5, temperature=0, ignore_eos=True),
        "{not json",
        chat("c2", messages=messages, max_tokens=4, temperature=0, ignore_eos=True),
        line("c3", "/v1/embeddings", model="tiny", input="x"),
        completion("c4", prompt="x", max_tokens=-1),
        "",  # blank lines are not requests
        completion("c5", prompt="x", model="gpt-4o"),
        completion("c6", prompt="x", stream=True),
        json.dumps({"custom_id": "c7", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        completion("c8", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, ignore_eos=True),
        completion("c9", prompt=[5] * MAX_MODEL_LEN, max_tokens=3),
    ]
    infile = tmp_path / "in.jsonl"
    infile.write_text("\n".join(lines) + "\n")
    argv = ["run-batch", "-i", str(infile), "-o", "-", "--model", str(model_dir)]
    argv += ["--served-model-name", "tiny", "other", "--dtype", "float32"]
    argv += ["--kv-cache-memory", "16MiB", "--max-model-len", str(MAX_MODEL_LEN)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "11/11 done" in captured.err and "tok/s" in captured.err
    results = [json.loads(o) for o in captured.out.splitlines()]
    expected = [
        ("c1", 200),
        (None, 400),
        ("c2", 200),
        ("c3", 404),
        ("c4", 400),
        ("c5", 404),
        ("c6", 400),
        ("c7", 405),
        (None, 400),
        ("c8", 200),
        ("c9", 400),
    ]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in results] == expected
    for r in results:
        assert r["id"].startswith("batch_req_") and r["response"]["request_id"].startswith("req_")
        if r["response"]["status_code"] != 200:
            err = r["response"]["body"]["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == r["response"]["status_code"]
    assert "does not exist" in results[5]["response"]["body"]["error"]["message"]
    assert "stream" in results[6]["response"]["body"]["error"]["message"]
    assert (
        f"maximum context length is {MAX_MODEL_LEN}"
        in (results[10]["response"]["body"]["error"]["message"])
    )

    c1, c2, c8 = ok_body(results[0]), ok_body(results[2]), ok_body(results[9])
    assert c1["object"] == "text_completion" and c1["id"].startswith("cmpl-")
    assert c1["model"] == "tiny" and c1["choices"][0]["finish_reason"] == "length"
    assert c1["choices"][0]["logprobs"] is None and isinstance(c1["choices"][0]["text"], str)
    assert c1["usage"] == {
        "prompt_tokens": len(tok.encode("The sky is")),
        "completion_tokens": 5,
        "total_tokens": len(tok.encode("The sky is")) + 5,
    }
    assert c2["object"] == "chat.completion" and c2["id"].startswith("chatcmpl-")
    assert c2["choices"][0]["message"]["role"] == "assistant"
    assert c2["usage"]["prompt_tokens"] == len(tok.apply_chat_template(messages))
    assert c2["usage"]["completion_tokens"] == 4
    assert c8["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_output_file_and_default_served_name(model_dir: Path, tmp_path: Path) -> None:
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text(
        completion("a", model=str(model_dir), prompt="Hi", max_tokens=2)
        + "\n"
        + completion("b", prompt="Hi", max_tokens=2)
        + "\n"
    )
    argv = ["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(model_dir)]
    assert main(argv + ["--kv-cache-memory", "16MiB", "--max-model-len", "64"]) == 0
    a, b = [json.loads(o) for o in outfile.read_text().splitlines()]
    # The served name defaults to --model as given; "tiny" is not served here.
    assert ok_body(a)["model"] == str(model_dir)
    assert b["response"]["status_code"] == 404


def test_seed_flag_makes_unseeded_sampling_repeatable(model_dir: Path, tmp_path: Path) -> None:
    infile = tmp_path / "in.jsonl"
    infile.write_text(completion("a", prompt="Once upon", max_tokens=12, ignore_eos=True) + "\n")

    def text_with(seed: str) -> str:
        outfile = tmp_path / f"out-{seed}.jsonl"
        argv = ["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(model_dir)]
        flags = ["--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--seed", seed]
        assert main(argv + flags) == 0
        return ok_body(json.loads(outfile.read_text()))["choices"][0]["text"]

    first = text_with("5")
    assert text_with("5") == first
    assert text_with("6") != first


def test_n_choices_and_prompt_batches(engine: Engine, tok: Tokenizer) -> None:
    body = dict(prompt=["Once upon", "In a galaxy far"], n=2, max_tokens=6, seed=7, ignore_eos=True)
    first, again, unseeded = run(
        engine, tok, [completion("a", **body), completion("b", **body), completion("c", prompt="x")]
    )
    body_a, body_b = ok_body(first), ok_body(again)
    assert [c["index"] for c in body_a["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body_a["choices"]]
    assert texts[0] != texts[1] and texts[2] != texts[3]  # each choice has its own seed
    assert texts == [c["text"] for c in body_b["choices"]]  # and seeds make them repeatable
    num_prompt = len(tok.encode("Once upon")) + len(tok.encode("In a galaxy far"))
    assert body_a["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 24,
        "total_tokens": num_prompt + 24,
    }
    assert ok_body(unseeded)["usage"]["completion_tokens"] <= 16  # the completions default


def test_stop_string_ends_the_request_early(engine: Engine, tok: Tokenizer) -> None:
    common = dict(
        prompt="The weather today",
        max_tokens=30,
        temperature=0,
        ignore_eos=True,
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    (free,) = run(engine, tok, [completion("free", **common)])
    choice = ok_body(free)["choices"][0]
    ids, text = token_ids(choice), choice["text"]
    assert len(ids) == 30 and text == tok.decode(ids)
    # A stop string from the middle of the free-running text, spanning a token boundary.
    cut = len(tok.decode(ids[:12]))
    stop = text[cut - 2 : cut + 2]
    assert "\ufffd" not in stop and len(stop) == 4
    expected_text = text[: text.find(stop)]
    expected_tokens = next(k for k in range(1, 31) if stop in tok.decode(ids[:k]))

    stopped, stopped_chat = run(
        engine,
        tok,
        [
            completion("stop", **common, stop=["never-appears", stop]),
            completion("stop2", **common, stop=stop, include_stop_str_in_output=True),
        ],
    )
    body = ok_body(stopped)
    assert body["choices"][0]["text"] == expected_text
    assert body["choices"][0]["finish_reason"] == "stop"
    # The engine request was aborted as soon as the stop string appeared.
    assert body["usage"]["completion_tokens"] == expected_tokens < 30
    assert token_ids(body["choices"][0]) == ids[:expected_tokens]
    assert ok_body(stopped_chat)["choices"][0]["text"] == expected_text + stop


def test_logprobs_formats(engine: Engine, tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    comp, ch = run(
        engine,
        tok,
        [
            completion("a", prompt="Hello", max_tokens=5, logprobs=2, ignore_eos=True),
            chat("b", messages=msgs, max_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True),
        ],
    )
    lp = ok_body(comp)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    content = ok_body(ch)["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])


def test_tool_calls_have_the_router_shape(engine: Engine, tok: Tokenizer) -> None:
    """SmolLM2's template renders no tools: the generic format, grammar-constrained, makes every
    answer text or well-formed calls, "auto" included; tool arguments take no invented keys."""
    city = {"type": "string", "enum": ["Paris", "Lima"]}
    params = {"type": "object", "properties": {"city": city}, "required": ["city"]}  # open
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced, required, auto = run(
        engine,
        tok,
        [
            chat("a", messages=msgs, tools=tools, tool_choice=named, max_tokens=60, seed=0),
            chat(
                "b",
                messages=msgs,
                tools=tools,
                tool_choice="required",
                max_tokens=60,
                seed=1,
                parallel_tool_calls=False,
            ),
            chat("c", messages=msgs, tools=tools, max_tokens=40, seed=2),
        ],
    )
    for result in (forced, required):
        (choice,) = ok_body(result)["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        for call in choice["message"]["tool_calls"]:
            assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) in (
                {"city": "Paris"},
                {"city": "Lima"},
            )
    (choice,) = ok_body(auto)["choices"]
    message = choice["message"]
    if message.get("tool_calls"):
        assert message["content"] is None
        for call in message["tool_calls"]:
            assert json.loads(call["function"]["arguments"]) in (
                {"city": "Paris"},
                {"city": "Lima"},
            )
    else:
        assert "<tool_call>" not in message["content"]


def test_echo_and_prompt_logprobs(engine: Engine, tok: Tokenizer, model_dir: Path) -> None:
    # The in-process engine scores the prompt too: echo with max_tokens 0 (lm_eval's request) and
    # vLLM's prompt_logprobs on chat, against transformers on the same weights (1e-4 per token:
    # see tests/common/engine/test_prompt_logprobs.py).
    import torch
    from transformers import AutoModelForCausalLM

    msgs = [{"role": "user", "content": "Hi there"}]
    comp, ch = run(
        engine,
        tok,
        [
            completion("a", prompt="Hello world, again", max_tokens=0, echo=True, logprobs=1),
            chat("b", messages=msgs, max_tokens=1, prompt_logprobs=0),
        ],
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def expected(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        return logprobs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()

    choice = ok_body(comp)["choices"][0]
    ids = tok.encode("Hello world, again")
    assert choice["text"] == "Hello world, again" and choice["finish_reason"] == "length"
    assert ok_body(comp)["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][1:] == pytest.approx(expected(ids), abs=1e-4)
    chat_ids = tok.apply_chat_template(msgs)
    body = ok_body(ch)["prompt_logprobs"]
    assert body[0] is None
    got = [entry[str(t)]["logprob"] for entry, t in zip(body[1:], chat_ids[1:])]
    assert got == pytest.approx(expected(chat_ids), abs=1e-4)


def test_run_batch_schedules_for_throughput_unless_told_otherwise(monkeypatch) -> None:
    """run-batch takes whole prompts up to a larger step (OFFLINE_DEFAULTS); its flags and
    PDSERVE_* still win, and a worker keeps the serving defaults."""
    from common.cli import build_parser
    from common.config import OFFLINE_DEFAULTS, config_from_args

    def config(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv)))

    io = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]
    offline = config(*io)
    assert offline.prefill_chunk == OFFLINE_DEFAULTS["prefill_chunk"] == "off"
    assert offline.max_num_batched_tokens == OFFLINE_DEFAULTS["max_num_batched_tokens"]
    assert offline.max_num_batched_tokens > EngineConfig().max_num_batched_tokens
    told = config(*io, "--prefill-chunk", "auto", "--max-num-batched-tokens", "1024")
    assert (told.prefill_chunk, told.max_num_batched_tokens) == ("auto", 1024)
    serving = config("decode")
    assert serving.prefill_chunk == EngineConfig().prefill_chunk == "auto"
    assert serving.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    monkeypatch.setenv("PDSERVE_PREFILL_CHUNK", "512")
    from_env = config(*io)
    assert (from_env.prefill_chunk, from_env.max_num_batched_tokens) == ("512", 8192)
