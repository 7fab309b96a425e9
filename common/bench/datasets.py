"""Benchmark datasets: the requests a run sends, built reproducibly from a seed.

`random` (token ids of exact lengths), `shared-prefix` (tenants with long system prompts and
short questions, interleaved), `repetitive` (prompts whose answer copies them, for speculative
decoding) and a JSONL file (`prompt` or `messages`, optional `max_tokens`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Common English words: nearly each is one token with its leading space in BPE vocabularies.
WORDS = (
    "the of and to in is was for on are with as at be this from by have or an they which one you "
    "had not but what all were when we there can more if no out so said up its about into than "
    "them only other new some time could these two may first then do any like my now over such "
    "our man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three"
).split()


@dataclass
class BenchRequest:
    """One request to send: a completion `prompt` (text or token ids) or chat `messages`."""

    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    ignore_eos: bool = True

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body

    @property
    def path(self) -> str:
        return "/chat/completions" if self.messages is not None else "/completions"


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def random_dataset(n: int, prompt_tokens: int, output_tokens: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    # Ids well inside any modern vocabulary, past the special tokens at the start.
    return [
        BenchRequest(
            output_tokens, prompt=[rng.randrange(1000, 20000) for _ in range(prompt_tokens)]
        )
        for _ in range(n)
    ]


def shared_prefix_dataset(
    n: int,
    tenants: int,
    system_prompt_tokens: int,
    question_tokens: int,
    output_tokens: int,
    seed: int,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    systems = [
        f"You are the assistant of tenant {t}. " + _text(rng, system_prompt_tokens)
        for t in range(tenants)
    ]
    # Tenants in random order (each at least once when n allows): a fixed cycle would line up
    # with round-robin routing and hand every tenant to the same worker by accident.
    order = [i % tenants for i in range(n)]
    rng.shuffle(order)
    return [
        BenchRequest(
            output_tokens,
            messages=[
                {"role": "system", "content": systems[tenant]},
                {"role": "user", "content": _text(rng, question_tokens) + "?"},
            ],
        )
        for tenant in order
    ]


def repetitive_dataset(
    n: int, prompt_tokens: int, output_tokens: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            output_tokens,
            prompt=f"Repeat the following text exactly:\n\n{_text(rng, prompt_tokens)}\n\n",
        )
        for _ in range(n)
    ]


def file_dataset(path: Path, n: int | None, output_tokens: int) -> list[BenchRequest]:
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        max_tokens = int(row.get("max_tokens", output_tokens))
        if "messages" in row:
            requests.append(BenchRequest(max_tokens, messages=row["messages"], ignore_eos=False))
        elif "prompt" in row:
            requests.append(BenchRequest(max_tokens, prompt=row["prompt"], ignore_eos=False))
        else:
            raise ValueError(f"{path}:{lineno}: a line needs 'prompt' or 'messages'")
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests if n is None else [requests[i % len(requests)] for i in range(n)]


def build_dataset(
    name: str,
    n: int,
    *,
    prompt_tokens: int,
    output_tokens: int,
    tenants: int,
    system_prompt_tokens: int,
    question_tokens: int,
    seed: int,
) -> list[BenchRequest]:
    """`n` requests of dataset `name` (a kind, or a path to a JSONL file)."""
    if name == "random":
        return random_dataset(n, prompt_tokens, output_tokens, seed)
    if name == "shared-prefix":
        return shared_prefix_dataset(
            n, tenants, system_prompt_tokens, question_tokens, output_tokens, seed
        )
    if name == "repetitive":
        return repetitive_dataset(n, prompt_tokens, output_tokens, seed)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"unknown dataset {name!r}: not a kind nor a JSONL file")
    return file_dataset(path, n, output_tokens)
