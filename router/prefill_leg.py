"""The prefill leg of a flight: a prefill worker computes the prompt's KV for its decode worker.

Chooses the prefill worker (`router.policy.PrefillPolicy` over the registry's live prefill
workers), counts the prompt tokens it has left to compute on its load from this moment (the
prefix it holds is not computed again), files the prompt's block keys as pending there (a second
prompt with this prefix should follow, even before the worker reports the blocks), and sends
`Prefill` naming the decode worker and its reservation, with the KV transport for the pair. A
prefill worker that cannot be reached is skipped for the next; with none left, the reservation
is dropped and the decode worker prefills the prompt itself.

Functions over the `router.dispatch.Dispatcher`'s books, called by it once a decode worker
reserved room for the flight, and by `router.migration` when a prefill worker died.
Single-threaded, on the router's event loop.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.protocol import Abort, Prefill
from kvtransfer import choose_transport
from router.flight import Flight

if TYPE_CHECKING:
    from router.dispatch import Dispatcher

log = logging.getLogger(__name__)


def send_prefill(d: Dispatcher, flight: Flight, exclude: frozenset[str] = frozenset()) -> None:
    """Ask a prefill worker (none in `exclude`) to compute the flight's KV and push it to its
    decode worker; with none left, the decode worker prefills."""
    decode = flight.decode
    assert decode is not None
    choice = d.prefill_policy.choose(
        d.registry.live_index("prefill"), flight.prompt_token_ids, exclude
    )
    if choice is None:
        prefill_locally(d, flight)
        return
    prefill = choice.worker
    # What the worker has to compute: the prompt less the prefix it holds (at least one token).
    num_tokens = max(len(flight.prompt_token_ids) - choice.matched_tokens, 1)
    flight.assign_prefill(prefill, num_tokens)
    prefill.num_prefill_dispatched += 1
    prefill.prefix_matched_tokens += choice.matched_tokens
    if choice.keys:  # a second prompt with this prefix should find it here, even right now
        d.prefix_index.add_pending(prefill.worker_id, choice.keys)
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
        deadline_s=d.prefill_deadline_s,
    )
    if not d.send(prefill, message):
        flight.release_prefill()
        send_prefill(d, flight, exclude | {prefill.worker_id})


def prefill_locally(d: Dispatcher, flight: Flight) -> None:
    """No prefill worker left: drop the reservation and let the decode worker prefill."""
    decode = flight.decode
    assert decode is not None
    log.info("%s: no prefill worker left; prefilling on %s", flight.base_id, decode.worker_id)
    d.send(decode, Abort(flight.request_id))
    d.rekey(flight)
    if not d.send(decode, d.generate(flight)):
        d.fail(flight, f"decode worker {decode.worker_id} is unreachable")
