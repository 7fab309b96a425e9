"""End to end through real processes: router (HTTP) + prefill + decode workers over real sockets."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from common.api.tokenizer import Tokenizer
from common.config import EngineConfig
from common.engine.engine import Engine
from common.model.model_files import resolve_model
from common.runtime.launcher import parse_metrics
from common.sampling_params import SamplingParams
from tests.e2e.cluster import Cluster
from tests.tiny_models import build_tiny_chat_model

QUESTIONS = ["What is the capital of France?", "Count from one to ten.", "Say hi."]
COMPLETIONS = ["The quick brown fox", "Once upon a time, in a land far away, there lived"]
MAX_TOKENS = 20
SEED = 1234


@pytest.fixture(scope="module")
def reference(chat_model_dir):
    """Greedy float32 outputs of the in-process engine on the same weights."""
    model = str(chat_model_dir)
    source = resolve_model(model)
    tok = Tokenizer.from_source(source)
    engine = Engine(
        EngineConfig(model=model, dtype="float32", kv_cache_memory="64MiB"),
        eos_token_ids=tok.eos_token_ids,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    texts = [tok.encode(t) for t in COMPLETIONS]
    seqs = engine.generate(chats + texts, params)
    out = [(tok.decode(s.output_token_ids), s.num_prompt_tokens, s.num_output_tokens) for s in seqs]
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, ignore_eos=True)
    (sampled,) = engine.generate([texts[-1]], seeded)
    return out[: len(chats)], out[len(chats) :], tok.decode(sampled.output_token_ids)


@pytest.fixture(scope="module")
def colocated(chat_model_dir, tmp_path_factory):
    """One decode worker that prefills too; shared by the tests that leave it serving."""
    tmp = tmp_path_factory.mktemp("colocated")
    with Cluster(str(chat_model_dir), tmp, prefill=0, decode=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def one_p_one_d(chat_model_dir, tmp_path_factory):
    """A prefill worker and a decode worker, every prompt prefilled remotely; shared by the tests
    that leave both serving with every block free (each checks that at its end, so the next one
    starts from a clean cluster). The scale-out test adds workers: it is the last to use it."""
    tmp = tmp_path_factory.mktemp("1p1d")
    router_flags = ("--local-prefill-max-tokens", "0")
    with Cluster(str(chat_model_dir), tmp, prefill=1, decode=1, router_flags=router_flags) as c:
        yield c


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


def check_against_reference(cluster: Cluster, model: str, reference) -> None:
    chat_ref, comp_ref, seeded_ref = reference
    c = client(cluster)
    for q, (text, n_prompt, n_out) in zip(QUESTIONS, chat_ref):
        r = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": q}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert r.choices[0].message.content == text
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
        stream = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": q}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert chunks[-1].usage.completion_tokens == n_out
    for p, (text, _, n_out) in zip(COMPLETIONS, comp_ref):
        r = c.completions.create(
            model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2
        )
        assert r.choices[0].text == text
        assert r.usage.completion_tokens == n_out
        assert len(r.choices[0].logprobs.token_logprobs) == n_out
        assert all(len(t) == 2 for t in r.choices[0].logprobs.top_logprobs)
    # a seeded sampled request gives the engine's text in every mode: the sampler's random stream
    # continues across the prefill/decode handoff
    r = c.completions.create(
        model=model,
        prompt=COMPLETIONS[-1],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=SEED,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == seeded_ref


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_disaggregated_1p1d_matches_engine(chat_model_dir, reference, tmp_path, transport):
    model = str(chat_model_dir)
    with Cluster(
        model, tmp_path, prefill=1, decode=1, router_flags=("--local-prefill-max-tokens", "0")
    ) as cluster:
        cluster.procs["prefill-0"].kill()  # restart it with the transport forced
        cluster.procs["prefill-0"].wait()
        cluster.start_worker("prefill", "prefill-0b", ("--kv-transport", transport))
        deadline = time.monotonic() + 60
        # until the new worker is registered and the killed one is gone from the router
        while (
            cluster.worker_gauge("num_blocks", "prefill-0b") is None
            or cluster.worker_gauge("num_blocks", "prefill-0") is not None
        ):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.3)
        check_against_reference(cluster, model, reference)
        # every prompt was prefilled remotely: the prefill worker pushed KV
        deadline = time.monotonic() + 5  # counters travel with the next heartbeat
        while not (cluster.worker_gauge("kv_transfer_bytes_total", "prefill-0b") or 0) > 0:
            assert time.monotonic() < deadline, cluster.metrics()
            time.sleep(0.2)
        assert cluster.wait_blocks_free(["prefill-0b", "decode-0"]) and all(
            f == t for f, t in cluster.wait_blocks_free(["prefill-0b", "decode-0"]).values()
        ), cluster.logs()


def test_colocated_matches_engine(chat_model_dir, reference, colocated):
    check_against_reference(colocated, str(chat_model_dir), reference)


def test_2p2d_32_concurrent_streams(chat_model_dir, reference, tmp_path):
    model = str(chat_model_dir)
    chat_ref, _, _ = reference
    with Cluster(
        model, tmp_path, prefill=2, decode=2, router_flags=("--local-prefill-max-tokens", "0")
    ) as cluster:

        async def one(i: int, c: openai.AsyncOpenAI) -> str:
            q = QUESTIONS[i % len(QUESTIONS)]
            stream = await c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": q}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

        async def run() -> list[str]:
            c = openai.AsyncOpenAI(
                base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120
            )
            return await asyncio.gather(*(one(i, c) for i in range(32)))

        texts = asyncio.run(run())
        assert texts == [chat_ref[i % len(QUESTIONS)][0] for i in range(32)]
        workers = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
        state = cluster.wait_blocks_free(workers)
        assert all(f == t for f, t in state.values()), state


def test_client_disconnect_frees_blocks(chat_model_dir, one_p_one_d):
    cluster = one_p_one_d
    body = {
        "model": str(chat_model_dir),
        "prompt": "Tell me a long story",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # hang up mid-stream
    state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
    assert all(f == t for f, t in state.values()), state


def test_decode_worker_killed_mid_stream_its_streams_move_and_finish(chat_model_dir, tmp_path):
    # 8 streams over 2 decode workers; SIGKILL one mid-stream: its streams move to the other
    # (prompt + tokens so far re-prefilled there) and every stream ends as an undisturbed run:
    # greedy ones and seeded sampled ones token for token.
    model = str(chat_model_dir)
    bodies = [
        {
            "model": model,
            "prompt": f"Tell me a long story about the number {i}",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            **({"temperature": 0} if i < 6 else {"temperature": 1.0, "seed": 100 + i}),
        }
        for i in range(8)
    ]
    with Cluster(model, tmp_path, prefill=0, decode=2) as cluster:

        def run(kill: bool) -> list[list[str]]:
            streams: list[list[str]] = [[] for _ in bodies]

            def consume(i: int) -> None:
                with httpx.stream(
                    "POST", cluster.url + "/v1/completions", json=bodies[i], timeout=120
                ) as r:
                    for line in r.iter_lines():
                        streams[i].append(line)

            threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(8)]
            for t in threads:
                t.start()
            if kill:  # once every stream is flowing
                while not all(len(s) > 20 for s in streams):
                    time.sleep(0.01)
                cluster.kill("decode-0")
            for t in threads:
                t.join(120)
            return streams

        def text(stream: list[str]) -> str:
            events = [json.loads(e[6:]) for e in stream if e.startswith("data: {")]
            assert not any("error" in e for e in events), events[-1:]
            assert stream[-1] == "data: [DONE]" or stream[-2] == "data: [DONE]"
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            return "".join(e["choices"][0]["text"] for e in events)

        undisturbed = [text(s) for s in run(kill=False)]
        disturbed = [text(s) for s in run(kill=True)]
        assert disturbed == undisturbed
        samples = parse_metrics(httpx.get(cluster.url + "/metrics").text)
        moved = sum(v for name, _, v in samples if name == "pdserve:request_migrations_total")
        assert 1 <= moved <= 8
        # new requests go to the survivor
        r = client(cluster).completions.create(
            model=model, prompt="Hello", max_tokens=5, temperature=0
        )
        assert r.usage.completion_tokens >= 1


BAD_BODIES = [
    ({}, 400),  # no prompt
    ({"model": "nope", "prompt": "x"}, 404),
    ({"prompt": "x", "max_tokens": -1}, 400),
    ({"prompt": 5}, 400),
    ({"prompt": "x", "temperature": "hot"}, 400),
    ({"prompt": "word " * 5000}, 400),  # longer than the context
]


def test_bad_requests_get_openai_errors(chat_model_dir, colocated):
    model, cluster = str(chat_model_dir), colocated
    for body, status in BAD_BODIES:
        r = httpx.post(cluster.url + "/v1/completions", json={"model": model, **body}, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert {"message", "type", "param", "code"} <= set(r.json()["error"])
    r = httpx.post(
        cluster.url + "/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in json.loads(r.text)
    # the server still answers after all that
    ok = client(cluster).completions.create(model=model, prompt="Hi", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_hung_prefill_worker_requests_move_to_another(chat_model_dir, reference, tmp_path):
    model = str(chat_model_dir)
    chat_ref, _, _ = reference
    with Cluster(
        model, tmp_path, prefill=2, decode=1, router_flags=("--local-prefill-max-tokens", "0")
    ) as cluster:
        cluster.procs["prefill-0"].send_signal(signal.SIGSTOP)  # hangs: no heartbeats, no work
        try:

            async def run() -> list[str]:
                c = openai.AsyncOpenAI(
                    base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=60
                )
                rs = await asyncio.gather(
                    *(
                        c.chat.completions.create(
                            model=model,
                            messages=[{"role": "user", "content": QUESTIONS[i % 3]}],
                            max_tokens=MAX_TOKENS,
                            temperature=0,
                        )
                        for i in range(6)
                    )
                )
                return [r.choices[0].message.content for r in rs]

            started = time.monotonic()
            texts = asyncio.run(run())
            assert texts == [chat_ref[i % 3][0] for i in range(6)]
            assert time.monotonic() - started < 30
        finally:
            cluster.kill("prefill-0")
        state = cluster.wait_blocks_free(["prefill-1", "decode-0"])
        assert all(f == t for f, t in state.values()), state


def test_workers_reregister_after_router_restart(chat_model_dir, one_p_one_d):
    model, cluster = str(chat_model_dir), one_p_one_d
    cluster.kill("router")
    cluster.start_router()
    cluster.wait_workers(1, 1, timeout_s=30)
    r = client(cluster).completions.create(
        model=model, prompt="Hello there", max_tokens=5, temperature=0
    )
    assert r.usage.completion_tokens == 5
    state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
    assert all(f == t for f, t in state.values()), state


def test_abort_before_prefill_frees_blocks_on_both_workers(chat_model_dir, one_p_one_d):
    model, cluster = str(chat_model_dir), one_p_one_d
    prefill = cluster.procs["prefill-0"]
    prefill.send_signal(signal.SIGSTOP)  # the prompt waits in its queue
    try:
        body = {
            "model": model,
            "prompt": "Tell me about the sea",
            "max_tokens": 50,
            "temperature": 0,
            "stream": True,
        }
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream(
                "POST",
                cluster.url + "/v1/completions",
                json=body,
                timeout=httpx.Timeout(30, read=1.0),
            ) as r:
                for _ in r.iter_lines():
                    pass
        # the client is gone: the decode worker's reservation must be released already
        state = cluster.wait_blocks_free(["decode-0"])
        assert all(f == t for f, t in state.values()), state
    finally:
        prefill.send_signal(signal.SIGCONT)
    # the prefill worker then finds the Abort behind the Prefill and frees what it took
    cluster.wait_workers(1, 1, timeout_s=30)
    state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
    assert all(f == t for f, t in state.values()), state
    r = client(cluster).completions.create(model=model, prompt="Hi", max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_scale_out_and_drain_without_losing_requests(chat_model_dir, one_p_one_d):
    """What scripts/scale.sh does to compose, with processes: add workers, then remove one."""
    model, cluster = str(chat_model_dir), one_p_one_d
    cluster.start_worker("decode", "decode-1")
    cluster.start_worker("prefill", "prefill-1")
    cluster.wait_workers(2, 2, timeout_s=60)

    def queries(worker: str) -> float:
        return cluster.worker_gauge("prefix_cache_queries_total", worker) or 0.0

    async def burst(n: int, max_tokens: int) -> list[int]:
        c = openai.AsyncOpenAI(
            base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120
        )
        rs = await asyncio.gather(
            *(
                c.completions.create(
                    model=model,
                    prompt=f"Request number {i} says",
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(n)
            )
        )
        return [r.usage.completion_tokens for r in rs]

    workers = ("decode-0", "decode-1", "prefill-0", "prefill-1")
    before = {w: queries(w) for w in workers}  # the earlier tests on this cluster count too
    assert asyncio.run(burst(8, 8)) == [8] * 8
    time.sleep(1.5)  # next heartbeat carries the counters
    assert all(queries(w) > before[w] for w in workers), (before, {w: queries(w) for w in workers})

    # remove a decode worker while requests run on it: it drains, nothing is lost
    results: list[list[int]] = []
    runner = threading.Thread(target=lambda: results.append(asyncio.run(burst(8, 400))))
    runner.start()
    time.sleep(1.0)
    cluster.procs["decode-1"].send_signal(signal.SIGTERM)
    runner.join(120)
    assert results == [[400] * 8]
    assert cluster.procs["decode-1"].wait(timeout=30) == 0  # exits by itself once drained
    assert asyncio.run(burst(4, 4)) == [4] * 4  # the rest keep serving


def test_1p1d_with_ngram_speculation_matches_plain_decoding(tmp_path):
    """The decode worker drafts with prompt lookup on KV it received; output is unchanged.

    A near-uniform random model (small initial weights) repeats itself, so prompt lookup finds
    drafts; the reference is the in-process engine without speculation.
    """
    tokenizer = Tokenizer.from_source(resolve_model("default"))
    model_dir = build_tiny_chat_model(tmp_path / "repeating-llama", seed=1, initializer_range=0.02)
    model = str(model_dir)
    prompts = [tokenizer.encode(t) for t in [*COMPLETIONS, *QUESTIONS]]
    engine = Engine(EngineConfig(model=model, dtype="float32", kv_cache_memory="64MiB"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [tokenizer.decode(s.output_token_ids) for s in engine.generate(prompts, params)]
    flags = ("--speculative", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1")
    with Cluster(
        model, tmp_path, prefill=1, decode=1, engine_flags=flags,
        router_flags=("--local-prefill-max-tokens", "0"),
    ) as cluster:  # fmt: skip
        c = client(cluster)
        for prompt, text in zip(prompts, expected):
            r = c.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == text
        deadline = time.monotonic() + 5  # counters travel with the next heartbeat
        while not (cluster.worker_gauge("spec_decode_num_drafts_total", "decode-0") or 0) > 0:
            assert time.monotonic() < deadline, cluster.metrics()
            time.sleep(0.2)
        assert (cluster.worker_gauge("spec_decode_num_accepted_tokens_total", "decode-0") or 0) > 0
        state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
        assert all(f == t for f, t in state.values()), state


def test_1p1d_int4_weights_match_the_engine(chat_model_dir, tmp_path):
    """Both workers quantize the 16-bit checkpoint to int4 on load; the KV they exchange comes
    from the quantized model, and the output equals the in-process engine's with the same flag.
    Float activations: int8 ones (the default, from 2 tokens a step) would round the engine's
    batched steps and the cluster's one-request steps differently."""
    model = str(chat_model_dir)
    tokenizer = Tokenizer.from_source(resolve_model(model))
    prompts = [tokenizer.encode(t) for t in COMPLETIONS]
    config = EngineConfig(
        model=model, dtype="float32", kv_cache_memory="64MiB", quantization="int4",
        cpu_activations="float",
    )  # fmt: skip
    engine = Engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [tokenizer.decode(s.output_token_ids) for s in engine.generate(prompts, params)]
    with Cluster(
        model, tmp_path, prefill=1, decode=1,
        engine_flags=("--quantization", "int4", "--cpu-activations", "float"),
        router_flags=("--local-prefill-max-tokens", "0"),
    ) as cluster:  # fmt: skip
        c = client(cluster)
        for prompt, text in zip(prompts, expected):
            r = c.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == text
        assert (cluster.wait_counter("kv_transfer_bytes_total", 1, worker="prefill-0")) > 0
        state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
        assert all(f == t for f, t in state.values()), state
