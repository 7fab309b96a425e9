"""A worker's links to its routers: one `RouterLink` per router it serves.

Owns each link's DEALER control socket (`ControlConnection`: register, receive commands, send
replies and token outputs), its heartbeat thread with a socket of its own (`Heartbeater`: beats
keep flowing while a long step holds the main thread; its random identity travels in
`Register`), the numbering of the KV events sent to that router, whether it accepted this worker,
and a monitor of the control connection, so the worker learns at once when a router is gone
(and aborts that router's requests: their streams died with it). Also turns `--router` into
addresses: a comma-separated list, each a tcp:// address whose host name may resolve to several
routers (a Kubernetes headless Service), resolved again every `RESOLVE_INTERVAL_S` so routers
that come and go (a rolling update) are picked up. `engine_heartbeat` is what a beat says of the
worker's engine. Used by `common.runtime.worker.WorkerBase`.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol
from common.protocol import Heartbeat, Register, RegisterAck
from common.runtime.auth import ClusterKeys
from common.sockets import keepalive

if TYPE_CHECKING:
    from common.engine.engine import Engine

log = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 10.0  # how often host names in --router are looked up again


def resolve_routers(spec: str) -> list[str]:
    """The router control addresses `spec` names: comma-separated, each host name expanded to
    every address it resolves to (sorted, duplicates dropped). A name that does not resolve now
    is left out with a warning (it is tried again later); an IP literal or a non-tcp address is
    taken as given."""
    addresses: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        for address in _expand(item):
            if address not in addresses:
                addresses.append(address)
    return addresses


def _expand(address: str) -> list[str]:
    url = urlsplit(address)
    host, port = url.hostname, url.port
    if url.scheme != "tcp" or not host or port is None or _is_ip(host) or host == "*":
        return [address]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        log.warning("router address %s does not resolve now: %s", address, exc)
        return []
    ips = sorted({info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)})
    if host == "localhost" and "127.0.0.1" in ips:
        ips = ["127.0.0.1"]  # one router, not one per loopback family
    return [f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}" for ip in ips]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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
        keepalive(self.sock)
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
        keepalive(sock)
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


def register(
    conn: ControlConnection, message: Register, timeout_s: float = 60.0
) -> list[protocol.ControlMessage]:
    """Send Register until the router accepts it; RuntimeError if it refuses or never answers.
    Returns the commands that arrived before or with the ack (a router may dispatch work the
    moment it accepts), in order, for the caller to handle as its loop would have."""
    deadline = time.monotonic() + timeout_s
    early: list[protocol.ControlMessage] = []
    while time.monotonic() < deadline:
        conn.send(message)
        accepted = False
        for reply in conn.poll(timeout_ms=1000):
            if not isinstance(reply, RegisterAck):
                early.append(reply)
            elif not reply.accepted:
                raise RuntimeError(f"the router refused this worker: {reply.reason}")
            else:
                accepted = True
        if accepted:
            log.info("registered with %s as %s", conn.router_address, message.worker_id)
            return early
    raise RuntimeError(f"no answer from the router at {conn.router_address}")


class RouterLink:
    """One router: its control connection, heartbeat thread, KV event numbering and state."""

    def __init__(
        self,
        address: str,
        worker_id: str,
        context: zmq.Context,
        make_heartbeat: Callable[[RouterLink], Heartbeat],
        keys: ClusterKeys | None = None,
    ) -> None:
        self.address = address
        self.control = ControlConnection(address, worker_id, context, keys)
        self.heartbeat = Heartbeater(
            address, worker_id, context, lambda: make_heartbeat(self), keys
        )
        self.monitor = self.control.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.kv_events_seq = -1  # the last KVEvents seq sent to this router
        self.kv_snapshot_due = True  # send it every held key next (after registering, or asked)
        self.registered = False  # it accepted our Register

    def disconnected(self) -> bool:
        """True when the control connection dropped since the last call (the router died or
        restarted: the streams it relayed are gone)."""
        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            dropped = dropped or event["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def start(self) -> None:
        self.heartbeat.start()

    def close(self) -> None:
        """Stop beating and close both sockets; a second call does nothing."""
        self.heartbeat.stop()
        if self.monitor.closed:
            return
        self.control.sock.disable_monitor()
        self.monitor.close()
        self.control.close()


def register_any(
    links: list[RouterLink], make: Callable[[RouterLink], Register], timeout_s: float = 60.0
) -> list[tuple[RouterLink, protocol.ControlMessage]]:
    """Send Register to every router until at least one accepts (the others may answer later:
    the worker loop handles their acks); RuntimeError if one refuses outright or none answers.
    Returns the commands that arrived with the acks (a router may dispatch work the moment it
    accepts): the caller handles them, in order, as its loop would have."""
    deadline = time.monotonic() + timeout_s
    early: list[tuple[RouterLink, protocol.ControlMessage]] = []
    while time.monotonic() < deadline:
        for link in links:
            if not link.registered:
                link.control.send(make(link))
        wait_ms = 1000
        for link in links:
            for reply in link.control.poll(timeout_ms=wait_ms):
                if not isinstance(reply, RegisterAck):
                    early.append((link, reply))
                elif not reply.accepted:
                    raise RuntimeError(f"the router refused this worker: {reply.reason}")
                elif not link.registered:
                    link.registered = True
                    log.info("registered with %s", link.address)
            wait_ms = 0
        if any(link.registered for link in links):
            return early
    addresses = ", ".join(link.address for link in links) or "(none resolved)"
    raise RuntimeError(f"no answer from the router at {addresses}")


# engine.stats() entries a heartbeat carries: counters, and the KV sizes (bytes per token, tiers')
HEARTBEAT_SUFFIXES = ("_total", "_bytes", "_per_token")


def engine_heartbeat(
    worker_id: str, engine: Engine, extra_counters: Callable[[], dict[str, float]] | None = None
) -> Heartbeat:
    """A heartbeat of `engine`'s load: requests running and waiting (reservations count as
    waiting), free blocks, prompt tokens still to prefill, and its counters."""
    stats = engine.stats()
    counters = {k: float(v) for k, v in stats.items() if k.endswith(HEARTBEAT_SUFFIXES)}
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
