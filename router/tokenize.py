"""`POST /tokenize` and `POST /detokenize` (vLLM's), and the model-name check every endpoint
naming a model makes.

Tokenizing and detokenizing run on the router's small thread pool (`RouterState.offload`), never
on the event loop; a prompt too long by its character count alone is refused first. Called by
`router.app`'s routes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from common.api.body import check_prompt_chars
from common.api.prompts import chat_prompt_ids
from common.api.requests import CHAT_URL, RequestError, parse_request
from common.api.tokenizer import Tokenizer
from router.generate import json_body, prompt_texts

if TYPE_CHECKING:
    from router.app import RouterState


async def tokenize_body(state: RouterState, request: Request) -> Response:
    """The prompt (or chat messages, templated) as token ids, with the count and context."""
    body = await json_body(state, request.receive)
    check_model(state, body)
    if "messages" in body:
        chat = {**body, "max_tokens": 1}
        gen = parse_request(CHAT_URL, chat, state.served_model_names, state.tool_format())
        check_prompt_chars(prompt_texts(gen), state.context_len(), "messages")
        ids = await state.offload(chat_prompt_ids, gen, state.tokenizer)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (or send messages)", "prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise RequestError("add_special_tokens must be a boolean", "add_special_tokens")
        check_prompt_chars([prompt], state.context_len(), "prompt")
        ids = await state.offload(state.tokenizer.encode, prompt, add_special)
    result = {"count": len(ids), "max_model_len": state.context_len(), "tokens": ids}
    return Response(await state.offload(_json_bytes, result), media_type="application/json")


async def detokenize_body(state: RouterState, request: Request) -> dict[str, Any]:
    """Token ids as text (special tokens included)."""
    body = await json_body(state, request.receive)
    check_model(state, body)
    return {"prompt": await state.offload(_detokenize, state.tokenizer, body.get("tokens"))}


def check_model(state: RouterState, body: dict) -> None:
    """A 404 error body unless the request names a served model (or none)."""
    model = body.get("model")
    if model is not None and model not in state.served_model_names:
        raise RequestError(
            f"The model `{model}` does not exist.", "model", code=404, type="model_not_found"
        )


def _detokenize(tokenizer: Tokenizer, ids: Any) -> str:
    vocab = tokenizer.vocab_size
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise RequestError(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return tokenizer.decode(ids, skip_special_tokens=False)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
