"""The prefill leg of a flight: a prefill worker computes the prompt's KV for its decode worker.

Chooses the prefill worker (`router.policy.PrefillPolicy` over the registry's live prefill
workers), counts the prompt tokens it has left to compute on its load from this moment (the
prefix it holds is not computed again), files the prompt's block keys as pending there (a second
prompt with this prefix should follow, even before the worker reports the blocks), and sends
`Prefill` naming the decode worker and its reservation, with the KV transport for the pair. A
prefill worker that cannot be reached is skipped for the next; with none left, the reservation
is dropped and the decode worker prefills the prompt itself.

Peer fetch (`--kv-peer-fetch on`, the default): when another live worker (either role) has
reported more of the prompt's leading blocks (in its cache or its KV tier, `router.kv_index`) than
the chosen worker holds, the `Prefill` carries a `PeerHint` naming it, its KV address and how
many blocks it holds; the worker decides with its measured rates whether to pull them
(`kvtransfer.peer_fetch`). Only reported blocks count: a pending prompt's may not exist yet.

Functions over the `router.dispatch.Dispatcher`'s books, called by it once a decode worker
reserved room for the flight, and by `router.migration` when a prefill worker died.
Single-threaded, on the router's event loop.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.protocol import HEARTBEAT_INTERVAL_S, MAX_FETCH_BLOCKS, Abort, PeerHint, Prefill
from kvtransfer import choose_transport
from router.flight import Flight
from router.policy import Prompt, as_keys

if TYPE_CHECKING:
    from router.dispatch import Dispatcher
    from router.kv_index import PrefixIndex
    from router.registry import Registry
    from router.worker import Worker

# How long a worker waits for a peer's blocks before computing them itself: a fetch of thousands
# of tokens' KV takes milliseconds to a few hundred on any link we use; more means the peer is
# gone or stuck.
PEER_FETCH_TIMEOUT_S = 3.0
# A peer whose last heartbeat is older than this (two intervals) is not named: it may be stuck.
PEER_SILENT_S = 2 * HEARTBEAT_INTERVAL_S

log = logging.getLogger(__name__)


def send_prefill(d: Dispatcher, flight: Flight, exclude: frozenset[str] = frozenset()) -> None:
    """Ask a prefill worker (none in `exclude`) to compute the flight's KV and push it to its
    decode worker; with none left, the decode worker prefills."""
    decode = flight.decode
    assert decode is not None
    choice = d.prefill_policy.choose(d.registry.live_index("prefill"), flight.keys, exclude)
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
        peer=peer_hint(d.registry, d.prefix_index, prefill, flight.keys, choice.matched_tokens,
                       choice.keys) if d.peer_fetch else None,
    )  # fmt: skip
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


def peer_hint(
    registry: Registry,
    index: PrefixIndex,
    worker: Worker,
    prompt: Prompt,
    matched_tokens: int,
    keys: list[bytes],
    timeout_s: float = PEER_FETCH_TIMEOUT_S,
) -> PeerHint | None:
    """The live peer holding the most of the prompt's leading blocks beyond the `matched_tokens`
    the chosen worker holds (by their reported KV events), as a hint for `worker`; None when no
    peer holds more. `keys`: the prompt's block keys under the worker's salt ([]: taken from
    `prompt`, its token ids or its `PromptKeys`).
    Only workers holding the first block are looked at (`PrefixIndex.holders`), and only those
    whose heartbeats are on time."""
    info = worker.info
    if not info.kv_salt or not info.kv_address:
        return None  # reports no KV events, or cannot receive a peer's push
    if not keys:
        keys = as_keys(prompt).get(info.block_size, info.kv_salt)
    keys = keys[: min((len(prompt) - 1) // info.block_size, MAX_FETCH_BLOCKS)]
    if not keys:
        return None
    silent_before = registry.clock() - PEER_SILENT_S
    best, best_blocks = None, matched_tokens // info.block_size
    for peer_id in sorted(index.holders(keys[0])):
        peer = registry.get(peer_id)
        if peer is None or peer is worker or peer.dead_reason or not peer.info.kv_address:
            continue
        if peer.last_seen_s < silent_before:
            continue  # heartbeats late: stuck or dead, not yet declared so; it would not answer
        if peer.info.kv_salt != info.kv_salt or peer.info.block_size != info.block_size:
            continue  # another model, dtype or layout: its blocks are not ours
        if peer.info.host != info.host and (
            _loopback(peer.info.kv_address) or _loopback(info.kv_address)
        ):
            continue  # either end bound to its own host only (a prefill worker's default)
        held = len(index.tiers_of(peer_id, keys))
        # On a tie a prefill worker serves rather than a decode worker, whose loop paces its
        # streams' tokens (a decode worker holds every prompt whose KV it received).
        prefer = best is not None and best.role == "decode" and peer.role == "prefill"
        if held > best_blocks or (held == best_blocks and prefer):
            best, best_blocks = peer, held
    if best is None:
        return None
    both = set(info.transports) & set(best.info.transports)
    transport = "shm" if info.host == best.info.host and "shm" in both else "tcp"
    return PeerHint(best.worker_id, best.info.kv_address, best_blocks, transport, timeout_s)


def _loopback(address: str) -> bool:
    """Whether a tcp://HOST:PORT address can only be reached from its own host."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"
