"""The path of each request through the workers, from dispatch to its last token.

Owns `Flight` (one choice of one HTTP request while workers serve it) and the `Dispatcher` that
moves it: pick a decode worker; for a long prompt with prefill workers live, `Reserve` on the decode
worker, then `Prefill` on a prefill worker naming that reservation; otherwise `Generate` on the
decode worker. A refusal (or a reservation that does not come back in time) moves on to the next
decode worker; when none takes it within the queue timeout the request gets a 503. Worker messages
come back through `on_message`: a `TokenBatch`'s (or a lone `TokenOutput`'s) tokens go to each
flight's event buffer (`router.relay`), `RequestFailed` fails it.
A dead (or stalled) decode worker's flights move to another decode worker, which prefills the
prompt and the tokens relayed so far and goes on (`_migrate`; at most MAX_MIGRATIONS times, then
the flight fails); a dead prefill worker's flights that have not started decoding go to another
prefill worker (or, with none left, prefill on the decode worker itself).
`router.job.Job` groups the flights of one HTTP request around one event buffer.

Called by `router.app` (dispatch, release) and by `router.control` (worker messages, worker
deaths). Single-threaded: everything runs on the router's event loop.

Why one module of ~470 lines: `Dispatcher` is one state machine over a flight's life (reserve,
prefill, generate, refusal, failure, failover, release), and each transition updates the same
books (worker loads, reservations, the prefix index's pending keys); split across files, the
places that must undo each other's bookkeeping would no longer be read together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from common.aio import wait_for
from common.api.requests import RequestError
from common.protocol import (
    Abort,
    BlockBooksReply,
    Generate,
    Prefill,
    RequestFailed,
    Reserve,
    ReserveReply,
    TokenBatch,
    TokenOutput,
)
from common.sampling_params import SamplingParams
from kvtransfer import choose_transport
from router.admission import WaitingLine
from router.kv_index import PrefixIndex
from router.policy import (
    PrefillPolicy,
    PrefixParams,
    pick_decode,
    pick_decode_by_prefix,
)
from router.registry import Registry, Worker
from router.relay import EventBuffer

log = logging.getLogger(__name__)

MAX_MIGRATIONS = 2  # moves to another decode worker per flight; then it fails as before
QUEUE_POLL_S = 0.05  # how often a queued request looks for a decode worker again
REFUSAL_BACKOFF_S = 0.5  # a decode worker that refused gets no new requests for this long


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

    @property
    def request_id(self) -> str:
        """The id the workers know this flight by (a new one per attempt)."""
        return self.base_id if self.attempt == 0 else f"{self.base_id}.{self.attempt}"


class Dispatcher:
    """Moves flights through the workers; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        send: Callable[[Worker, msgspec.Struct], bool],
        *,
        routing: str = "least_loaded",
        local_prefill_max_tokens: int = 256,
        queue_timeout_s: float = 10.0,
        max_queue_wait_s: float = 120.0,
        reserve_timeout_s: float = 5.0,
        prefill_deadline_s: float = 120.0,
        prefix_index: PrefixIndex | None = None,
        prefix_params: PrefixParams | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.send = send  # False when the message could not be queued for the worker
        self.prefill_policy = PrefillPolicy(routing, prefix_index, prefix_params)
        self.prefix_index = self.prefill_policy.index
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.queue_timeout_s = queue_timeout_s
        self.max_queue_wait_s = max_queue_wait_s
        self.reserve_timeout_s = reserve_timeout_s
        self.prefill_deadline_s = prefill_deadline_s
        self.clock = clock
        self.flights: dict[str, Flight] = {}  # by request_id
        self.num_migrations = 0  # flights moved off a dead decode worker (a counter)
        self._moving: set[asyncio.Task] = set()  # migrations looking for a decode worker
        self.num_waiting = 0  # flights looking for a decode worker
        self.line = WaitingLine()  # flights looking for a decode worker, first come first served

    @property
    def num_running(self) -> int:
        return sum(1 for f in self.flights.values() if f.dispatched and not f.finished)

    # ---- dispatch -------------------------------------------------------------------------------

    async def dispatch(self, flight: Flight) -> None:
        """Hand the flight to workers; RequestError(503) if no decode worker takes it in time:
        within the queue timeout, or, while decode workers are busy with requests whose end will
        free room (a long prompt that found no free blocks), within `max_queue_wait_s`.

        First come, first served: only the oldest flight still looking may pick a decode worker,
        so a flight that found no room is not overtaken by later ones. One that is waiting for
        a worker's reply steps out of the line meanwhile (others pick), and back in at its
        place if refused.
        """
        self.flights[flight.request_id] = flight
        deadline = self.clock() + self.queue_timeout_s
        longest = self.clock() + max(self.max_queue_wait_s, self.queue_timeout_s)
        place = self.line.join()
        self.num_waiting += 1
        try:
            while True:
                decode = None
                if self.line.first(place):
                    decode, keys = self._pick_decode(flight)
                    if decode is not None:
                        self.line.leave(place)
                        started = await self._start_on(flight, decode)
                        if started:
                            flight.dispatched = True
                            if keys:  # prefilled there: the next prompt with this prefix follows
                                self.prefix_index.add_pending(decode.worker_id, keys)
                            return
                        self.line.rejoin(place)
                now = self.clock()
                if now >= deadline and (now >= longest or not self._room_coming()):
                    raise RequestError(
                        "no decode worker could take the request; try again later",
                        code=503,
                        type="service_unavailable",
                    )
                if decode is None:
                    await self.line.wait_turn(place, QUEUE_POLL_S)
        finally:
            self.line.leave(place)
            self.num_waiting -= 1

    def _room_coming(self) -> bool:
        """Some live decode worker serves requests of ours: when they finish, room frees up."""
        return any(w.num_in_flight > 0 for w in self.registry.live("decode"))

    def _pick_decode(self, flight: Flight) -> tuple[Worker | None, list[bytes]]:
        """The decode worker to try, and the prompt's block keys if chosen by prefix."""
        workers = self.registry.live("decode")
        prefills_there = len(flight.prompt_token_ids) <= self.local_prefill_max_tokens or not (
            self.registry.live("prefill")
        )
        policy = self.prefill_policy
        if policy.routing == "prefix" and prefills_there:
            choice = pick_decode_by_prefix(
                workers, self.clock(), flight.prompt_token_ids, self.prefix_index,
                policy.params.decode_slack,
            )  # fmt: skip
            return choice if choice is not None else (None, [])
        return pick_decode(workers, self.clock()), []

    def _remote_prefill(self, flight: Flight, decode: Worker) -> bool:
        # The decode worker's cached prefix is not known before Reserve: count the whole prompt.
        return (
            bool(decode.info.kv_address)
            and len(flight.prompt_token_ids) > self.local_prefill_max_tokens
            and bool(self.registry.live("prefill"))
        )

    async def _start_on(self, flight: Flight, decode: Worker) -> bool:
        """Try one decode worker; False if it refused, did not answer or is unreachable."""
        self._assign_decode(flight, decode)
        if not self._remote_prefill(flight, decode):
            if self._send(decode, self._generate(flight)):
                return True
            self._refused(flight, decode, "unreachable")
            return False
        reply_future = asyncio.get_running_loop().create_future()
        flight.reserve_reply = reply_future
        # The reservation lives as long as the router waits for the reply and the prefill.
        deadline_s = self.reserve_timeout_s + self.prefill_deadline_s
        reserve = Reserve(flight.request_id, flight.prompt_token_ids, flight.params, deadline_s)
        try:
            if not self._send(decode, reserve):
                reply = ReserveReply(flight.request_id, ok=False, reason="unreachable")
            else:
                reply = await wait_for(reply_future, self.reserve_timeout_s)
        except asyncio.TimeoutError:
            # A reservation made after we gave up must not leak; the next try gets a new id so
            # that this one's late reply cannot be taken for it.
            self._send(decode, Abort(flight.request_id))
            self._rekey(flight)
            reply = ReserveReply(flight.request_id, ok=False, reason="no reply in time")
        finally:
            flight.reserve_reply = None
        if not reply.ok:
            self._refused(flight, decode, reply.reason)
            return False
        flight.num_decode_cached_tokens = reply.num_cached_tokens
        self._send_prefill(flight)
        return True

    def _send_prefill(self, flight: Flight, exclude: frozenset[str] = frozenset()) -> None:
        """Ask a prefill worker to compute the flight's KV and push it to its decode worker."""
        decode = flight.decode
        assert decode is not None
        choice = self.prefill_policy.choose(
            self.registry.live("prefill"), flight.prompt_token_ids, exclude
        )
        if choice is None:
            self._prefill_locally(flight)
            return
        prefill = choice.worker
        # What the worker has to compute: the prompt less the prefix it holds (at least one token).
        num_tokens = max(len(flight.prompt_token_ids) - choice.matched_tokens, 1)
        flight.prefill, flight.num_prefill_tokens = prefill, num_tokens
        prefill.num_in_flight += 1
        prefill.queued_prefill_tokens += num_tokens
        prefill.num_prefill_dispatched += 1
        prefill.prefix_matched_tokens += choice.matched_tokens
        if choice.keys:  # a second prompt with this prefix should find it here, even right now
            self.prefix_index.add_pending(prefill.worker_id, choice.keys)
        message = Prefill(
            request_id=flight.request_id,
            prompt_token_ids=flight.prompt_token_ids,
            params=flight.params,
            decode_worker_id=decode.worker_id,
            decode_kv_address=decode.info.kv_address,
            num_decode_cached_tokens=flight.num_decode_cached_tokens,
            transport=choose_transport(
                prefill.info.host == decode.info.host,
                prefill.info.transports,
                decode.info.transports,
            ),
            deadline_s=self.prefill_deadline_s,
        )
        if not self._send(prefill, message):
            self._release_prefill(flight)
            self._send_prefill(flight, exclude | {prefill.worker_id})

    def _prefill_locally(self, flight: Flight) -> None:
        """No prefill worker left: drop the reservation and let the decode worker prefill."""
        decode = flight.decode
        assert decode is not None
        log.info("%s: no prefill worker left; prefilling on %s", flight.base_id, decode.worker_id)
        self._send(decode, Abort(flight.request_id))
        self._rekey(flight)
        if not self._send(decode, self._generate(flight)):
            self._fail(flight, f"decode worker {decode.worker_id} is unreachable")

    @staticmethod
    def _generate(flight: Flight) -> Generate:
        return Generate(flight.request_id, flight.prompt_token_ids, flight.params)

    # ---- worker messages ------------------------------------------------------------------------

    def on_message(self, worker: Worker, msg: msgspec.Struct) -> None:
        """A `TokenBatch`, `TokenOutput`, `ReserveReply` or `RequestFailed` from a registered
        worker."""
        if isinstance(msg, TokenBatch):
            for out in msg.outputs:
                self._on_tokens(worker, out)
        elif isinstance(msg, ReserveReply):
            flight = self.flights.get(msg.request_id)
            future = (
                flight.reserve_reply if flight is not None and flight.decode is worker else None
            )
            if future is not None and not future.done():
                future.set_result(msg)
            elif msg.ok:  # nobody waits for this reservation any more
                self._send(worker, Abort(msg.request_id))
        elif isinstance(msg, TokenOutput):
            self._on_tokens(worker, msg)
        elif isinstance(msg, RequestFailed):
            self._on_failed(worker, msg)
        elif isinstance(msg, BlockBooksReply):
            self.registry.on_block_books(worker, msg)
        else:
            log.warning("unexpected %s from worker %s", type(msg).__name__, worker.worker_id)

    def _on_tokens(self, worker: Worker, msg: TokenOutput) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None or flight.decode is not worker or flight.finished:
            if flight is None and not msg.finished:
                self._send(worker, Abort(msg.request_id))  # nobody listens: stop generating
            return
        if not flight.started_decoding:
            flight.started_decoding = True
            if flight.redispatched and flight.prefill is not None:
                self._send(flight.prefill, Abort(flight.request_id))  # a second prefill is moot
            self._release_prefill(flight)
        flight.output_token_ids += msg.token_ids
        if msg.finished:
            flight.finished = True
            self._release_decode(flight)
        flight.events.put_nowait((flight.index, msg))

    def _on_failed(self, worker: Worker, msg: RequestFailed) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None or flight.finished:
            return
        future = flight.reserve_reply
        if worker is flight.decode and future is not None and not future.done():
            future.set_result(ReserveReply(msg.request_id, ok=False, reason=msg.reason))
        elif worker is flight.decode or worker is flight.prefill:
            self._fail(
                flight,
                f"{msg.stage} failed on {worker.role} worker {worker.worker_id}: {msg.reason}",
            )

    def on_worker_dead(self, worker: Worker) -> None:
        """Fail what a dead decode worker was serving; move a dead prefill worker's work."""
        for flight in list(self.flights.values()):
            if flight.finished:
                continue
            if flight.decode is worker:
                future = flight.reserve_reply
                if future is not None:
                    if not future.done():
                        future.set_result(
                            ReserveReply(flight.request_id, ok=False, reason="worker stopped")
                        )
                elif flight.migrations < MAX_MIGRATIONS:
                    self._migrate(flight, worker)
                else:
                    self._fail(flight, f"decode worker {worker.worker_id} stopped responding")
            elif flight.prefill is worker:
                log.warning(
                    "%s: prefill worker %s died; re-dispatching", flight.base_id, worker.worker_id
                )
                self._release_prefill(flight)
                flight.redispatched = True
                self._send_prefill(flight, frozenset({worker.worker_id}))

    # ---- migration ------------------------------------------------------------------------------

    def _migrate(self, flight: Flight, dead: Worker) -> None:
        """Move a flight off a decode worker that died or stalled: another decode worker
        prefills its prompt and the tokens relayed so far and goes on from there (its stop
        rules, penalties, grammar and seeded generator continue where they were); the client
        sees a pause, not an error."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop to look for a worker in
            self._fail(flight, f"decode worker {dead.worker_id} stopped responding")
            return
        log.warning(
            "%s: decode worker %s stopped after %d tokens; moving it to another",
            flight.base_id, dead.worker_id, len(flight.output_token_ids),
        )  # fmt: skip
        if flight.prefill is not None:  # its KV has nowhere to go now
            self._send(flight.prefill, Abort(flight.request_id))
            self._release_prefill(flight)
        self._release_decode(flight)
        self._rekey(flight)  # a late output of the dead worker is not taken for the new one's
        flight.migrations += 1
        self.num_migrations += 1
        task = loop.create_task(self._resume(flight))
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    async def _resume(self, flight: Flight) -> None:
        """Start a migrated flight on the least loaded live decode worker, within the queue
        timeout; else it fails as it would have without migration."""
        deadline = self.clock() + self.queue_timeout_s
        while not flight.finished:
            decode = pick_decode(self.registry.live("decode"), self.clock())
            if decode is not None:
                self._assign_decode(flight, decode)
                tokens = flight.prompt_token_ids + flight.output_token_ids
                message = Generate(
                    flight.request_id, tokens, flight.params, len(flight.output_token_ids)
                )
                if self._send(decode, message):
                    return
                self._refused(flight, decode, "unreachable")
            if self.clock() >= deadline:
                self._fail(flight, "its decode worker stopped and no other could take it")
                return
            await asyncio.sleep(QUEUE_POLL_S)

    # ---- the end of a flight --------------------------------------------------------------------

    def release(self, flight: Flight, abort: bool = True) -> None:
        """The client is done with the flight: abort it on its workers if it still runs."""
        if not flight.finished and abort:
            for worker in (flight.decode, flight.prefill):
                if worker is not None:
                    self._send(worker, Abort(flight.request_id))
        flight.finished = True
        self._release_prefill(flight)
        self._release_decode(flight)
        self.flights.pop(flight.request_id, None)

    def _fail(self, flight: Flight, reason: str, code: int = 503) -> None:
        log.warning("%s failed: %s", flight.base_id, reason)
        for worker in (flight.decode, flight.prefill):
            if worker is not None:
                self._send(worker, Abort(flight.request_id))  # releases its blocks, if it lives
        flight.finished = True
        self._release_prefill(flight)
        self._release_decode(flight)
        flight.events.put_nowait((flight.index, FlightFailed(reason, code)))

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        return self.send(worker, msg)

    def _rekey(self, flight: Flight) -> None:
        self.flights.pop(flight.request_id, None)
        flight.attempt += 1
        self.flights[flight.request_id] = flight

    def _assign_decode(self, flight: Flight, decode: Worker) -> None:
        flight.decode = decode
        decode.num_in_flight += 1

    def _refused(self, flight: Flight, decode: Worker, reason: str) -> None:
        log.info("%s: decode worker %s refused: %s", flight.base_id, decode.worker_id, reason)
        self._release_decode(flight)
        decode.refused_until_s = self.clock() + REFUSAL_BACKOFF_S

    def _release_decode(self, flight: Flight) -> None:
        if flight.decode is not None:
            flight.decode.num_in_flight -= 1
            flight.decode = None

    def _release_prefill(self, flight: Flight) -> None:
        if flight.prefill is not None:
            flight.prefill.num_in_flight -= 1
            flight.prefill.queued_prefill_tokens -= flight.num_prefill_tokens
            flight.prefill = None
