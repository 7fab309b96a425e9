"""What prefill and decode workers share: the router connection, heartbeats, the main loop.

Owns the worker's DEALER socket to the router's control socket (register, receive commands, send
replies and token outputs), a heartbeat thread with its own socket (so heartbeats keep flowing
while a long prefill step holds the main thread; its random identity travels in `Register`, and
each heartbeat carries the main loop's turn count, so the router can tell a stuck loop from a
long step), re-registration when the router forgets the
worker, draining: on the first SIGTERM a worker stops taking new work (its heartbeats say so,
and the router stops dispatching to it), finishes what it has, then exits; a second signal exits
at once. After each step it reports its prefix-cache changes (`KVEvents`: block keys stored and
evicted, numbered; a full snapshot after registering or when the router asks with `KVResync`),
which feed the router's prefix-aware routing. Asked with `BlockBooksQuery`, it answers with its
engine's block audit. `WorkerBase` is subclassed by prefill/worker.py and
decode/worker.py.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from common import protocol
from common.engine.engine import Engine
from common.protocol import Heartbeat, KVEvents, Register, RegisterAck
from common.runtime.auth import ClusterKeys

log = logging.getLogger(__name__)


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


class ControlConnection:
    """DEALER to the router; `poll` returns decoded commands, malformed frames are dropped."""

    def __init__(
        self,
        router_address: str,
        worker_id: str,
        context: zmq.Context,
        keys: ClusterKeys | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.router_address = router_address
        self.sock = context.socket(zmq.DEALER)
        if keys is not None:  # the cluster secret: CURVE to the router
            keys.connect_as_client(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_CONTROL_MESSAGE_BYTES)
        self.sock.connect(router_address)

    def send(self, message: msgspec.Struct) -> None:
        self.sock.send(protocol.encode(message), copy=False)

    def poll(self, timeout_ms: int = 0) -> list[protocol.ControlMessage]:
        """Every command waiting now (waiting up to timeout_ms for the first one)."""
        messages = []
        if not self.sock.poll(timeout_ms):
            return messages
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(protocol.decode_control(frame))
            except protocol.ProtocolError as exc:
                log.warning("dropping a bad control frame: %s", exc)

    def close(self) -> None:
        self.sock.close()


class Heartbeater(threading.Thread):
    """Sends a `Heartbeat` every HEARTBEAT_INTERVAL_S on a socket of its own. It never registers:
    when the router answers a beat with a refused `RegisterAck` (it restarted, or declared this
    worker dead) it sets `reregister`, and the main loop sends `Register` again."""

    def __init__(
        self,
        router_address: str,
        worker_id: str,
        context: zmq.Context,
        make_heartbeat: Callable[[], Heartbeat],
        keys: ClusterKeys | None = None,
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.keys = keys
        self.router_address = router_address
        self.worker_id = worker_id
        self.context = context
        self.make_heartbeat = make_heartbeat
        # Random, so that no other process can connect under it before this thread does; the
        # router accepts this worker's heartbeats from this identity (named in Register) only.
        self.identity = f"{worker_id}#heartbeat-{secrets.token_hex(8)}".encode()
        self.stop_event = threading.Event()
        self.reregister = threading.Event()  # the router forgot us: the main loop registers again

    def run(self) -> None:
        sock = self.context.socket(zmq.DEALER)
        if self.keys is not None:
            self.keys.connect_as_client(sock)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.router_address)
        try:
            while not self.stop_event.wait(protocol.HEARTBEAT_INTERVAL_S):
                try:
                    sock.send(protocol.encode(self.make_heartbeat()), zmq.NOBLOCK)
                    while sock.poll(0):
                        reply = protocol.decode_control(sock.recv())
                        if isinstance(reply, RegisterAck) and not reply.accepted:
                            self.reregister.set()
                except zmq.Again:
                    pass  # router gone for now: the next beat tries again
                except Exception:  # a stats read racing the engine must not kill heartbeats
                    log.exception("heartbeat failed")
        finally:
            sock.close()

    def stop(self) -> None:
        self.stop_event.set()


def engine_heartbeat(
    worker_id: str, engine: Engine, extra_counters: Callable[[], dict[str, float]] | None = None
) -> Heartbeat:
    stats = engine.stats()
    counters = {k: float(v) for k, v in stats.items() if k.endswith("_total")}
    if extra_counters is not None:
        counters.update(extra_counters())
    queued = sum(
        s.num_tokens - s.num_computed_tokens for s in list(engine.scheduler.waiting)
    ) + sum(s.num_tokens - s.num_computed_tokens - 1 for s in list(engine.scheduler.running))
    return Heartbeat(
        worker_id=worker_id,
        num_running=int(stats["num_requests_running"]),
        num_waiting=int(stats["num_requests_waiting"]) + len(engine.reserved),
        num_free_blocks=int(stats["num_free_blocks"]),
        num_blocks=int(stats["num_blocks"]),
        queued_prefill_tokens=max(queued, 0),
        counters=counters,
    )


def register(conn: ControlConnection, message: Register, timeout_s: float = 60.0) -> None:
    """Send Register until the router accepts it; RuntimeError if it refuses or never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn.send(message)
        for reply in conn.poll(timeout_ms=1000):
            if isinstance(reply, RegisterAck):
                if not reply.accepted:
                    raise RuntimeError(f"the router refused this worker: {reply.reason}")
                log.info("registered with %s as %s", conn.router_address, message.worker_id)
                return
    raise RuntimeError(f"no answer from the router at {conn.router_address}")


