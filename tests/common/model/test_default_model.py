"""The real default model (SmolLM2-135M-Instruct GGUF) end to end, against HF transformers.

In float32 with greedy sampling, pdserve's engine (one batch of chat and completion prompts) and
`pdserve run-batch` must produce exactly the tokens of transformers' own GGUF loader + `generate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.api.tokenizer import Tokenizer
from common.cli import main
from common.config import EngineConfig
from common.engine.engine import Engine
from common.model.model_files import ModelSource, resolve_model
from common.model.weights import iter_weights
from common.sampling_params import SamplingParams

MAX_NEW_TOKENS = 32
# Small KV cache and context, one thread: the tests need little, and the 2-core machine is shared
# (two torch threads against a busy neighbour run several times slower than one).
# quantization none: the comparison is with transformers' dequantized model (native Q4_1 is
# compared in test_quant.py).
ENGINE_FLAGS = {
    "kv_cache_memory": "128MiB",
    "max_model_len": 2048,
    "num_threads": 1,
    "quantization": "none",
}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "List three fruits."},
    ],
    [{"role": "user", "content": "Explain what a hash table is to a beginner programmer."}],
]
COMPLETIONS = [
    "The three primary colors are",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who",
    "Q: What is 12 times 12?\nA:",
    "The following is a list of the largest cities in Europe by population, with a short note on "
    "each one's history and culture:\n1.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model("default")


@pytest.fixture(scope="module")
def tok(source: ModelSource) -> Tokenizer:
    return Tokenizer.from_source(source)


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    """Chat prompts through the chat template, then completion prompts."""
    chat = [tok.apply_chat_template(m) for m in CHATS]
    completion = [tok.encode(p) for p in COMPLETIONS]
    lengths = [len(p) for p in chat + completion]
    assert min(lengths) < 16 < max(lengths) and sum(n > 32 for n in lengths) >= 3
    return chat + completion


@pytest.fixture(scope="module")
def reference(
    hf_default_model: torch.nn.Module, tok: Tokenizer, prompts: list[list[int]]
) -> list[list[int]]:
    """transformers' greedy output ids for each prompt (eos included when it stops there)."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf_default_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(tok.eos_token_ids),
                pad_token_id=2,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_engine_batch_matches_transformers_greedy(
    source: ModelSource, tok: Tokenizer, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    config = EngineConfig(model="default", dtype="float32", **ENGINE_FLAGS)
    engine = Engine(config, source.hf_config, iter_weights(source), eos_token_ids=tok.eos_token_ids)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    for i, (seq, expected) in enumerate(zip(seqs, reference)):
        assert seq.output_token_ids == expected, f"prompt {i}"
        stopped = expected[-1] in tok.eos_token_ids
        assert seq.finish_reason == ("stop" if stopped else "length")
    assert any(len(r) == MAX_NEW_TOKENS for r in reference)  # some run to the length limit
    assert engine.pool.num_free == engine.pool.num_blocks


def test_run_batch_cli_matches_transformers(
    tmp_path: Path, tok: Tokenizer, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    common = {"model": "default", "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
    requests = [
        ("chat", "/v1/chat/completions", {**common, "messages": CHATS[0]}),
        ("text", "/v1/completions", {**common, "prompt": COMPLETIONS[2]}),
        ("bad", "/v1/completions", {**common, "prompt": "x", "max_tokens": "many"}),
        ("ids", "/v1/completions", {**common, "prompt": prompts[len(CHATS) + 4]}),
    ]
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text(
        "".join(
            json.dumps({"custom_id": c, "method": "POST", "url": u, "body": b}) + "\n"
            for c, u, b in requests
        )
    )
    argv = ["run-batch", "-i", str(infile), "-o", str(outfile), "--dtype", "float32"]
    argv += ["--kv-cache-memory", ENGINE_FLAGS["kv_cache_memory"]]
    argv += ["--max-model-len", str(ENGINE_FLAGS["max_model_len"]), "--num-threads", "1"]
    argv += ["--quantization", "none"]
    assert main(argv) == 0
    results = [json.loads(line) for line in outfile.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat", "text", "bad", "ids"]
    assert [r["response"]["status_code"] for r in results] == [200, 200, 400, 200]
    assert results[2]["response"]["body"]["error"]["param"] == "max_tokens"

    for result, prompt_index in zip([results[0], results[1], results[3]], [0, 7, 9]):
        body = result["response"]["body"]
        expected = reference[prompt_index]
        (choice,) = body["choices"]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == tok.decode(expected), result["custom_id"]
        assert choice["finish_reason"] == (
            "stop" if expected[-1] in tok.eos_token_ids else "length"
        )
        num_prompt = len(prompts[prompt_index])
        assert body["usage"] == {
            "prompt_tokens": num_prompt,
            "completion_tokens": len(expected),
            "total_tokens": num_prompt + len(expected),
        }
        assert body["model"] == "default"
