"""What prefill and decode workers share: the routers they serve, heartbeats, the main loop.

Owns the worker's links to its routers (`common.runtime.router_link`: one per router, each with
its control socket and heartbeat thread; a worker serves every router it is given or finds
behind a DNS name, and accepts work from each), which router each request came from (replies,
token outputs and failures go back to that one only; when its connection drops, its requests
are aborted and their blocks freed, while the other routers' requests go on), re-registration
when a router forgets the worker, draining: on the first SIGTERM a worker stops taking new work
(its heartbeats say so, and the routers stop dispatching to it), finishes what it has, then
exits; a second signal exits at once. Each heartbeat carries the worker's progress (steps run,
layers, idle turns), so a router can tell a stuck loop from a long step. After each step it
reports its prefix-cache changes to every router (`KVEvents`: block keys stored and evicted,
per tier: the cache, and the KV tier's RAM and disk (`common.runtime.kv_events`), numbered per
router; a full snapshot after registering or when a router asks with `KVResync`),
which feed prefix-aware routing. Under `pdserve up` on the CPU, before each step it takes the
cores idle workers on the machine lend (`common.runtime.cores`), and lends its own while it
waits. Asked with `BlockBooksQuery`, it answers with its engine's block
audit. Both roles own a KV sender and a KV receiver (`attach_kv`): besides the prompt handoff
(prefill pushes, decode receives) a worker fetches prefixes from peers and answers their fetches
(`common.runtime.worker_kv`): a dispatch carrying a `PeerHint` waits while the fetch runs, then is
handled as if it came now; one whose grammar is new waits while a thread compiles it
(`common.runtime.worker_grammar`). `WorkerBase` is subclassed by prefill/worker.py and
decode/worker.py.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq

from common import protocol
from common.engine.engine import Engine
from common.protocol import Heartbeat, KVEvents, Register, RegisterAck
from common.runtime import cores, kv_events
from common.runtime.auth import ClusterKeys
from common.runtime.router_link import (
    RESOLVE_INTERVAL_S,
    ControlConnection,
    Heartbeater,
    RouterLink,
    engine_heartbeat,
    register,
    register_any,
    resolve_routers,
)
from common.runtime.worker_grammar import WorkerGrammar
from common.runtime.worker_kv import WorkerKV

if TYPE_CHECKING:
    from kvtransfer.peer_fetch import PeerFetcher
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.sender import KVSender

__all__ = ["ControlConnection", "Heartbeater", "WorkerBase", "engine_heartbeat", "register"]

log = logging.getLogger(__name__)


# The loop's wait with no work at all and nothing in flight. Anything that is work ends it at
# once (a command from a router, a transfer, a peer's fetch, an ack); only a router's request to
# register again, a dropped router and a drain are seen that late. Each wait's wake costs CPU on
# cores a busy worker beside it computes on: at 10 ms an idle worker used 37 ms of CPU a second
# (a 2-core VM; the router 14 ms), at 100 ms 4-5 ms.
IDLE_WAIT_MS = 100


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


class WorkerBase(WorkerGrammar, WorkerKV):
    """The loop around one engine: commands in, `step()` work, heartbeats, drain on SIGTERM."""

    role: protocol.Role
    # The loop's wait with nothing to compute but work in flight (KV on its way, acks, fetches,
    # a grammar compiling). All but the last end `_wait` when they come, so it waits longer
    # than a turn's few microseconds: deadlines (a transfer's, a fetch's, a reservation's: 0.1 s
    # and more) and a finished compile are seen 10 ms late at most. At 2 ms a decode worker
    # waiting for a 600-token prompt's KV used 45-48 ms of CPU a request (on the cores the
    # prefill worker computed that KV on), at 10 ms 30-38.
    busy_wait_ms = 10

    def __init__(
        self,
        engine: Engine,
        router_address: str,
        worker_id: str,
        context: zmq.Context | None,
        keys: ClusterKeys | None = None,
    ) -> None:
        """`router_address`: one router or several, comma-separated; host names may resolve to
        several (`router_link.resolve_routers`)."""
        self.engine = engine
        self.worker_id = worker_id
        self.context = context or zmq.Context.instance()
        self.keys = keys  # from the cluster secret (common.runtime.auth); None: no authentication
        self.router_spec = router_address
        self.links: dict[str, RouterLink] = {}
        self.origin: dict[str, RouterLink] = {}  # request id -> the router it came from
        addresses = resolve_routers(router_address) or [router_address.split(",")[0].strip()]
        for address in addresses:
            self._add_link(address)
        self.resolved_at = time.monotonic()
        self.kv_address = ""
        self.kv_failures = 0
        self.sender: KVSender | None = None  # set by attach_kv
        self.receiver: KVReceiver | None = None
        self.fetcher: PeerFetcher | None = None
        self.deferred: dict[str, msgspec.Struct] = {}  # request id -> dispatch waiting on a fetch
        self.compiling = {}  # request id -> (its grammar's compile, the dispatch waiting on it)
        self.peer_served_tokens = 0  # tokens of blocks pushed to peers that asked for them
        self.running = True
        self.draining = False
        self.drain_started = 0.0
        self.engine.pool.track_events = True
        if self.engine.tier is not None:
            self.engine.tier.track_events = True
        self.loop_count = 0  # turns of `run`'s loop with no engine work waiting (see `progress`)
        self.registered = False  # a router accepted our Register (read by the readiness probe)
        self.started = False  # heartbeats run (new links start theirs at once)
        # threads borrowed from idle workers on this machine (`pdserve up`; CPU engines only)
        self.cores: cores.CoreLender | None = None
        if os.environ.get(cores.LEDGER_ENV) and engine.runner.device.type == "cpu":
            self.cores = cores.from_env(torch.get_num_threads(), torch.set_num_threads)
            engine.runner.model.between_layers = self.cores.give_back  # inside long steps too

    def _add_link(self, address: str) -> RouterLink:
        link = RouterLink(address, self.worker_id, self.context, self._heartbeat, self.keys)
        self.links[address] = link
        return link

    @property
    def control(self) -> ControlConnection:
        """The first router's control connection (single-router callers and tests)."""
        return next(iter(self.links.values())).control

    @property
    def heartbeat(self) -> Heartbeater:
        """The first router's heartbeat thread (single-router callers and tests)."""
        return next(iter(self.links.values())).heartbeat

    def _heartbeat(self, link: RouterLink) -> Heartbeat:
        beat = engine_heartbeat(
            self.worker_id, self.engine, lambda: {
                **self.counters(), **self.peer_fetch_counters(),
                **(self.cores.counters() if self.cores is not None else {}),
            },
        )  # fmt: skip
        waiting, tokens = self._compiling_load()
        beat.num_waiting += waiting
        beat.queued_prefill_tokens += tokens
        beat.loop_count = self.progress
        beat.draining = self.draining
        beat.kv_events_seq = link.kv_events_seq
        beat.histograms = self.histograms()
        return beat

    @property
    def progress(self) -> int:
        """Engine steps that ran a batch, decoder layers run (it moves inside a long step too: a
        2k-token prefill on a slow, busy CPU can take over 30 s) and loop turns while the engine
        has no work or waits for KV on its way. A loop that turns while work waits and nothing
        runs (sequences that can never get blocks) stands still, as a stuck one does. The
        router's stall check and the liveness probe read it."""
        return self.loop_count + self.engine.num_steps + self.engine.runner.model.layers_run

    def histograms(self) -> dict[str, protocol.HistogramSnapshot]:
        """Cumulative histograms for the router's /metrics (none by default)."""
        return {}

    def publish_kv_events(self) -> None:
        """Tell every router which prefix blocks this worker (its cache and its KV tier) gained
        or lost since the last call (a full snapshot to one that needs it)."""
        chunk = kv_events.chunk_keys(self.engine)
        changes = kv_events.change_messages(
            self.worker_id, kv_events.drain_changes(self.engine), chunk
        )
        snapshot: list[KVEvents] | None = None
        for link in self.links.values():
            messages = changes
            if link.kv_snapshot_due:
                if snapshot is None:
                    keys = kv_events.snapshot(self.engine)
                    snapshot = kv_events.snapshot_messages(self.worker_id, keys, chunk)
                link.kv_snapshot_due = False
                messages = snapshot
            for message in messages:
                link.kv_events_seq += 1
                link.control.send(msgspec.structs.replace(message, seq=link.kv_events_seq))

    def send_registration(self, link: RouterLink) -> None:
        link.control.send(self.registration(link))
        link.kv_snapshot_due = True  # the router may have forgotten everything about us

    def reply(self, request_id: str, message: msgspec.Struct) -> None:
        """Send `message` about a request to the router it came from; a final one (the last
        output, a failure, a refused reservation) ends the request's tie to that router. A
        request of no known router (handed to `handle` directly) answers to the first one; one
        whose router is gone was aborted with it and produces nothing more."""
        link = self.origin.get(request_id) or next(iter(self.links.values()))
        if _is_final(message):
            self.origin.pop(request_id, None)
        link.control.send(message)

    def send_token_outputs(self, outputs: list[protocol.TokenOutput]) -> None:
        """One step's outputs, grouped by the router each request came from: one `TokenBatch`
        frame per router (the router decodes it once, not once per token)."""
        groups: dict[int, tuple[RouterLink, list[protocol.TokenOutput]]] = {}
        for out in outputs:
            link = self.origin.get(out.request_id) or next(iter(self.links.values()))
            if _is_final(out):
                self.origin.pop(out.request_id, None)
            groups.setdefault(id(link), (link, []))[1].append(out)
        for link, group in groups.values():
            link.control.send(protocol.TokenBatch(group))

    def forget(self, request_id: str) -> None:
        """The request ended here without a final message to its router (e.g. its KV was sent)."""
        self.origin.pop(request_id, None)

    def counters(self) -> dict[str, float]:
        return {"kv_transfer_failures_total": self.kv_failures}

    def registration(self, link: RouterLink | None = None) -> Register:
        from kvtransfer.payload import kv_layout

        transports = ["tcp", "shm"]
        if self.engine.runner.device.type == "cuda" and self.engine.runner.kv_scales is None:
            transports.append("cuda_ipc")  # an 8-bit cache's scales travel by tcp or shm only
        layout = kv_layout(self.engine.runner.kv_cache)  # what a KV transfer depends on
        return Register(
            version=protocol.PROTOCOL_VERSION,
            role=self.role,
            worker_id=self.worker_id,
            model=str(self.engine.config.model),
            block_size=self.engine.config.block_size,
            num_blocks=self.engine.pool.num_blocks,
            max_model_len=self.engine.max_model_len,
            dtype=str(layout["dtype"]),
            host=socket.gethostname(),
            kv_address=self.kv_address,
            transports=transports,
            kv_salt=self.engine.block_manager.salt,
            num_layers=int(layout["num_layers"]),
            num_kv_heads=int(layout["num_kv_heads"]),
            head_dim=int(layout["head_dim"]),
            heartbeat_identity=(link or next(iter(self.links.values()))).heartbeat.identity,
        )

    def stop_on_signals(self) -> None:
        """First SIGTERM/SIGINT: drain; second: stop now."""

        def on_signal(signum, frame):
            if self.draining:
                self.running = False
            else:
                log.info("draining: finishing in-flight requests, taking no new ones")
                self.draining = True
                self.drain_started = time.monotonic()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> None:
        early = register_any(list(self.links.values()), self.registration)
        self.registered = True
        for link in self.links.values():
            link.start()
        self.started = True
        for link, message in early:  # sent the moment the router accepted us: not lost
            self._dispatch(link, message)
        try:
            while self.running and not self._drained():
                self.turn()
        finally:
            self.close()

    def turn(self) -> None:
        """One turn of the main loop: routers come and go, their messages, one step, KV events."""
        self._watch_routers()
        # Nothing to compute (maybe KV or acks in flight): wait briefly instead of spinning,
        # so a worker waiting for a transfer leaves the cores to the others. A peer's fetch being
        # answered is work (a slice a turn): waiting between its slices would pace it at 10 ms.
        if not self.engine.has_unfinished() and not self.serving_peers():
            if self.cores is not None:
                self.cores.before_step(busy=False)  # lend our cores while we wait
            self._wait(IDLE_WAIT_MS if self.is_idle() else self.busy_wait_ms)
        for link in list(self.links.values()):
            for message in link.control.poll(timeout_ms=0):
                self._dispatch(link, message)
        self._handle_compiled()
        if self.cores is not None:
            self.cores.before_step(busy=self.engine.has_unfinished())
        with self._core_for_compiles():
            self.step()
        self.publish_kv_events()
        # A turn with no work counts, and so does one spent waiting for KV still on its way
        # (a waiting sequence may need the blocks held for it: the wait ends when it arrives or
        # its reservation expires). Turns while work waits and nothing runs do not.
        if not self.engine.has_unfinished() or self.engine.reserved:
            self.loop_count += 1

    def _wait(self, timeout_ms: int) -> None:
        """Up to `timeout_ms`, or until a command comes from any router, a message reaches the
        kv socket (a transfer, a peer's fetch or its answer) or an ack reaches the socket of a
        peer this worker's sender has a transfer in flight to (`KVSender.ack_sockets`): each is
        handled this turn, not after the wait."""
        poller = zmq.Poller()
        for link in self.links.values():
            poller.register(link.control.sock, zmq.POLLIN)
        if self.receiver is not None:
            poller.register(self.receiver.socket, zmq.POLLIN)
        if self.sender is not None:
            for sock in self.sender.ack_sockets():
                poller.register(sock, zmq.POLLIN)
        poller.poll(timeout_ms)

    def _watch_routers(self) -> None:
        """Re-register where a router forgot us; abort the requests of a router whose connection
        dropped; pick up routers that appeared behind a host name, drop those that vanished."""
        for link in list(self.links.values()):
            if link.heartbeat.reregister.is_set():  # router restarted or declared us dead
                link.heartbeat.reregister.clear()
                self.send_registration(link)
            if link.disconnected():
                self._router_gone(link, "its connection dropped")
        if time.monotonic() - self.resolved_at < RESOLVE_INTERVAL_S:
            return
        self.resolved_at = time.monotonic()
        addresses = resolve_routers(self.router_spec)
        if not addresses:
            return  # DNS down for now: keep what we have
        for address in addresses:
            if address not in self.links:
                log.info("router %s appeared: registering with it", address)
                link = self._add_link(address)
                self.send_registration(link)
                if self.started:
                    link.start()
        for address, link in list(self.links.items()):
            if address not in addresses:
                self._router_gone(link, "it is no longer behind " + self.router_spec)
                del self.links[address]
                link.close()

    def _router_gone(self, link: RouterLink, why: str) -> None:
        """Abort every request that router sent: nobody is left to relay its tokens."""
        orphans = [rid for rid, origin in self.origin.items() if origin is link]
        for rid in orphans:
            del self.origin[rid]
            self._abort(rid)
        link.registered = False
        if orphans:
            log.warning("router %s is gone (%s): aborted its %d requests", link.address, why,
                        len(orphans))  # fmt: skip

    def _drained(self) -> bool:
        # Work sent before the router saw a draining heartbeat may still arrive: wait a grace.
        grace_s = 2.5 * protocol.HEARTBEAT_INTERVAL_S
        return self.draining and self.is_idle() and time.monotonic() - self.drain_started > grace_s

    def _dispatch(self, link: RouterLink, message: protocol.ControlMessage) -> None:
        if isinstance(message, RegisterAck):
            if not message.accepted and message.reason != protocol.REREGISTER_REASON:
                log.error("the router at %s dropped this worker: %s", link.address, message.reason)
                link.registered = False
                if not any(other.registered for other in self.links.values()):
                    self.running = False
            elif not message.accepted:
                self.send_registration(link)
            else:
                link.registered = True
        elif isinstance(message, protocol.KVResync):
            link.kv_snapshot_due = True
        elif isinstance(message, protocol.Abort):
            if self.origin.get(message.request_id) is link:  # only its own router may abort it
                del self.origin[message.request_id]
                self._abort(message.request_id)
        elif isinstance(message, protocol.BlockBooksQuery):
            link.control.send(self.block_books(message.query_id))
        else:
            request_id = getattr(message, "request_id", None)
            if isinstance(request_id, str):
                if self.origin.setdefault(request_id, link) is not link:
                    log.warning("request %s came from two routers: ignoring %s's", request_id,
                                link.address)  # fmt: skip
                    return
            if not self._compile_first(message) and not self._fetch_first(message):
                self.handle(message)

    def block_books(self, query_id: int) -> protocol.BlockBooksReply:
        """The engine's block audit, for the router's /debug/block_books (leak checks)."""
        b = self.engine.block_books()
        return protocol.BlockBooksReply(
            self.worker_id, query_id, b.total, b.free, b.cached, b.running, b.reserved, b.held,
            b.errors,
        )  # fmt: skip

    def handle(self, message: protocol.ControlMessage) -> None:
        """One router command (not Abort or RegisterAck, handled above)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def step(self) -> None:
        """Transfers and one engine step; called in a loop."""
        raise NotImplementedError

    def is_idle(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        self._close_compiler()
        for link in self.links.values():
            link.close()
        if self.cores is not None:
            self.engine.runner.model.between_layers = None
            self.cores.close()
            self.cores = None
        server = getattr(self, "fetch_server", None)  # set by attach_kv
        if server is not None:  # first: its answer's payload is a view into a sender's segment
            server.close()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.engine.tier is not None:
            self.engine.tier.close()  # its disk files: the next start would delete them anyway


def _is_final(message: msgspec.Struct) -> bool:
    """The last message a router gets about a request from this worker."""
    if isinstance(message, protocol.TokenOutput):
        return message.finished
    if isinstance(message, protocol.ReserveReply):
        return not message.ok
    return isinstance(message, protocol.RequestFailed)
