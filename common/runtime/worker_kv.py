"""A worker's KV sockets and peer fetches: the part of `common.runtime.worker.WorkerBase` that
touches kvtransfer.

`WorkerKV` is mixed into WorkerBase, whose `__init__` sets the attributes it reads (`engine`,
`sender`, `receiver`, `fetcher`, `deferred`, `peer_served_tokens`, `draining`) and which provides
`handle` and `abort`. It binds the worker's KV address (`attach_kv`), polls both KV sockets once
per turn (`poll_kv`: the worker's own transfers, peers' fetches answered a slice a turn through
`kvtransfer.peer_serve.FetchServer`, fetch answers settled; `serving_peers` keeps the loop from
waiting between an answer's slices), starts the fetch a dispatch's
`PeerHint` offers (`_fetch_first`: the dispatch waits in `deferred`, then is handled as if it came
now) and counts what was fetched and served.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from common import protocol

if TYPE_CHECKING:
    from common.engine.engine import Engine
    from kvtransfer.peer_fetch import PeerFetcher
    from kvtransfer.peer_serve import FetchServer
    from kvtransfer.receiver import KVReceiver, ReceivedKV
    from kvtransfer.sender import KVSender, TransferResult

log = logging.getLogger("common.runtime.worker")  # the worker's log, as before the split


class WorkerKV:
    """The KV side of a worker (see the module docstring)."""

    engine: Engine
    sender: KVSender | None
    receiver: KVReceiver | None
    fetcher: PeerFetcher | None
    fetch_server: FetchServer
    deferred: dict[str, msgspec.Struct]
    peer_served_tokens: int
    draining: bool
    kv_address: str

    def handle(self, message: protocol.ControlMessage) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def attach_kv(
        self, sender: KVSender, receiver: KVReceiver, advertise_host: str | None = None
    ) -> None:
        """The worker's KV sockets: its address (`Register.kv_address`: where peers push KV
        and send fetches) is the receiver's, with `advertise_host` for its host when given."""
        from kvtransfer.peer_fetch import PeerFetcher
        from kvtransfer.peer_serve import FetchServer

        self.sender, self.receiver = sender, receiver
        address = receiver.address
        if advertise_host:
            address = f"tcp://{advertise_host}:{address.rsplit(':', 1)[1]}"
        self.kv_address = address
        self.fetcher = PeerFetcher(self.engine, sender, address)
        self.fetch_server = FetchServer(self.engine, sender)

    def poll_kv(self) -> tuple[list[ReceivedKV], list[TransferResult]]:
        """Transfers that ended on either socket and are the worker's own (fetches are settled
        here); peers' fetches answered; dispatches whose fetch ended handled now. Called by the
        subclasses' `step`, once per turn."""
        from kvtransfer import peer_fetch

        assert self.sender is not None and self.receiver is not None and self.fetcher is not None
        fetcher = self.fetcher
        received = [r for r in self.receiver.poll(self._resolve_kv) if not fetcher.on_received(r)]
        for fetch in self.receiver.take_fetches():
            self.fetch_server.add(fetch)
        # a bounded slice of the answers a turn: the worker's own step is not held up for long
        self.peer_served_tokens += self.fetch_server.step() * self.engine.config.block_size
        sent = [r for r in self.sender.poll() if not peer_fetch.settle(r)]
        for request_id in fetcher.poll():
            message = self.deferred.pop(request_id, None)
            if message is not None:
                self.handle(msgspec.structs.replace(message, peer=None))
        return received, sent

    def serving_peers(self) -> bool:
        """Peers' fetches with blocks still to copy here: work for the next turn (a slice a turn,
        `FetchServer.step`), so the loop must not wait between turns while this holds."""
        server = getattr(self, "fetch_server", None)  # set by attach_kv
        return server is not None and server.busy()

    def _resolve_kv(self, header: protocol.KVHeader) -> list[int] | None:
        assert self.fetcher is not None
        if self.fetcher.owns(header.request_id):
            return self.fetcher.resolve(header)
        return self.resolve_kv(header)

    def resolve_kv(self, header: protocol.KVHeader) -> list[int] | None:
        """The blocks a pushed transfer (not a fetch's answer) is written to; None: refuse it."""
        return None

    def _fetch_first(self, message: protocol.ControlMessage) -> bool:
        """Start the peer fetch a dispatch's hint offers, if it pays; True: the dispatch waits
        for it in `deferred`."""
        hint = getattr(message, "peer", None)
        if hint is None or self.fetcher is None or self.draining:
            return False
        rid = message.request_id  # type: ignore[union-attr]
        try:
            started = self.fetcher.start(rid, message.prompt_token_ids, message.params, hint)  # type: ignore[union-attr]
        except Exception:  # a fetch is an optimisation: whatever breaks, compute instead
            log.exception("peer fetch for %s failed to start", rid)
            started = False
        if started:
            self.deferred[rid] = message
        return started

    def _abort(self, request_id: str) -> None:
        """Abort a request, a dispatch waiting on its fetch included."""
        if self.deferred.pop(request_id, None) is not None and self.fetcher is not None:
            self.fetcher.cancel(request_id)
        self.abort(request_id)

    def peer_fetch_counters(self) -> dict[str, float]:
        counters = {"kv_peer_served_tokens_total": float(self.peer_served_tokens)}
        if self.fetcher is not None:
            counters.update(self.fetcher.stats())
        return counters
