"""What prefill and decode workers share: the control connection to the router and heartbeats.

Owns the worker's DEALER socket to the router's control socket (register, receive commands, send
replies and token outputs) and a heartbeat thread with its own socket, so heartbeats keep flowing
while a long prefill step holds the main thread. Used by prefill/worker.py and decode/worker.py.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from common import protocol
from common.engine import Engine
from common.protocol import Heartbeat, Register, RegisterAck

log = logging.getLogger(__name__)


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


class ControlConnection:
    """DEALER to the router; `poll` returns decoded commands, malformed frames are dropped."""

    def __init__(self, router_address: str, worker_id: str, context: zmq.Context) -> None:
        self.worker_id = worker_id
        self.router_address = router_address
        self.sock = context.socket(zmq.DEALER)
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
    """Sends `Heartbeat` (and `Register` until accepted) every HEARTBEAT_INTERVAL_S."""

    def __init__(
        self,
        router_address: str,
        worker_id: str,
        context: zmq.Context,
        make_heartbeat: Callable[[], Heartbeat],
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.router_address = router_address
        self.worker_id = worker_id
        self.context = context
        self.make_heartbeat = make_heartbeat
        self.stop_event = threading.Event()
        self.reregister = threading.Event()  # the router forgot us: the main loop registers again

    def run(self) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}#heartbeat".encode())
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
