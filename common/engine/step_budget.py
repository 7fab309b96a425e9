"""How many prefill tokens one step computes, from the step costs measured where the engine runs.

A step with `p` prompt tokens (prefill chunks and verify rows) costs about
`fixed + per_prefill_token * p` seconds, where the fixed part is everything else in it: the
weights read once, the kernels' launches, the Python around them, and the decode rows riding
along (their count changes slowly, with the running batch). `StepCosts` fits those two numbers to
the prompt steps the engine times (least squares over an exponentially fading window, so they
follow the machine and the batch as they change); decode-only steps tell nothing about prompt
tokens and are not fitted. `PrefillBudget` turns the fit into the chunk: the smallest `p` whose
cost per token, the step's fixed part included, is within `SLACK` of the per-token cost alone
(p >= fixed / (SLACK * per_prefill_token)).

The fit is linear, and steps are not always: the kernels change with the rows (an int8 GEMM
for a few, a dense one from 64 on), and a chunk after a long cached prefix spends most of its time
attending to it (26 tokens after 1,500: ~100 ms on one core). Such steps read as a large fixed
part, and the chunk came out at whole prompts: a 1,500-token prompt then held its worker for 1.3 s
in one step while short requests behind it waited (benchmarks/kv_cluster.py). So the chunk is
also held to `MAX_STEP_S` of prompt work at the prompt steps' measured seconds per prompt token
(all included, fading; steps of `RATIO_MIN_TOKENS` or more): what a short request or a running
sequence waits at most behind a long prompt, for one more fixed part per chunk. A process's
first `WARMUP_PROMPT_STEPS` prompt steps (one-time costs) are not counted at all.

Why a limit at all: a step that prefills many prompts at once finishes all of them together at
its end, and every running sequence waits for it; chunks of about this size finish prompts one
after another in arrival order (the mean time to first token drops, by up to half under a burst)
and keep the decode steps between them short, for at most `SLACK` more time per prompt token.
Bigger chunks would not compute faster (that is what the fit says); smaller ones would spend more
than `SLACK` on the fixed part. Until prompt steps of varied sizes tell the fixed part from the
per-token part only the `MAX_STEP_S` rule holds (once `RATIO_MIN_STEPS` steps of
`RATIO_MIN_TOKENS` count; the chunk is recomputed every step until something is measured), and
before that there is no limit (the engine's `max_num_batched_tokens`). Owned by the engine, read
by its scheduler each step.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

SLACK = 0.1  # a chunk's fixed-cost share of its per-token cost
DECAY = 0.98  # weight of the past per timed step: about the last 50 steps count
MIN_STEPS = 8  # steps with prompt tokens before the fit is used
MIN_SPREAD = 0.05  # ... whose token counts vary by this share of their mean
MIN_CHUNK = 16  # never smaller: a block's worth
REFIT_STEPS = 8  # the chunk is recomputed every this many timed steps (a 3x3 solve each time)
MAX_STEP_S = 0.25  # the prompt work one step takes at most, at the measured seconds per token
RATIO_MIN_STEPS = 2  # prompt steps timed before the seconds per prompt token count
# ... of at least this many prompt tokens: in a step of a few, the fixed part is most of it, and
# the ratio would cut a batch of short prompts (spec_decode.py's chat, 8 x ~40 tokens) into
# chunks, which changes the kernels a token's rows go through (int8 GEMM for few rows, dense for
# many) and so its last bits, and greedy output, from one engine to the next
RATIO_MIN_TOKENS = 128
# a process's first prompt steps pay one-time costs (kernel libraries built or loaded on first
# use, first touches of the cache and scratch memory): measured 2.1 ms a prompt token against
# 1.1 after them; they are not fitted (a 0 ms fixed part fitted from them made 16-token chunks)
WARMUP_PROMPT_STEPS = 2


class StepCosts:
    """Least-squares fit of a prompt step's seconds to (1, prompt tokens), fading."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._xtx = np.zeros((2, 2))  # fading sums of 1, p, p * p
        self._xty = np.zeros(2)  # ... of t, p * t
        self.prefill_steps = 0  # timed steps with prompt tokens
        self.decode_steps = 0  # timed steps without (not fitted)
        self._seconds = self._tokens = 0.0  # fading sums over the prompt steps
        self.warmup_steps = 0  # prompt steps not fitted (WARMUP_PROMPT_STEPS)
        self.ratio_steps = 0  # prompt steps of RATIO_MIN_TOKENS or more, in the ratio

    def record(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step's work and its wall time."""
        if seconds <= 0 or prompt_tokens + decode_rows <= 0:
            return
        if not prompt_tokens:
            self.decode_steps += 1
            return
        if self.warmup_steps < WARMUP_PROMPT_STEPS:
            self.warmup_steps += 1
            return
        x = np.array([1.0, float(prompt_tokens)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        if prompt_tokens >= RATIO_MIN_TOKENS:
            self._seconds = self.decay * self._seconds + seconds
            self._tokens = self.decay * self._tokens + prompt_tokens
            self.ratio_steps += 1
        self.prefill_steps += 1

    def seconds_per_prompt_token(self) -> float | None:
        """The prompt steps' seconds over their prompt tokens (fading, everything included;
        steps of RATIO_MIN_TOKENS or more), once RATIO_MIN_STEPS of them were timed (no spread
        needed, unlike the fit)."""
        if self.ratio_steps < RATIO_MIN_STEPS or self._tokens <= 0:
            return None
        return self._seconds / self._tokens

    def _separable(self) -> bool:
        """Whether the prompt steps seen tell their fixed part from the per-token part: enough
        of them, of varied sizes (prompts end in chunks of all lengths)."""
        if self.prefill_steps < MIN_STEPS:
            return False
        count, total, squares = self._xtx[0, 0], self._xtx[0, 1], self._xtx[1, 1]
        mean = total / count
        spread = max(squares / count - mean * mean, 0.0) ** 0.5
        return spread >= MIN_SPREAD * mean

    def fit(self) -> tuple[float, float] | None:
        """(fixed s of a prompt step, s per prompt token), or None while under-determined."""
        if not self._separable():
            return None
        try:
            fixed, per_token = np.linalg.solve(self._xtx, self._xty)
        except np.linalg.LinAlgError:
            return None
        if per_token <= 0:
            return None
        return max(float(fixed), 0.0), float(per_token)

    def prefill_token_s(self) -> float | None:
        """Measured seconds one more prompt token adds to a step (None: not known yet)."""
        fitted = self.fit()
        return fitted[1] if fitted else None


class PrefillBudget:
    """The most prompt tokens a step takes: fixed (`limit`), or from `costs` (`limit` None)."""

    def __init__(self, max_tokens: int, limit: int | None, costs: StepCosts | None = None):
        self.max_tokens = max_tokens  # the step's whole token budget
        self.limit = limit
        self.costs = costs if costs is not None else StepCosts()
        self._chunk = max_tokens if limit is None else limit
        self._fitted_at = -1  # timed steps when the chunk was last computed
        self._measured = False  # ... from a fit or the seconds per prompt token
        self._logged = 0

    @classmethod
    def from_flag(cls, flag: str, max_tokens: int) -> PrefillBudget:
        """`--prefill-chunk`: auto | off | a number of tokens."""
        if flag == "auto":
            return cls(max_tokens, None)
        if flag == "off":
            return cls(max_tokens, max_tokens)
        return cls(max_tokens, min(int(flag), max_tokens))

    def tokens(self) -> int:
        """This step's prompt-token budget."""
        if self.limit is not None:
            return self.limit
        costs = self.costs
        timed = costs.prefill_steps + costs.decode_steps
        # every step until something is measured (a worker's first prompts are whole steps
        # until then), then every REFIT_STEPS
        if timed - self._fitted_at >= (REFIT_STEPS if self._measured else 1) or self._fitted_at < 0:
            self._fitted_at = timed
            self._chunk = self._measured_chunk()
        return self._chunk

    def _measured_chunk(self) -> int:
        fitted = self.costs.fit()
        per_token_s = self.costs.seconds_per_prompt_token()
        if fitted is None and per_token_s is None:
            return self.max_tokens
        self._measured = True
        chunk = self.max_tokens
        if fitted is not None:
            fixed, per_token = fitted
            chunk = min(chunk, int(np.ceil(fixed / (SLACK * per_token))))
        if per_token_s is not None:
            chunk = min(chunk, int(MAX_STEP_S / per_token_s))
        chunk = max(MIN_CHUNK, chunk)
        # say it when it is first measured and when it moves by half or more
        if not self._logged or not (self._logged / 1.5 < chunk < self._logged * 1.5):
            self._logged = chunk
            log.info("%s", self.describe(chunk))
        return chunk

    def describe(self, chunk: int | None = None) -> str:
        """A line for logs: the chunk and the fit behind it."""
        fitted = self.costs.fit()
        per_token_s = self.costs.seconds_per_prompt_token()
        measured = fitted is not None or per_token_s is not None
        how = "fixed" if self.limit is not None else "measured" if measured else "not measured yet"
        line = f"prefill chunk {self.tokens() if chunk is None else chunk} tokens ({how})"
        if fitted:
            fixed, per_token = fitted
            line += (
                f"; a prompt step = {1e3 * fixed:.2f} ms + {1e3 * per_token:.3f} ms per prompt "
                "token"
            )
        if per_token_s is not None:
            line += (
                f"; {1e3 * per_token_s:.3f} ms per prompt token in all, at most "
                f"{1e3 * MAX_STEP_S:.0f} ms of them a step"
            )
        return line