class WorkerBase:
    """The loop around one engine: commands in, `step()` work, heartbeats, drain on SIGTERM."""

    role: protocol.Role

    def __init__(
        self,
        engine: Engine,
        router_address: str,
        worker_id: str,
        context: zmq.Context | None,
        keys: ClusterKeys | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.context = context or zmq.Context.instance()
        # keys: from the cluster secret (common.runtime.auth); None: no authentication
        self.control = ControlConnection(router_address, worker_id, self.context, keys)
        self.kv_address = ""
        self.kv_failures = 0
        self.running = True
        self.draining = False
        self.drain_started = 0.0
        self.heartbeat = Heartbeater(router_address, worker_id, self.context, self._heartbeat, keys)
        self.engine.pool.track_events = True
        self.kv_events_seq = -1  # the last KVEvents seq sent
        self.kv_snapshot_due = True  # send every held key next (after registering, or asked)
        self.loop_count = 0  # turns of `run`'s loop with no engine work waiting (see `progress`)
        self.registered = False  # the router accepted our Register (read by the readiness probe)

    def _heartbeat(self) -> Heartbeat:
        beat = engine_heartbeat(self.worker_id, self.engine, self.counters)
        beat.loop_count = self.progress
        beat.draining = self.draining
        beat.kv_events_seq = self.kv_events_seq
        beat.histograms = self.histograms()
        return beat

    @property
    def progress(self) -> int:
        """Engine steps that ran a batch, decoder layers run (it moves inside a long step too: a
        2k-token prefill on a slow, busy CPU can take over 30 s) and loop turns while the engine
        has no work. A loop that turns while work waits and nothing runs (sequences that can
        never get blocks) stands still, as a stuck one does. The router's stall check and the
        liveness probe read it."""
        return self.loop_count + self.engine.num_steps + self.engine.runner.model.layers_run

    def histograms(self) -> dict[str, protocol.HistogramSnapshot]:
        """Cumulative histograms for the router's /metrics (none by default)."""
        return {}

    def publish_kv_events(self) -> None:
        """Tell the router which prefix blocks this worker gained or lost since the last call."""
        pool = self.engine.pool
        stored, evicted = pool.drain_events()
        reset = self.kv_snapshot_due
        if reset:
            stored, evicted = pool.cached_keys(), []
            self.kv_snapshot_due = False
        elif not stored and not evicted:
            return
        self.kv_events_seq += 1
        self.control.send(KVEvents(self.worker_id, self.kv_events_seq, stored, evicted, reset))

    def send_registration(self) -> None:
        self.control.send(self.registration())
        self.kv_snapshot_due = True  # the router may have forgotten everything about us

    def counters(self) -> dict[str, float]:
        return {"kv_transfer_failures_total": self.kv_failures}

    def registration(self) -> Register:
        from kvtransfer.payload import kv_layout

        transports = ["tcp", "shm"]
        if self.engine.runner.device.type == "cuda":
            transports.append("cuda_ipc")
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
            heartbeat_identity=self.heartbeat.identity,
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
        register(self.control, self.registration())
        self.registered = True
        self.heartbeat.start()
        try:
            while self.running and not self._drained():
                self.turn()
        finally:
            self.close()

    def turn(self) -> None:
        """One turn of the main loop: router messages, one step, KV events."""
        if self.heartbeat.reregister.is_set():  # router restarted or declared us dead
            self.heartbeat.reregister.clear()
            self.send_registration()
        # Nothing to compute (maybe KV or acks in flight): wait briefly instead of spinning,
        # so a worker waiting for a transfer leaves the cores to the others.
        wait_ms = 0 if self.engine.has_unfinished() else (10 if self.is_idle() else 2)
        for message in self.control.poll(timeout_ms=wait_ms):
            self._dispatch(message)
        self.step()
        self.publish_kv_events()
        if not self.engine.has_unfinished():
            self.loop_count += 1

    def _drained(self) -> bool:
        # Work sent before the router saw a draining heartbeat may still arrive: wait a grace.
        grace_s = 2.5 * protocol.HEARTBEAT_INTERVAL_S
        return self.draining and self.is_idle() and time.monotonic() - self.drain_started > grace_s

    def _dispatch(self, message: protocol.ControlMessage) -> None:
        if isinstance(message, RegisterAck):
            if not message.accepted and message.reason != protocol.REREGISTER_REASON:
                log.error("the router dropped this worker: %s", message.reason)
                self.running = False
            elif not message.accepted:
                self.send_registration()
        elif isinstance(message, protocol.KVResync):
            self.kv_snapshot_due = True
        elif isinstance(message, protocol.Abort):
            self.abort(message.request_id)
        elif isinstance(message, protocol.BlockBooksQuery):
            self.control.send(self.block_books(message.query_id))
        else:
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
        self.heartbeat.stop()
        self.control.close()
