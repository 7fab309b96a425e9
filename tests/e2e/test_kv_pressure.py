"""The decode worker out of KV blocks in PD mode, as reported: 1 prefill + 1 decode worker with
182 KV blocks and a 2048-token context, 8 concurrent ~700-word completions of 256 greedy tokens.
Before the fix the decode worker sat at 0 running / 5 waiting until the request timeout. Every
request must finish, each with the text it gets alone, and every block must come back.
"""

from __future__ import annotations

import asyncio
import random

import openai

from tests.e2e.cluster import Cluster

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block tokens * KV heads * dims * f32
WORDS = (
    "river stone light garden window paper engine cloud number silver market forest signal "
    "winter candle harbor letter mirror thunder village orbit lantern copper meadow"
).split()
# the random-weight model may sample its end-of-text early: the report's outputs ran to 256
PARAMS = dict(max_tokens=256, temperature=0, extra_body={"ignore_eos": True})


def long_prompt(seed: int, num_words: int = 700) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def test_eight_long_requests_on_a_small_decode_cache_all_finish(chat_model_dir, tmp_path):
    model = str(chat_model_dir)
    flags = ("--kv-cache-memory", str(182 * BLOCK_BYTES), "--max-model-len", "2048")
    prompts = [long_prompt(seed) for seed in range(8)]
    with Cluster(model, tmp_path, prefill=1, decode=1, engine_flags=flags) as cluster:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)

        async def one(c: openai.AsyncOpenAI, prompt: str):
            r = await c.completions.create(model=model, prompt=prompt, **PARAMS)
            return r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens

        async def all_at_once() -> list[tuple[str, int, int]]:
            c = openai.AsyncOpenAI(
                base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=240
            )
            return await asyncio.gather(*(one(c, p) for p in prompts))

        together = asyncio.run(all_at_once())
        # long enough to go to the prefill worker; the whole output
        assert all(n > 256 and m == 256 for _, n, m in together), together
        alone = [
            client.completions.create(model=model, prompt=p, **PARAMS).choices[0].text
            for p in prompts
        ]
        assert [text for text, _, _ in together] == alone
        state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
        assert all(f == t for f, t in state.values()), state
        assert (cluster.worker_gauge("kv_transfer_bytes_total", "prefill-0") or 0) > 0
