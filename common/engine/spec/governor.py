"""The speculation governor: drafting stays on only where it pays, and `mean_accepted_length`.

`SpeculationGovernor` turns drafting off at a batch size while verified steps cost more per token
than plain ones (`--speculative-adaptive`), and tries again later. The engine asks it before each
step (`allow`) and tells it how each decode step went (`record`).
"""

from __future__ import annotations

from dataclasses import dataclass


def mean_accepted_length(stats: dict[str, float]) -> float:
    """Tokens a verifying sequence gains per step (accepted drafts + the target's own token)."""
    drafts = stats["spec_decode_num_drafts_total"]
    if drafts == 0:
        return 0.0
    return 1.0 + stats["spec_decode_num_accepted_tokens_total"] / drafts


@dataclass
class _Pace:
    """Seconds per output token at one running-batch size: drafting steps vs plain steps."""

    drafting: float | None = None
    plain: float | None = None
    drafting_steps: int = 0  # since drafting was last (re)started here
    paused: int = 0  # steps left with drafting off
    failures: int = 0  # drafting lost to plain decoding this many times in a row


class SpeculationGovernor:
    """Keeps drafting on only while it pays, as measured on this machine and workload.

    Per number of running sequences it keeps exponential averages of the seconds per output
    token of steps that verified drafts and of plain decode steps (steps with prefill chunks are
    not counted). After `min_steps` drafting steps it compares: more than `margin` times slower
    than plain decoding means drafting pauses at that batch size for `pause_steps` steps
    (doubling with each loss in a row, up to 4x), then is tried afresh. With no plain measurement
    yet it pauses for `probe_steps` steps to take one. Verification is exact either way, so this
    changes speed only, never output.
    """

    def __init__(
        self,
        pause_steps: int = 64,
        probe_steps: int = 4,
        min_steps: int = 16,
        alpha: float = 0.1,
        margin: float = 1.1,
    ) -> None:
        self.pause_steps = pause_steps
        self.probe_steps = probe_steps
        self.min_steps = min_steps
        self.alpha = alpha
        self.margin = margin  # drafting must be this much slower to pause: noise is not a loss
        self._pace: dict[int, _Pace] = {}
        self.num_pauses = 0

    def allow(self, batch_size: int) -> bool:
        """Whether this step may draft; call once per step."""
        pace = self._pace.setdefault(batch_size, _Pace())
        if pace.paused > 0:
            pace.paused -= 1
            return False
        return True

    def record(self, batch_size: int, drafted: bool, seconds: float, num_tokens: int) -> None:
        """A decode step of `batch_size` sequences took `seconds` for `num_tokens` new tokens."""
        if num_tokens <= 0:
            return
        pace = self._pace.setdefault(batch_size, _Pace())
        per_token = seconds / num_tokens
        if not drafted:
            pace.plain = self._average(pace.plain, per_token)
            return
        pace.drafting = self._average(pace.drafting, per_token)
        pace.drafting_steps += 1
        if pace.drafting_steps < self.min_steps:
            return
        if pace.plain is None:
            pause = self.probe_steps
        elif pace.drafting > self.margin * pace.plain:
            pause = self.pause_steps << min(pace.failures, 2)
            pace.failures += 1
            self.num_pauses += 1
        else:
            pace.failures = 0
            return
        pace.paused, pace.drafting, pace.drafting_steps = pause, None, 0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
