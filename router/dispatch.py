"""The path of each request through the workers, from dispatch to its last token.

Owns the `Dispatcher`, which moves each `Flight` (`router.flight`: one choice of one HTTP
request while workers serve it): pick a decode worker; for a long prompt with prefill workers
live, `Reserve` on the decode worker, then `Prefill` on a prefill worker naming that reservation;
otherwise `Generate` on the decode worker. A refusal (or a reservation that does not come back in
time) moves on to the next decode worker; when none takes it within the queue timeout the request
gets a 503. Worker messages come back through `on_message`: a `TokenBatch`'s (or a lone
`TokenOutput`'s) tokens go to each flight's event buffer (`router.relay`), `RequestFailed` fails
it. A dead (or stalled) worker's flights move elsewhere (`router.migration`). Worker loads are
counted by the flight itself (`Flight.assign_decode`, `release_prefill`, ...), so the places that
must undo each other's bookkeeping read the same few lines. `router.job.Job` groups the flights
of one HTTP request around one event buffer.

Called by `router.app` (dispatch, release) and by `router.control` (worker messages, worker
deaths). Single-threaded: everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import msgspec

from common.aio import wait_for
from common.api.requests import RequestError
from common.protocol import (
    Abort,
    BlockBooksReply,
    Generate,
    RequestFailed,
    Reserve,
    ReserveReply,
    TokenBatch,
    TokenOutput,
)
from router import migration, prefill_leg
from router.admission import WaitingLine
from router.flight import Event, Flight, FlightFailed
from router.kv_index import PrefixIndex
from router.policy import (
    PEER_FETCH_WEIGHT,
    PrefillPolicy,
    PrefixParams,
    pick_decode,
    pick_decode_by_prefix,
)
from router.registry import Registry, Worker

__all__ = ["Dispatcher", "Event", "Flight", "FlightFailed"]

log = logging.getLogger(__name__)

QUEUE_POLL_S = 0.05  # how often a queued request looks for a decode worker again
REFUSAL_BACKOFF_S = 0.5  # a decode worker that refused gets no new requests for this long


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
        peer_fetch: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`peer_fetch`: hint a prefill worker at a peer holding the prefix it lacks
        (`router.prefill_leg.peer_hint`)."""
        self.registry = registry
        self.send = send  # False when the message could not be queued for the worker
        # blocks peers hold count (less than local ones) only where workers may fetch them
        prefix_params = dataclasses.replace(
            prefix_params or PrefixParams(), fetch_weight=PEER_FETCH_WEIGHT if peer_fetch else 0.0
        )
        self.prefill_policy = PrefillPolicy(routing, prefix_index, prefix_params)
        self.prefix_index = self.prefill_policy.index
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.queue_timeout_s = queue_timeout_s
        self.max_queue_wait_s = max_queue_wait_s
        self.reserve_timeout_s = reserve_timeout_s
        self.prefill_deadline_s = prefill_deadline_s
        self.peer_fetch = peer_fetch
        self.clock = clock
        self.flights: dict[str, Flight] = {}  # by request_id
        self.num_migrations = 0  # flights moved off a dead decode worker (a counter)
        self.moving: set[asyncio.Task] = set()  # migrations looking for a decode worker
        self.queue_poll_s = QUEUE_POLL_S
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
        place if refused. Past the queue timeout only the first in line gives up, and only
        once waiting cannot help (`_hopeless`): the flights behind it wait their turn.
        """
        self.flights[flight.request_id] = flight
        deadline = self.clock() + self.queue_timeout_s
        longest = self.clock() + max(self.max_queue_wait_s, self.queue_timeout_s)
        place = self.line.join()
        self.num_waiting += 1
        refused_idle = False  # its last try was refused with no room coming
        try:
            while True:
                decode = None
                if self.line.first(place):
                    decode, keys = self._pick_decode(flight)
                    if decode is not None:
                        self.line.leave(place)
                        started = await self._start_on(flight, decode, keys)
                        if started:
                            flight.dispatched = True
                            if keys:  # prefilled there: the next prompt with this prefix follows
                                self.prefix_index.add_pending(decode.worker_id, keys)
                            return
                        self.line.rejoin(place)
                        refused_idle = not self._room_coming()
                now = self.clock()
                if now >= longest or (
                    now >= deadline and self._hopeless(place, decode is None, refused_idle)
                ):
                    raise RequestError(
                        "no decode worker could take the request; try again later",
                        code=503,
                        type="service_unavailable",
                    )
                if decode is None:
                    await self.line.wait_turn(place, self.queue_poll_s)
        finally:
            self.line.leave(place)
            self.num_waiting -= 1

    def _room_coming(self) -> bool:
        """Some live decode worker serves requests (ours, or as its heartbeat says): when they
        finish, room frees up."""
        return any(w.has_work() for w in self.registry.live_index("decode"))

    def _hopeless(self, place: int, found_none: bool, refused_idle: bool) -> bool:
        """Whether waiting longer cannot get the flight at `place` a decode worker: it is first
        in line (the ones behind it get their turn when it leaves), no room is coming, and its
        last try was refused then, or it found no worker and none will take requests again
        after a refusal's back-off. Not merely because no room is coming: the moment a busy
        worker's last request ends, the flights queued for it (the first perhaps in its
        back-off) must get their turn, not a 503 each."""
        if not self.line.first(place) or self._room_coming():
            return False
        if refused_idle:
            return True
        now = self.clock()
        backing_off = any(w.refused_until_s > now for w in self.registry.live_index("decode"))
        return found_none and not backing_off

    def _pick_decode(self, flight: Flight) -> tuple[Worker | None, list[bytes]]:
        """The decode worker to try, and the prompt's block keys if chosen by prefix."""
        workers = self.registry.live_index("decode")
        prefills_there = len(
            flight.prompt_token_ids
        ) <= self.local_prefill_max_tokens or not self.registry.has_live("prefill")
        policy = self.prefill_policy
        if policy.routing == "prefix" and prefills_there:
            choice = pick_decode_by_prefix(
                workers, self.clock(), flight.keys, self.prefix_index, policy.params.decode_slack
            )
            return choice if choice is not None else (None, [])
        return pick_decode(workers, self.clock()), []

    def _remote_prefill(self, flight: Flight, decode: Worker) -> bool:
        # The decode worker's cached prefix is not known before Reserve: count the whole prompt.
        return (
            bool(decode.info.kv_address)
            and len(flight.prompt_token_ids) > self.local_prefill_max_tokens
            and self.registry.has_live("prefill")
        )

    async def _start_on(self, flight: Flight, decode: Worker, keys: list[bytes]) -> bool:
        """Try one decode worker; False if it refused, did not answer or is unreachable.
        `keys`: the prompt's block keys under its salt, if the choice looked at them."""
        flight.assign_decode(decode)
        if not self._remote_prefill(flight, decode):
            message = self.generate(flight)
            info = decode.info
            if self.peer_fetch and info.kv_salt:  # it prefills here: a peer may hold the prefix
                keys = keys or flight.keys.get(info.block_size, info.kv_salt)
                matched = self.prefix_index.match(decode.worker_id, keys) * info.block_size
                message.peer = prefill_leg.peer_hint(
                    self.registry, self.prefix_index, decode, flight.keys, matched, keys
                )
            if self.send(decode, message):
                return True
            self.refused(flight, decode, "unreachable")
            return False
        reply_future = asyncio.get_running_loop().create_future()
        flight.reserve_reply = reply_future
        # The reservation lives as long as the router waits for the reply and the prefill.
        deadline_s = self.reserve_timeout_s + self.prefill_deadline_s
        reserve = Reserve(flight.request_id, flight.prompt_token_ids, flight.params, deadline_s)
        try:
            if not self.send(decode, reserve):
                reply = ReserveReply(flight.request_id, ok=False, reason="unreachable")
            else:
                reply = await wait_for(reply_future, self.reserve_timeout_s)
        except asyncio.TimeoutError:
            # A reservation made after we gave up must not leak; the next try gets a new id so
            # that this one's late reply cannot be taken for it.
            self.send(decode, Abort(flight.request_id))
            self.rekey(flight)
            reply = ReserveReply(flight.request_id, ok=False, reason="no reply in time")
        finally:
            flight.reserve_reply = None
        if not reply.ok:
            self.refused(flight, decode, reply.reason)
            return False
        flight.num_decode_cached_tokens = reply.num_cached_tokens
        self.send_prefill(flight)
        return True

    def send_prefill(self, flight: Flight, exclude: frozenset[str] = frozenset()) -> None:
        """Ask a prefill worker to compute the flight's KV (`router.prefill_leg`)."""
        prefill_leg.send_prefill(self, flight, exclude)

    @staticmethod
    def generate(flight: Flight) -> Generate:
        return Generate(flight.request_id, flight.prompt_token_ids, flight.params)

    # ---- worker messages ------------------------------------------------------------------------

    def on_message(self, worker: Worker, msg: msgspec.Struct) -> None:
        """A `TokenBatch`, `TokenOutput`, `ReserveReply` or `RequestFailed` from a registered
        worker."""
        if isinstance(msg, TokenBatch):
            self.on_token_batch(worker, msg)
        elif isinstance(msg, ReserveReply):
            flight = self.flights.get(msg.request_id)
            future = (
                flight.reserve_reply if flight is not None and flight.decode is worker else None
            )
            if future is not None and not future.done():
                future.set_result(msg)
            elif msg.ok:  # nobody waits for this reservation any more
                self.send(worker, Abort(msg.request_id))
        elif isinstance(msg, TokenOutput):
            self._on_tokens(worker, msg)
        elif isinstance(msg, RequestFailed):
            self._on_failed(worker, msg)
        elif isinstance(msg, BlockBooksReply):
            self.registry.on_block_books(worker, msg)
        else:
            log.warning("unexpected %s from worker %s", type(msg).__name__, worker.worker_id)

    def on_token_batch(self, worker: Worker, msg: TokenBatch) -> None:
        """A decode step's tokens from `worker`: each output to its flight's event buffer."""
        on_tokens = self._on_tokens
        for out in msg.outputs:
            on_tokens(worker, out)

    def _on_tokens(self, worker: Worker, msg: TokenOutput) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None or flight.decode is not worker or flight.finished:
            if flight is None and not msg.finished:
                self.send(worker, Abort(msg.request_id))  # nobody listens: stop generating
            return
        if not flight.started_decoding:
            flight.started_decoding = True
            if flight.redispatched and flight.prefill is not None:
                self.send(flight.prefill, Abort(flight.request_id))  # a second prefill is moot
            flight.release_prefill()
        flight.output_token_ids += msg.token_ids
        if msg.finished:
            flight.finished = True
            flight.release_decode()
        flight.events.put_nowait((flight.index, msg))

    def _on_failed(self, worker: Worker, msg: RequestFailed) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None or flight.finished:
            return
        future = flight.reserve_reply
        if worker is flight.decode and future is not None and not future.done():
            future.set_result(ReserveReply(msg.request_id, ok=False, reason=msg.reason))
        elif worker is flight.decode or worker is flight.prefill:
            self.fail(
                flight,
                f"{msg.stage} failed on {worker.role} worker {worker.worker_id}: {msg.reason}",
            )

    def on_worker_dead(self, worker: Worker) -> None:
        """Move (or fail) what a dead worker was serving (`router.migration`)."""
        migration.on_worker_dead(self, worker)

    # ---- the end of a flight --------------------------------------------------------------------

    def release(self, flight: Flight, abort: bool = True) -> None:
        """The client is done with the flight: abort it on its workers if it still runs."""
        if not flight.finished and abort:
            for worker in (flight.decode, flight.prefill):
                if worker is not None:
                    self.send(worker, Abort(flight.request_id))
        flight.finished = True
        flight.release_prefill()
        flight.release_decode()
        self.flights.pop(flight.request_id, None)

    def fail(self, flight: Flight, reason: str, code: int = 503) -> None:
        log.warning("%s failed: %s", flight.base_id, reason)
        for worker in (flight.decode, flight.prefill):
            if worker is not None:
                self.send(worker, Abort(flight.request_id))  # releases its blocks, if it lives
        flight.finished = True
        flight.release_prefill()
        flight.release_decode()
        flight.events.put_nowait((flight.index, FlightFailed(reason, code)))

    # ---- bookkeeping ----------------------------------------------------------------------------

    def rekey(self, flight: Flight) -> None:
        self.flights.pop(flight.request_id, None)
        flight.attempt += 1
        self.flights[flight.request_id] = flight

    def refused(self, flight: Flight, decode: Worker, reason: str) -> None:
        # A flight waiting for room is refused about twice a second: its first refusal at info
        # level, the rest at debug (a minute of KV pressure was hundreds of lines a flight)
        flight.refusals += 1
        level = logging.INFO if flight.refusals == 1 else logging.DEBUG
        log.log(level, "%s: decode worker %s refused: %s", flight.base_id, decode.worker_id, reason)
        flight.release_decode()
        decode.refused_until_s = self.clock() + REFUSAL_BACKOFF_S
