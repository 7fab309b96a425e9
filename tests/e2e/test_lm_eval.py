"""lm_eval (EleutherAI's harness) scores a multiple-choice task through the router: colocated, 1P1D.

lm_eval's `local-completions` backend asks `/v1/completions` for `echo: true, logprobs: 1,
max_tokens: 1` over the token ids of context + choice and sums the choice tokens' logprobs: the
prompt logprobs this server computes where the prompt is computed (the decode worker colocated,
the prefill worker in 1P1D). The task's YAML and documents are written here; its per-choice
log-likelihoods (`log_samples`, `resps`) must equal transformers' on the same weights and the same
token ids. The choices of one question share its context, so later ones would hit the prefix cache
(KV blocks of 16 tokens; the contexts are longer) if such requests read it.

Tolerance: 1e-4 per scored token. Both sides run float32; over the tiny Llama's 49152-token
vocabulary its logprobs are about -11, where float32 rounding differs by ~1e-6 per operation
between the fused, paged forward and HF's dense one (the engine test measured at most 1.1e-5 per
token); a wrong position or a cached-and-skipped one is off by far more.

One module-scoped cluster per mode; a handful of documents keep it to seconds per mode.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.e2e.cluster import Cluster

TASK = "pdserve_tiny_mc"
ATOL_PER_TOKEN = 1e-4
DOCS = [
    {
        "question": "A farmer keeps sheep, goats and two old horses on a hill above the river. "
        "Which animal gives the farmer wool every spring?",
        "choices": ["the sheep", "the horses", "the river"],
        "answer": 0,
    },
    {
        "question": "The train left the station at nine in the morning and arrived four hours "
        "later, just in time for lunch. At what time did it arrive?",
        "choices": ["at one o'clock", "at nine", "at midnight", "never"],
        "answer": 0,
    },
    {
        "question": "Water that is cooled below zero degrees Celsius at normal pressure turns "
        "into something solid. What does it become?",
        "choices": ["ice", "steam"],
        "answer": 0,
    },
]
TASK_YAML = f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def hf_model(chat_model_dir):
    return AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["colocated", "1p1d"])
def cluster(request, chat_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"lm-eval-{request.param}")
    if request.param == "colocated":
        spec = dict(prefill=0, decode=1)
    else:  # every prompt prefilled on the prefill worker
        spec = dict(prefill=1, decode=1, router_flags=("--local-prefill-max-tokens", "0"))
    with Cluster(str(chat_model_dir), tmp, **spec) as c:
        c.mode = request.param
        yield c


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm-eval-task")
    data = path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (path / f"{TASK}.yaml").write_text(TASK_YAML.replace("{data}", str(data)))
    return path


def hf_token_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: log p(ids[j] | ids[:j]) for j >= 1, from transformers in float32."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_lm_eval_loglikelihoods_match_transformers(
    cluster, hf_model, task_dir, chat_model_dir, monkeypatch, tmp_path
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(
        base_url=cluster.url + "/v1/completions",
        tokenizer=str(chat_model_dir),
        tokenizer_backend="huggingface",
        max_retries=1,
        timeout=120,
    )
    results = simple_evaluate(
        model=lm,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = results["samples"][TASK]
    assert len(samples) == len(DOCS)
    checked = 0
    for sample in samples:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            loglikelihood, _ = resp[0]
            context_ids, choice_ids = lm._encode_pair(context, continuation)
            ids = context_ids + choice_ids
            expected = hf_token_logprobs(hf_model, ids)[len(context_ids) - 1 :].sum().item()
            tolerance = ATOL_PER_TOKEN * len(choice_ids)
            assert loglikelihood == pytest.approx(expected, abs=tolerance), (cluster.mode, ids)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    assert "acc,none" in results["results"][TASK]


def test_prompt_logprobs_and_streamed_echo_match_transformers(cluster, hf_model):
    """vLLM's prompt_logprobs on chat, twice (the second could hit the prefix cache), and a
    streamed echo whose first chunk carries the prompt's logprobs."""
    messages = [{"role": "user", "content": DOCS[0]["question"] + " " + DOCS[1]["question"]}]
    tokenize = httpx.post(cluster.url + "/tokenize", json={"messages": messages}, timeout=30)
    ids = tokenize.json()["tokens"]
    expected = hf_token_logprobs(hf_model, ids).tolist()
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 2}
    for _ in range(2):
        r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for j, entry in enumerate(got[1:]):
            own = entry[str(ids[j + 1])]
            assert own["logprob"] == pytest.approx(expected[j], abs=ATOL_PER_TOKEN)
            assert len(entry) in (2, 3)  # the token and its 2 best (it may be one of them)
    stream = {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=stream, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    first = json.loads(events[0])["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert first["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=ATOL_PER_TOKEN)
    # 1P1D: the prompts were prefilled (and scored) on the prefill worker, whose KV moved
    workers = ["decode-0"]
    if cluster.mode == "1p1d":
        workers.append("prefill-0")
        deadline = time.monotonic() + 5  # counters travel with the next heartbeat
        while not (cluster.worker_gauge("kv_transfer_bytes_total", "prefill-0") or 0) > 0:
            assert time.monotonic() < deadline, cluster.metrics()
            time.sleep(0.2)
    books = cluster.wait_blocks_free(workers)
    assert all(free == total for free, total in books.values()), books
