"""The speculation governor: drafting stays on only where it pays, and `mean_accepted_length`.

`SpeculationGovernor` turns drafting off at a batch size while verified steps cost more per token
than plain ones (`--speculative-adaptive`), and tries again later; while drafting is on, it also
chooses how many drafts a step verifies (`draft_limit`), from the acceptance measured at each
draft position and what a draft measured to add to a step. The engine calls `steer` before each
step and `record_step` after each decode step. `ShadowDrafts` watches what a free proposer
(n-gram lookup) would have drafted while drafting is paused and how much of it the model then
produced (`watch`): the governor resumes as soon as that says drafting would pay (`shadow`),
instead of waiting out its pause while the copying it was made for goes by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.scheduler import ScheduledSeq, Scheduler


def mean_accepted_length(stats: dict[str, float]) -> float:
    """Tokens a verifying sequence gains per step (accepted drafts + the target's own token)."""
    drafts = stats["spec_decode_num_drafts_total"]
    if drafts == 0:
        return 0.0
    return 1.0 + stats["spec_decode_num_accepted_tokens_total"] / drafts


FULL_EVERY = 16  # every this many drafting steps one drafts at full length (draft_limit)
MIN_OFFERED = 8.0  # a position's acceptance counts once this many drafts were verified there
ACCEPT_DECAY = 0.99  # per verified draft at a position: the counts follow the workload


@dataclass
class _Pace:
    """Seconds per output token at one running-batch size: drafting steps vs plain steps."""

    drafting: float | None = None
    plain: float | None = None
    drafting_steps: int = 0  # since drafting was last (re)started here
    paused: int = 0  # steps left with drafting off
    failures: int = 0  # drafting lost to plain decoding this many times in a row
    step: float | None = None  # seconds of a drafting step (kept across pauses)
    row_cost: float | None = None  # a drafting step's added time per draft a sequence, / plain
    chosen: int = 0  # drafting steps since the last one at full length
    shadow: float | None = None  # tokens a sequence's verify step would have gained (paused)
    shadows: int = 0  # shadow drafts judged since this pause began


class SpeculationGovernor:
    """Keeps drafting on only while it pays, as measured on this machine and workload.

    Per number of running sequences it keeps exponential averages of the seconds per output
    token of steps that verified drafts and of plain decode steps (steps with prefill chunks are
    not counted). After `min_steps` drafting steps it compares: more than `margin` times slower
    than plain decoding means drafting pauses at that batch size for `pause_steps` steps
    (doubling with each loss in a row, up to 4x), then is tried afresh. With no plain measurement
    yet it pauses for `probe_steps` steps to take one. While paused, `shadow` hears what drafts
    would have gained: once `min_shadows` of them predict drafting at least `margin` times faster
    per token than plain decoding (its last measured step time over that gain), the pause ends.
    Verification is exact either way, so this changes speed only, never output.
    """

    def __init__(
        self,
        pause_steps: int = 64,
        probe_steps: int = 4,
        min_steps: int = 16,
        alpha: float = 0.1,
        margin: float = 1.1,
        min_shadows: int = 3,
    ) -> None:
        self.pause_steps = pause_steps
        self.probe_steps = probe_steps
        self.min_steps = min_steps
        self.alpha = alpha
        self.margin = margin  # drafting must be this much slower to pause: noise is not a loss
        self.min_shadows = min_shadows
        self._pace: dict[int, _Pace] = {}
        # per draft position i (0-based): decayed counts of drafts verified there with all before
        # it accepted, and of those accepted (the workload's, whatever the batch size)
        self._offered: list[float] = []
        self._accepted: list[float] = []
        self.num_pauses = 0
        self.num_resumes = 0  # pauses ended early by shadow drafts

    def allow(self, batch_size: int) -> bool:
        """Whether this step may draft; call once per step."""
        pace = self._pace.setdefault(batch_size, _Pace())
        if pace.paused > 0:
            pace.paused -= 1
            return False
        return True

    def steer(self, scheduler: Scheduler, batch_size: int, k: int, graphed: bool) -> None:
        """Before a step: whether it may draft (`allow`) and how many drafts (`draft_limit`),
        unless `graphed` (CUDA graphs replay the k + 1-token verify steps, shorter ones run
        eager: their cost is not the line draft_limit assumes, so all k stay)."""
        scheduler.drafting = self.allow(batch_size)
        if not graphed:
            scheduler.draft_limit = self.draft_limit(batch_size, k)

    def record_step(
        self, batch_size: int, batch: list[ScheduledSeq], outputs: list, seconds: float
    ) -> None:
        """After a step of one new token (and its drafts) per sequence: `record` it."""
        drafts = sum(len(item.draft_token_ids) for item in batch)
        num_tokens = sum(len(out.new_token_ids) for out in outputs)
        self.record(batch_size, drafts > 0, seconds, num_tokens, drafts / len(batch))

    def draft_limit(self, batch_size: int, k: int) -> int:
        """How many drafts a sequence may verify this step, at most k: the count d that
        maximizes the tokens a verifying sequence is expected to gain, 1 + sum over i <= d of
        the chance its first i drafts are all accepted (per position, as measured), per unit of
        step time, 1 + d * (a draft's measured added cost relative to a plain step). k until
        both are measured, and every `FULL_EVERY`-th drafting step (the deeper positions'
        acceptance keeps being measured)."""
        pace = self._pace.get(batch_size)
        if pace is None or pace.row_cost is None or len(self._offered) < k:
            return k
        pace.chosen += 1
        if pace.chosen >= FULL_EVERY:
            pace.chosen = 0
            return k
        best, best_rate, gain, reach = k, 0.0, 1.0, 1.0
        for d in range(1, k + 1):
            offered = self._offered[d - 1]
            if offered < MIN_OFFERED:
                break  # not measured enough this deep: stop at what is known
            reach *= self._accepted[d - 1] / offered
            gain += reach
            rate = gain / (1.0 + d * pace.row_cost)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        """A sequence verified `num_drafts` drafts and kept the first `num_accepted`."""
        if num_drafts <= 0:
            return
        while len(self._offered) < num_drafts:
            self._offered.append(0.0)
            self._accepted.append(0.0)
        for i in range(min(num_drafts, num_accepted + 1)):
            self._offered[i] = self._offered[i] * ACCEPT_DECAY + 1.0
            if i < num_accepted:
                self._accepted[i] = self._accepted[i] * ACCEPT_DECAY + 1.0
            else:
                self._accepted[i] *= ACCEPT_DECAY

    def record(
        self, batch_size: int, drafted: bool, seconds: float, num_tokens: int,
        drafts: float = 0.0,
    ) -> None:  # fmt: skip
        """A decode step of `batch_size` sequences took `seconds` for `num_tokens` new tokens
        (a drafting step: `drafts` drafts verified per sequence, on average)."""
        if num_tokens <= 0:
            return
        pace = self._pace.setdefault(batch_size, _Pace())
        per_token = seconds / num_tokens
        if not drafted:
            pace.plain = self._average(pace.plain, per_token)
            return
        if pace.plain is not None and drafts > 0:
            extra = (seconds / (pace.plain * batch_size) - 1.0) / drafts
            pace.row_cost = self._average(pace.row_cost, max(extra, 0.0))
        pace.drafting = self._average(pace.drafting, per_token)
        pace.step = self._average(pace.step, seconds)
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
        pace.shadow, pace.shadows = None, 0

    def paused(self, batch_size: int) -> bool:
        pace = self._pace.get(batch_size)
        return pace is not None and pace.paused > 0

    def shadow(self, batch_size: int, tokens: int) -> None:
        """While paused at `batch_size`: a draft made without verifying it would have gained a
        sequence `tokens` tokens in one verify step (1 + its leading tokens the model produced)."""
        pace = self._pace.get(batch_size)
        if pace is None or pace.paused <= 0 or pace.step is None or pace.plain is None:
            return
        pace.shadow = self._average(pace.shadow, float(tokens), alpha=0.3)
        pace.shadows += 1
        predicted = pace.step / (batch_size * pace.shadow)  # seconds a token, drafting
        if pace.shadows >= self.min_shadows and predicted * self.margin < pace.plain:
            pace.paused, pace.failures, pace.shadow, pace.shadows = 0, 0, None, 0
            self.num_resumes += 1

    def _average(self, old: float | None, new: float, alpha: float | None = None) -> float:
        alpha = self.alpha if alpha is None else alpha
        return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class ShadowDrafts:
    """Drafts `propose(token_ids)` makes for sequences that decode without drafting, checked
    against the tokens the model then produces: each ends at its first miss (or when all of it
    came true) as the tokens a verify step of it would have gained."""

    propose: Callable[[list[int]], list[int]]
    pending: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # draft, matched

    def observe(self, request_id: str, new_token_ids: list[int], token_ids: list[int],
                finished: bool) -> list[int]:  # fmt: skip
        """A plain step gave `request_id` `new_token_ids` (its tokens are now `token_ids`): the
        gains of the shadow drafts this ended; then a fresh draft from here."""
        gains = []
        draft, matched = self.pending.pop(request_id, ([], 0))
        for token in new_token_ids:
            if not draft:
                break
            if token == draft[matched]:
                matched += 1
                if matched < len(draft):
                    continue
            gains.append(1 + matched)  # a miss (the model's own token), or all of it and the next
            draft, matched = [], 0
        if draft:
            self.pending[request_id] = (draft, matched)
        elif not finished:
            fresh = self.propose(token_ids)
            if fresh:
                self.pending[request_id] = (fresh, 0)
        return gains

    def watch(
        self, governor: SpeculationGovernor, batch_size: int, outputs: list, seqs: dict
    ) -> None:
        """After a plain step: while `governor` pauses drafting at this batch size, tell it
        what drafts would have gained (`observe`, with each output's sequence from `seqs`);
        otherwise forget the pending drafts."""
        if not governor.paused(batch_size):
            self.clear()
            return
        for out in outputs:
            seq = seqs.get(out.request_id)
            tokens = seq.token_ids if seq is not None else []
            finished = out.finished or seq is None
            for gain in self.observe(out.request_id, out.new_token_ids, tokens, finished):
                governor.shadow(batch_size, gain)

    def clear(self) -> None:
        self.pending.clear()
