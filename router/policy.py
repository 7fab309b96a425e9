"""Which worker serves a request: the decode choice, the prefill choice and the KV transport.

Owns the routing decisions and nothing else: decode workers are chosen least loaded (running plus
reserved sequences), skipping any that refused a reservation moments ago; prefill workers by the
`--routing` policy (round_robin, least_loaded by prompt tokens queued since dispatch, or prefix,
which for now behaves as least_loaded); the transport by locality. Called by `router.dispatch`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from common.protocol import Register
from router.registry import Worker

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix")


def pick_decode(workers: Sequence[Worker], now_s: float) -> Worker | None:
    """The least loaded decode worker that has not refused recently; None if every one has."""
    ready = [w for w in workers if w.refused_until_s <= now_s]
    if not ready:
        return None
    return min(ready, key=lambda w: (w.decode_load, w.worker_id))


class PrefillPolicy:
    """Chooses a prefill worker for a prompt; holds the round-robin position."""

    def __init__(self, routing: str = "least_loaded") -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        self.routing = routing
        self._next = 0

    def pick(
        self,
        workers: Sequence[Worker],
        prompt_token_ids: Sequence[int],
        exclude: Collection[str] = (),
    ) -> Worker | None:
        candidates = sorted(
            (w for w in workers if w.worker_id not in exclude), key=lambda w: w.worker_id
        )
        if not candidates:
            return None
        if self.routing == "round_robin":
            worker = candidates[self._next % len(candidates)]
            self._next += 1
            return worker
        # least_loaded, and prefix until the block-key index exists (then: match minus load).
        return min(candidates, key=lambda w: (w.prefill_load, w.num_in_flight))


def choose_transport(prefill: Register, decode: Register) -> str:
    """'shm' between workers on one host that both support it, else 'tcp'."""
    if prefill.host == decode.host and "shm" in prefill.transports and "shm" in decode.transports:
        return "shm"
    return "tcp"
