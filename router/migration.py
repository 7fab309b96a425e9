"""Moving flights off workers that died or stalled, so that their clients see a pause, not an error.

A dead decode worker's flights move to another decode worker, which prefills the prompt and the
tokens relayed so far and goes on from there (`migrate`, then `resume`: its stop rules,
penalties, grammar and seeded generator continue where they were); at most `MAX_MIGRATIONS`
times per flight, then the flight fails. A flight still waiting for its Reserve reply is refused
(the dispatcher tries another worker). A dead prefill worker's flights that have not started
decoding go to another prefill worker (or, with none left, prefill on the decode worker itself).

Functions over the `router.dispatch.Dispatcher`'s books, called by it (`on_worker_dead`, from the
control plane's liveness check). Single-threaded, on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from common.protocol import Abort, Generate, ReserveReply
from router.flight import Flight
from router.policy import pick_decode
from router.registry import Worker

if TYPE_CHECKING:
    from router.dispatch import Dispatcher

log = logging.getLogger(__name__)

MAX_MIGRATIONS = 2  # moves to another decode worker per flight; then it fails as before


def on_worker_dead(d: Dispatcher, worker: Worker) -> None:
    """Move (or fail) what a dead decode worker was serving; move a dead prefill worker's work."""
    for flight in list(d.flights.values()):
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
                migrate(d, flight, worker)
            else:
                d.fail(flight, f"decode worker {worker.worker_id} stopped responding")
        elif flight.prefill is worker:
            log.warning(
                "%s: prefill worker %s died; re-dispatching", flight.base_id, worker.worker_id
            )
            flight.release_prefill()
            flight.redispatched = True
            d.send_prefill(flight, frozenset({worker.worker_id}))


def migrate(d: Dispatcher, flight: Flight, dead: Worker) -> None:
    """Move a flight off a decode worker that died or stalled: another decode worker prefills
    its prompt and the tokens relayed so far and goes on from there."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no event loop to look for a worker in
        d.fail(flight, f"decode worker {dead.worker_id} stopped responding")
        return
    log.warning(
        "%s: decode worker %s stopped after %d tokens; moving it to another",
        flight.base_id, dead.worker_id, len(flight.output_token_ids),
    )  # fmt: skip
    if flight.prefill is not None:  # its KV has nowhere to go now
        d.send(flight.prefill, Abort(flight.request_id))
        flight.release_prefill()
    flight.release_decode()
    d.rekey(flight)  # a late output of the dead worker is not taken for the new one's
    flight.migrations += 1
    d.num_migrations += 1
    task = loop.create_task(resume(d, flight))
    d.moving.add(task)
    task.add_done_callback(d.moving.discard)


async def resume(d: Dispatcher, flight: Flight) -> None:
    """Start a migrated flight on the least loaded live decode worker, within the queue
    timeout; else it fails as it would have without migration."""
    deadline = d.clock() + d.queue_timeout_s
    while not flight.finished:
        decode = pick_decode(d.registry.live_index("decode"), d.clock())
        if decode is not None:
            flight.assign_decode(decode)
            tokens = flight.prompt_token_ids + flight.output_token_ids
            message = Generate(
                flight.request_id, tokens, flight.params, len(flight.output_token_ids)
            )
            if d.send(decode, message):
                return
            d.refused(flight, decode, "unreachable")
        if d.clock() >= deadline:
            d.fail(flight, "its decode worker stopped and no other could take it")
            return
        await asyncio.sleep(d.queue_poll_s)
