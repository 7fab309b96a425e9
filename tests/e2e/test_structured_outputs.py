"""Structured outputs through a real router in 1P1D mode: every prompt is prefilled on the prefill
worker (`--local-prefill-max-tokens 0`), so the first token of each answer is sampled there under
the grammar and the decode worker continues the matcher from it. The model is the e2e tiny random
model, whose free output is never JSON; the constrained output always validates, streamed or not,
and the OpenAI SDK's `beta.chat.completions.parse` returns a parsed pydantic object.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.cluster import Cluster


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool


# Without additionalProperties false a schema allows any extra key (JSON Schema's rule, which the
# grammar keeps), and a random model would write one until max_tokens.
PET_SCHEMA = {**Pet.model_json_schema(), "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def cluster(chat_model_dir, tmp_path_factory):
    flags = ("--local-prefill-max-tokens", "0")
    with Cluster(
        str(chat_model_dir), tmp_path_factory.mktemp("structured"), router_flags=flags
    ) as c:
        yield c


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


def test_sdk_parse_returns_a_pydantic_object(cluster: Cluster) -> None:
    c = client(cluster)
    model = str(cluster.model)
    free = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=30, seed=1)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    for seed in (1, 2):
        r = c.beta.chat.completions.parse(
            model=model, messages=MESSAGES, response_format=Pet, max_tokens=100, seed=seed
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
    # every prompt went through the prefill worker, which sampled the first token
    assert cluster.wait_counter("kv_transfer_bytes_total", 1, worker="prefill-0") > 0


def test_json_schema_validates_streamed_and_not(cluster: Cluster) -> None:
    c = client(cluster)
    model = str(cluster.model)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    r = c.chat.completions.create(
        model=model, messages=MESSAGES, response_format=fmt, max_tokens=100, n=3, temperature=1.0
    )
    texts = [choice.message.content for choice in r.choices]
    stream = c.chat.completions.create(
        model=model, messages=MESSAGES, response_format=fmt, max_tokens=100, seed=7, stream=True
    )
    texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    for text in texts:
        jsonschema.validate(json.loads(text), PET_SCHEMA)


def test_completions_regex_and_choice(cluster: Cluster) -> None:
    c = client(cluster)
    model = str(cluster.model)
    stream = c.completions.create(
        model=model,
        prompt="A date:",
        max_tokens=30,
        stream=True,
        extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", text), text
    r = c.completions.create(
        model=model,
        prompt="Pick one:",
        max_tokens=10,
        n=2,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert {choice.text for choice in r.choices} <= {"left", "right"}
    assert all(choice.finish_reason == "stop" for choice in r.choices)


def test_unsupported_schemas_are_400s_naming_the_feature(cluster: Cluster) -> None:
    url = cluster.url + "/v1/chat/completions"
    model = str(cluster.model)
    for fmt, named in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}, "if"),
        ({"type": "json_schema", "json_schema": {"schema": {"format": "nope"}}}, "nope"),
    ]:
        body = {"model": model, "messages": MESSAGES, "response_format": fmt}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert named in r.json()["error"]["message"]
    body = {"model": model, "messages": MESSAGES, "guided_regex": "(", "guided_choice": ["a"]}
    assert httpx.post(url, json=body, timeout=30).status_code == 400
