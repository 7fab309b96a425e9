"""The router's control plane: the ZeroMQ ROUTER socket workers connect to, and worker liveness.

Owns the socket (bind, receive loop, sending commands), routing each worker message to where it
belongs (Register and heartbeats -> the registry, KV events -> the prefix index, request replies ->
the dispatcher), asking unknown workers to register again, and the periodic liveness check that
expires silent workers and fails their requests over. Built and run by `router.server.RouterServer`,
on the router's event loop; single-threaded like everything there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import msgspec
    import zmq.asyncio

    from router.dispatch import Dispatcher
    from router.kv_index import PrefixIndex
    from router.registry import Registry, Worker

log = logging.getLogger(__name__)


class ControlPlane:
    """Worker messages in, commands out; `bind`, then run `receive_loop` and `liveness_loop`."""

    def __init__(self, registry: Registry, prefix_index: PrefixIndex) -> None:
        self.registry = registry
        self.prefix_index = prefix_index
        self.dispatcher: Dispatcher | None = None  # set by the server (it needs `send` first)
        self.sock: zmq.asyncio.Socket | None = None
        self.context: zmq.asyncio.Context | None = None
        self.address = ""  # the bound endpoint, e.g. tcp://127.0.0.1:8001
        self._warned: set[str] = set()

    def bind(self, host: str, port: int) -> str:
        """Bind the ROUTER socket (port 0: any free port); returns the bound endpoint."""
        import zmq
        import zmq.asyncio

        from common.protocol import MAX_CONTROL_MESSAGE_BYTES

        self.context = zmq.asyncio.Context()
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails, not drops
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its identity back
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        sock.bind(f"tcp://{host}:{port or '*'}")
        self.sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.context is not None:
            self.context.term()

    async def liveness_loop(self, heartbeat_timeout_s: float) -> None:
        """Expire workers silent for longer than the timeout; fail their requests over."""
        period_s = min(0.2, heartbeat_timeout_s / 10)
        while True:
            await asyncio.sleep(period_s)
            for worker in self.registry.expire():
                self.prefix_index.remove(worker.worker_id)
                try:
                    if self.dispatcher is not None:
                        self.dispatcher.on_worker_dead(worker)
                except Exception:  # the next worker's requests must still be failed over
                    log.exception("failing over %s's requests failed", worker.worker_id)

    async def receive_loop(self) -> None:
        from common.protocol import ProtocolError, decode_control

        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropping a control message of %d frames", len(frames))
                continue
            identity, frame = frames
            try:
                msg = decode_control(frame)
            except ProtocolError as e:
                log.warning("dropping a bad control frame: %s", e)
                continue
            try:
                self.on_message(identity, msg)
            except Exception:  # one bad message must not stop the control loop
                log.exception("handling %s failed", type(msg).__name__)

    def on_message(self, identity: bytes, msg: msgspec.Struct) -> None:
        from common.protocol import (
            REREGISTER_REASON,
            Heartbeat,
            KVEvents,
            KVResync,
            Register,
            RegisterAck,
        )

        if isinstance(msg, Register):
            ack = self.registry.register(identity, msg)
            if ack.accepted:
                # A worker sends a full KV snapshot after every Register (maybe as a new process
                # whose seq starts again at 0): start its index afresh.
                self.prefix_index.remove(msg.worker_id)
            self.send_to(identity, ack)
            return
        if isinstance(msg, Heartbeat):  # heartbeats may come from a socket of their own
            worker = self.registry.on_heartbeat(msg)
            worker_id = msg.worker_id
            if worker is not None and self.prefix_index.on_heartbeat(worker_id, msg.kv_events_seq):
                self.send(worker, KVResync("a KV events message was lost"))
        else:
            worker_id = identity.decode(errors="replace")
            worker = self.registry.touch(worker_id)
            if worker is not None and isinstance(msg, KVEvents):
                if msg.worker_id == worker_id and self.prefix_index.apply(msg):
                    self.send(worker, KVResync(f"KV events gap before seq {msg.seq}"))
            elif worker is not None and self.dispatcher is not None:
                self.dispatcher.on_message(worker, msg)
        if worker is None:
            # A worker we do not know (router restarted, or it was declared dead): ask it to
            # register again; the reply goes to whichever socket this came from.
            self.send_to(identity, RegisterAck(accepted=False, reason=REREGISTER_REASON))
            if worker_id not in self._warned:
                self._warned.add(worker_id)
                log.warning(
                    "%s from unregistered worker %r: asked it to register",
                    type(msg).__name__,
                    worker_id,
                )

    def send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        return self.send_to(worker.identity, msg)

    def send_to(self, identity: bytes, msg: msgspec.Struct) -> bool:
        import zmq

        from common.protocol import encode

        assert self.sock is not None
        # DONTWAIT: the future is already resolved (sent, or failed) when this returns.
        future = self.sock.send_multipart([identity, encode(msg)], flags=zmq.DONTWAIT)
        error = future.exception() if future.done() else None
        if error is not None:
            name = identity.decode(errors="replace")
            log.warning("could not send %s to %r: %s", type(msg).__name__, name, error)
            return False
        return True
