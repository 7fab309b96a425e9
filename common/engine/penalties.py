"""Repetition, presence and frequency penalties, and the per-sequence token history they read.

`TokenHistory` is kept per sequence by the engine (only for requests with penalties) and brought up
to date with each step's new tokens; `apply_penalties` is the sampler's penalty pass over a batch.
Semantics as HF and vLLM: repetition divides positive logits and multiplies negative ones, once per
distinct token of prompt and output; presence subtracts once per distinct output token; frequency
once per occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from common.engine.sampler import SamplingState


class TokenHistory:
    """A sequence's tokens as penalties read them, brought up to date one token at a time.

    Distinct tokens of prompt and output (repetition penalty), distinct output tokens with their
    counts (presence and frequency penalties), in numpy arrays that grow by doubling: a step adds
    its new tokens in O(new tokens), and the penalty pass reads the arrays without a Python loop.
    """

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0  # output tokens folded in so far
        prompt = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        self._seen_set = set(prompt.tolist())
        self._seen = prompt
        self._num_seen = len(prompt)
        self._out_slot: dict[int, int] = {}  # output token -> its index in _out_ids/_out_counts
        self._out_ids = np.empty(8, dtype=np.int64)
        self._out_counts = np.empty(8, dtype=np.float32)

    def sync(self, token_ids: list[int]) -> None:
        """Fold in the tokens of `token_ids` (prompt then output) not seen yet."""
        self.extend(token_ids[self.num_prompt_tokens + self.num_output_tokens :])

    def extend(self, output_token_ids: Sequence[int]) -> None:
        for token in output_token_ids:
            if token not in self._seen_set:
                self._seen_set.add(token)
                self._seen = _append(self._seen, self._num_seen, token)
                self._num_seen += 1
            slot = self._out_slot.get(token)
            if slot is None:
                slot = self._out_slot[token] = len(self._out_slot)
                self._out_ids = _append(self._out_ids, slot, token)
                self._out_counts = _append(self._out_counts, slot, 0)
            self._out_counts[slot] += 1
        self.num_output_tokens += len(output_token_ids)

    @property
    def seen_ids(self) -> np.ndarray:
        """Distinct tokens of the prompt and the output."""
        return self._seen[: self._num_seen]

    @property
    def output_ids(self) -> np.ndarray:
        """Distinct output tokens (in order of first occurrence)."""
        return self._out_ids[: len(self._out_slot)]

    @property
    def output_counts(self) -> np.ndarray:
        """How often each of `output_ids` occurs (float32)."""
        return self._out_counts[: len(self._out_slot)]


def _append(buf: np.ndarray, n: int, value: float) -> np.ndarray:
    """buf[n] = value, growing buf (doubling) when full; returns the (maybe new) array."""
    if n == len(buf):
        buf = np.concatenate([buf, np.empty(max(len(buf), 8), dtype=buf.dtype)])
    buf[n] = value
    return buf


def apply_penalties(x: torch.Tensor, states: list[SamplingState]) -> None:
    """In place on x [B, V] (contiguous float32), touching only tokens that occurred."""
    flat = x.view(-1)
    rep = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep:
        # Positive logits divided, negative multiplied, once per distinct seen token (HF, vLLM).
        keys, lens = _flat_keys(x, rep, [states[i].seen_ids() for i in rep])
        penalty = _per_token([states[i].params.repetition_penalty for i in rep], lens, x)
        vals = flat[keys]
        # A token listed twice writes the same value twice, so the scatter is deterministic.
        flat[keys] = torch.where(vals > 0, vals / penalty, vals * penalty)

    add = [
        i
        for i, s in enumerate(states)
        if (s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0)
        and s.num_output_tokens
    ]
    if add:
        ids, counts = zip(*(states[i].output_counts() for i in add))
        keys, lens = _flat_keys(x, add, list(ids))
        presence = [states[i].params.presence_penalty for i in add]
        frequency = [states[i].params.frequency_penalty for i in add]
        if any(presence):  # once per distinct token, by the same write-same-value scatter
            flat[keys] = flat[keys] - _per_token(presence, lens, x)
        if any(frequency):  # once per occurrence
            weights = np.repeat(np.asarray(frequency, dtype=np.float32), lens) * np.concatenate(
                counts
            )
            flat.index_add_(0, keys, torch.from_numpy(weights).to(x.device), alpha=-1.0)


def _flat_keys(
    x: torch.Tensor, rows: list[int], ids: list[np.ndarray]
) -> tuple[torch.Tensor, np.ndarray]:
    """Flat indices row * V + token into x for every token of ids[j] (belonging to rows[j])."""
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    keys = np.repeat(np.asarray(rows, dtype=np.int64) * x.shape[1], lens) + tokens
    return torch.from_numpy(keys).to(x.device), lens


def _per_token(values: list[float], lens: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Each row's value repeated for each of its tokens, as float32 on like's device."""
    return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.float32), lens)).to(like.device)
