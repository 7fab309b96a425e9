"""The request mix of `benchmarks/soak.py`: what each client sends, and the counts it keeps.

`KINDS` weighs the kinds; `make_request` builds one (short and long prompts, chat and completions,
streamed and not, aborts, n=2, logprobs, stop strings); `one_request` sends it and counts the
outcome in `Stats`; `client_loop` is one client sending them back to back until a deadline.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = (
    "the a sea ship wind port sail blue storm calm night star map crew deck rope harbor tide "
    "island captain lantern anchor compass coast river mountain forest village market bread "
    "water stone bridge road letter story song garden winter summer morning evening"
).split()


@dataclass
class Stats:
    """Counts since the last window (reset by `take`) and over the whole run."""

    ok: int = 0
    aborted: int = 0
    failed: int = 0
    output_tokens: int = 0
    errors: Counter = field(default_factory=Counter)  # (kind, cause) over the whole run
    kinds: Counter = field(default_factory=Counter)  # kind -> requests over the whole run

    def take(self) -> tuple[int, int, int, int]:
        out = (self.ok, self.aborted, self.failed, self.output_tokens)
        self.ok = self.aborted = self.failed = self.output_tokens = 0
        return out


# ---- the request mix ---------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_request(kind: str, rng: random.Random, args: argparse.Namespace) -> tuple[str, dict]:
    """(path, body) of one request of `kind`; long prompts are random words, so each is new to
    the prefix cache (its blocks fill the cache and get evicted, as in real traffic)."""
    short = words(rng, rng.randint(5, 40))
    long = words(rng, args.long_words)
    max_tokens = rng.randint(args.max_tokens // 2, args.max_tokens)
    chat = {"max_tokens": max_tokens, "temperature": 0.8}
    if kind == "chat":
        return "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": short}]}
    if kind == "chat_stream":
        return "/v1/chat/completions", {
            **chat, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": short}],
        }  # fmt: skip
    if kind == "chat_long_stop":
        return "/v1/chat/completions", {
            **chat, "stream": True, "stream_options": {"include_usage": True},
            "stop": [".", "\n\n"], "messages": [{"role": "user", "content": long}],
        }  # fmt: skip
    if kind == "completion_logprobs":
        return "/v1/completions", {
            "prompt": short, "max_tokens": max_tokens, "logprobs": 3, "temperature": 1.0,
        }  # fmt: skip
    if kind == "completion_n2":
        return "/v1/completions", {
            "prompt": short, "max_tokens": max_tokens, "n": 2, "temperature": 1.0, "stop": ["!"],
        }  # fmt: skip
    if kind == "completion_long":
        return "/v1/completions", {
            "prompt": long, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
    if kind == "chat_schema":  # a new schema most times: both grammar caches keep turning over
        keys = list(dict.fromkeys(rng.choice(WORDS) for _ in range(rng.randint(1, 3))))
        types = [rng.choice(["string", "integer", "boolean"]) for _ in keys]
        schema = {
            "type": "object", "properties": {k: {"type": t} for k, t in zip(keys, types)},
            "required": keys, "additionalProperties": False,
        }  # fmt: skip
        return "/v1/chat/completions", {
            "max_tokens": 4 * args.max_tokens, "temperature": 0.8,
            "messages": [{"role": "user", "content": f"{short}: answer in JSON"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema}},
        }  # fmt: skip
    if kind == "abort":  # streamed, dropped after a few chunks
        return "/v1/completions", {
            "prompt": rng.choice([short, long]), "max_tokens": 4 * args.max_tokens,
            "ignore_eos": True, "stream": True,
        }  # fmt: skip
    raise ValueError(kind)


# kind -> weight in the mix
KINDS = {
    "chat": 2,
    "chat_stream": 3,
    "chat_long_stop": 1,
    "completion_logprobs": 2,
    "completion_n2": 1,
    "completion_long": 1,
    "chat_schema": 1,
    "abort": 1,
}


async def one_request(
    client: httpx.AsyncClient, kind: str, rng: random.Random, args: argparse.Namespace, stats: Stats
) -> None:
    path, body = make_request(kind, rng, args)
    stats.kinds[kind] += 1
    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            if r.status_code != 200:
                stats.failed += 1
                stats.errors[(kind, f"HTTP {r.status_code}")] += 1
                return
            answer = r.json()
            if kind == "chat_schema" and not _follows_schema(answer, body):
                stats.failed += 1
                stats.errors[(kind, "answer outside its schema")] += 1
                return
            stats.output_tokens += answer["usage"]["completion_tokens"]
            stats.ok += 1
            return
        drop_after = rng.randint(2, 6) if kind == "abort" else None
        chunks, usage = 0, None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats.failed += 1
                stats.errors[(kind, f"HTTP {r.status_code}")] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.failed += 1
                    stats.errors[(kind, "SSE error: " + str(chunk["error"])[:60])] += 1
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    break  # leaving the block closes the connection: the router aborts it
        if drop_after is not None:
            stats.aborted += 1
            stats.output_tokens += chunks
        else:
            stats.ok += 1
            stats.output_tokens += usage["completion_tokens"] if usage else chunks
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
        stats.failed += 1
        stats.errors[(kind, type(e).__name__)] += 1


def _follows_schema(answer: dict, body: dict) -> bool:
    """A finished (`stop`) structured answer is a JSON object of exactly the schema's keys, each
    of its type; one cut at max_tokens (`length`) is only a prefix, so it passes."""
    (choice,) = answer["choices"]
    if choice["finish_reason"] != "stop":
        return True
    schema = body["response_format"]["json_schema"]["schema"]
    try:
        value = json.loads(choice["message"]["content"])
    except ValueError:
        return False
    kinds = {"string": str, "integer": int, "boolean": bool}
    props = schema["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(props)
        and all(
            isinstance(value[k], kinds[p["type"]])
            and (p["type"] != "integer" or not isinstance(value[k], bool))
            for k, p in props.items()
        )
    )


async def client_loop(
    client: httpx.AsyncClient, seed: int, stop_at: float, args: argparse.Namespace, stats: Stats
) -> None:
    rng = random.Random(seed)
    names, weights = list(KINDS), list(KINDS.values())
    while time.monotonic() < stop_at:
        await one_request(client, rng.choices(names, weights)[0], rng, args, stats)
