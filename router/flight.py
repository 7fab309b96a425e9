"""`Flight`: one choice of one HTTP request while workers serve it, and the load it puts on them.

Owns the flight's data (prompt and its block keys, hashed once whatever number of choices read
them; sampling parameters, the event buffer its tokens go to, where it runs now, what was relayed
so far) and its share of its workers' load as the router counts it:
`assign_decode` / `release_decode` count it on a decode worker's `num_in_flight`, `release_prefill`
takes it (and its queued prompt tokens) off its prefill worker. Also `FlightFailed`, the event a
flight that cannot complete leaves for its reader, and `Event`, what a job's buffer holds.

Used by `router.dispatch` (which moves flights through the workers), `router.migration`,
`router.job` and `router.streaming`. Single-threaded, on the router's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.protocol import ReserveReply, TokenOutput
from common.sampling_params import SamplingParams
from router.policy import PromptKeys
from router.registry import Worker
from router.relay import EventBuffer


@dataclass
class FlightFailed:
    """A flight that cannot complete; `code` is the HTTP status the client sees."""

    reason: str
    code: int = 503


Event = tuple[int, "TokenOutput | FlightFailed"]  # (choice index, what happened)


@dataclass
class Flight:
    """One choice of one request: the prompt, where it runs and where its events go."""

    base_id: str
    index: int  # the choice's index in the response
    prompt_token_ids: list[int]
    params: SamplingParams
    events: EventBuffer  # its job's: the reader takes every event there at once
    attempt: int = 0  # bumped when the workers must forget an earlier try of this flight
    decode: Worker | None = None  # set from the decode choice until the last token
    prefill: Worker | None = None  # set while a prefill worker owes this flight its KV
    num_decode_cached_tokens: int = 0
    num_prefill_tokens: int = 0  # counted on the prefill worker's load until the first token
    reserve_reply: asyncio.Future[ReserveReply] | None = None  # while a Reserve is out
    dispatched: bool = False
    started_decoding: bool = False
    redispatched: bool = False  # its prefill moved to another worker at least once
    finished: bool = False
    output_token_ids: list[int] = field(default_factory=list)  # relayed so far
    migrations: int = 0  # times it moved to another decode worker (its own died or stalled)
    refusals: int = 0  # times a decode worker refused it (its log lines after the first: debug)
    keys: PromptKeys = field(init=False, repr=False)  # the prompt's block keys, per salt

    def __post_init__(self) -> None:
        self.keys = PromptKeys(self.prompt_token_ids)

    @property
    def request_id(self) -> str:
        """The id the workers know this flight by (a new one per attempt)."""
        return self.base_id if self.attempt == 0 else f"{self.base_id}.{self.attempt}"

    def assign_decode(self, decode: Worker) -> None:
        """Run on `decode` from now: counted on its load until released."""
        self.decode = decode
        decode.num_in_flight += 1

    def release_decode(self) -> None:
        if self.decode is not None:
            self.decode.num_in_flight -= 1
            self.decode = None

    def assign_prefill(self, prefill: Worker, num_tokens: int) -> None:
        """Prefill on `prefill`: `num_tokens` prompt tokens count on its load until released."""
        self.prefill, self.num_prefill_tokens = prefill, num_tokens
        prefill.num_in_flight += 1
        prefill.queued_prefill_tokens += num_tokens

    def release_prefill(self) -> None:
        if self.prefill is not None:
            self.prefill.num_in_flight -= 1
            self.prefill.queued_prefill_tokens -= self.num_prefill_tokens
            self.prefill = None
