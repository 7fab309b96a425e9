"""Prompt log-probabilities: how likely the model found each prompt token given those before it.

What vLLM's `prompt_logprobs` and the completions API's `echo` with `logprobs` report, and what
lm_eval's multiple-choice scoring needs. Owns, for a sequence whose params ask for them
(`SamplingParams.prompt_logprobs`, the number of best alternatives to keep):
- which tokens a scheduled prefill chunk scores (`chunk_targets`): position j's logits predict
  prompt token j+1, so a chunk [start, end) scores tokens start+1 .. end, except that the prompt's
  last position predicts the first output token (that one is sampled, not scored);
- the scoring itself (`score`): the LM head over the chunk's final hidden states in slices of
  `SCORE_SLICE_TOKENS` positions (a [slice, vocab] float32 block at a time, never the whole
  chunk's logits), log_softmax in float32, the prompt token's logprob, its rank and the top-n.

The engine runs each step through `run_and_score`: a step with nothing to score is the runner's
plain `run`; otherwise one `ModelRunner.run_with_hidden` forward gives the sampled rows' logits and
the scored rows' hidden states, whose scores extend `SequenceState.prompt_logprobs` chunk by chunk.
The engine hands the list out with the sequence's first output token. Entry i is prompt
token i+1's; token 0 has no context (the API reports null there). A prefill worker sends the list
to the decode worker in the KV handoff (`common.protocol.KVHeader.prompt_logprobs`).

Prefix-cache hits would skip positions whose logits are then never computed. Recomputing only the
skipped part would still need a forward over it (logits cannot be had from cached KV), so such a
sequence simply does not read the prefix cache until its prompt is scored
(`SequenceState.reads_prefix_cache`, checked by the scheduler), as vLLM v1 does; it still writes its
blocks there for other requests. On a decode worker in 1P1D, `Engine.reserve` still reuses the
blocks it holds: the prefill worker computes and scores the whole prompt anyway, and the reuse only
saves sending those blocks. The router's prefix-aware routing is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.sampling_params import MAX_PROMPT_LOGPROB_TOKENS

if TYPE_CHECKING:
    from common.engine.scheduler import ScheduledSeq
    from common.engine.sequence import SequenceState
    from common.kernels.attention import Row
    from common.model.model_runner import ModelRunner

# (logprob of the prompt token, its rank (1 = the model's first choice), best alternatives as
# (token id, logprob), best first)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]

SCORE_SLICE_TOKENS = 256  # positions whose logits exist at once: [256, vocab] float32


def chunk_targets(
    token_ids: list[int], num_prompt_tokens: int, start: int, num_new_tokens: int
) -> list[int]:
    """The prompt tokens that the positions [start, start + num_new_tokens) predict, in order."""
    end = min(start + num_new_tokens, num_prompt_tokens - 1)
    return token_ids[start + 1 : end + 1]


@torch.inference_mode()
def score(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    num_top: int,
) -> list[PromptLogprob]:
    """Score `targets[i]` under the logits of `hidden[i]` (final hidden states, one per target).

    Rank counts the tokens at least as likely as the target (vLLM's definition: ties rank it
    behind them). float32 throughout, whatever the model's dtype.
    """
    out: list[PromptLogprob] = []
    for s in range(0, len(targets), SCORE_SLICE_TOKENS):
        part = targets[s : s + SCORE_SLICE_TOKENS]
        logprobs = compute_logits(hidden[s : s + len(part)]).float().log_softmax(dim=-1)
        ids = torch.tensor(part, device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, ids)
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()
        chosen_list = chosen.squeeze(1).tolist()
        if num_top > 0:
            best = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
            best_ids, best_lps = best.indices.tolist(), best.values.tolist()
            tops = [list(zip(i, v)) for i, v in zip(best_ids, best_lps)]
        else:
            tops = [[] for _ in part]
        out.extend(zip(chosen_list, ranks, tops))
    return out


def check_prompt_length(num_prompt_tokens: int) -> None:
    """ValueError for a prompt too long to have its logprobs returned (they travel in bounded
    messages: common.protocol.MAX_KV_HEADER_BYTES)."""
    if num_prompt_tokens > MAX_PROMPT_LOGPROB_TOKENS:
        raise ValueError(
            f"prompt logprobs are returned for prompts of at most {MAX_PROMPT_LOGPROB_TOKENS} "
            f"tokens; this one has {num_prompt_tokens}"
        )


def adopt_prompt_logprobs(seq: SequenceState, received: list[PromptLogprob] | None) -> None:
    """Take the scores a prefill worker computed for `seq`'s prompt (when it asked for them);
    ValueError, changing nothing, when they do not cover the prompt."""
    if seq.params.prompt_logprobs is None:
        return
    if received is None or len(received) != seq.num_prompt_tokens - 1:
        raise ValueError("the prefill worker sent no or partial prompt logprobs")
    seq.prompt_logprobs = list(received)


def run_and_score(
    runner: ModelRunner, batch: list[ScheduledSeq], rows: list[Row], num_logits: list[int]
) -> torch.Tensor | None:
    """`runner.run(rows, num_logits)`, scoring on the way the prompt chunks of the batch's
    sequences that want prompt logprobs (`rows[i]` is `batch[i]`'s chunk)."""
    scored: dict[int, list[int]] = {}  # row -> the prompt tokens its positions predict
    for i, item in enumerate(batch):
        seq = item.seq
        if seq.scores_prompt:
            start = seq.num_computed_tokens
            del seq.prompt_logprobs[start:]  # a preempted prompt is scored again from 0
            num_new = item.num_new_tokens
            targets = chunk_targets(seq.token_ids, seq.num_prompt_tokens, start, num_new)
            if targets:
                scored[i] = targets
    if not scored:
        return runner.run(rows, num_logits)
    logits, hidden = runner.run_with_hidden(rows, num_logits, list(scored))
    for (i, targets), h in zip(scored.items(), hidden):
        seq = batch[i].seq
        seq.prompt_logprobs += score(runner.compute_logits, h, targets, seq.params.prompt_logprobs)
    return logits
