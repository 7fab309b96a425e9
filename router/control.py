"""The router's control plane: the ZeroMQ ROUTER socket workers connect to, and worker liveness.

Owns the socket (bind, receive loop, sending commands), routing each worker message to where it
belongs (Register and heartbeats -> the registry, KV events -> the prefix index, request replies ->
the dispatcher), asking unknown workers to register again, and the periodic liveness check that
expires dead workers (silent, stuck, or unreachable) and fails their requests over.

Integrity: a worker id belongs to the connection that registered it. The socket never hands an
identity in use to a second connection (no ROUTER_HANDOVER: libzmq ignores the newcomer), a
heartbeat counts only from the worker's own connections (`Worker.sends_from`), KV events are held
to what the worker's cache can hold, a worker that a send cannot reach is dead at once (its
requests fail over and /health stops counting it), and so is a worker whose id registers again
from a new process (another heartbeat identity: only possible once the old connection closed).

Built and run by `router.server.RouterServer`, on the router's event loop; single-threaded like
everything there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from common.prefix_hash import KEY_BYTES
from common.protocol import (
    MAX_BYTES_BY_TAG,
    MAX_CONTROL_MESSAGE_BYTES,
    REREGISTER_REASON,
    ControlMessage,
    Heartbeat,
    KVEvents,
    KVResync,
    ProtocolError,
    Register,
    RegisterAck,
    TokenBatch,
    decode_control,
    encode,
    message_tag,
)
from router.sse import flush_queue

if TYPE_CHECKING:
    from common.runtime.auth import ClusterKeys
    from router.dispatch import Dispatcher
    from router.kv_index import PrefixIndex
    from router.registry import Registry, Worker

log = logging.getLogger(__name__)

# Plain ints: pyzmq's flag enums cost a microsecond or two per use, and a send uses three.
_SEND_MORE = int(zmq.SNDMORE | zmq.DONTWAIT)
_SEND_LAST = int(zmq.DONTWAIT)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
MAX_SMALL_BYTES = 2**16  # frames up to this size need no per-worker limit
# A frame no larger than every tag's own limit (`MAX_BYTES_BY_TAG`) needs no look at its tag
# before decoding: `decode_control` would check nothing more than the decoder does.
SMALL_FRAME_BYTES = min(MAX_SMALL_BYTES, *MAX_BYTES_BY_TAG.values())
_decoder = msgspec.msgpack.Decoder(ControlMessage)


class ControlPlane:
    """Worker messages in, commands out; `bind`, then run `receive_loop` and `liveness_loop`."""

    def __init__(self, registry: Registry, prefix_index: PrefixIndex) -> None:
        self.registry = registry
        self.prefix_index = prefix_index
        self.dispatcher: Dispatcher | None = None  # set by the server (it needs `send` first)
        self.sock: zmq.Socket | None = None
        self.context: zmq.Context | None = None
        self.address = ""  # the bound endpoint, e.g. tcp://127.0.0.1:8001
        self._warned: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_due = False  # a `_drain` is scheduled

    def bind(self, host: str, port: int, keys: ClusterKeys | None = None) -> str:
        """Bind the ROUTER socket (port 0: any free port); returns the bound endpoint. With `keys`
        (the cluster secret's) only CURVE clients that know the secret get through."""
        self.context = zmq.Context()
        sock = self.context.socket(zmq.ROUTER)
        if keys is not None:
            keys.serve(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails, not drops
        # No ROUTER_HANDOVER: a second connection under a live worker's identity is ignored. A
        # restarted worker gets its identity back once its old connection has closed.
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
            self.reap()

    def reap(self) -> None:
        """Remove the dead workers now and fail their requests over."""
        for worker in self.registry.expire():
            self.prefix_index.remove(worker.worker_id)
            try:
                if self.dispatcher is not None:
                    self.dispatcher.on_worker_dead(worker)
            except Exception:  # the next worker's requests must still be failed over
                log.exception("failing over %s's requests failed", worker.worker_id)

    async def receive_loop(self) -> None:
        """Handle worker messages as they arrive, until cancelled.

        A plain socket read when the event loop sees its descriptor readable, everything waiting
        read at once (bounded, so that HTTP streams get their turn): no future, task step or
        asyncio socket machinery per message, which at a thousand workers' heartbeats a second
        cost a sixth of a core."""
        assert self.sock is not None
        loop = self._loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        self._drain()  # what arrived before
        try:
            await loop.create_future()  # until cancelled
        finally:
            loop.remove_reader(fd)

    def _drain(self) -> None:
        """Read and handle what waits on the socket (at most MAX_MESSAGES_PER_WAKEUP; then again
        after the loop's other work). ZeroMQ's descriptor signals changes, not data: read until
        the socket says there is none.

        A message is the sender's identity and one frame, read as two plain `recv`s (a third of
        `recv_multipart`'s cost); the frame's `more` says whether a malformed message has more
        frames, which are then read and dropped. Once a message's first frame is there, all are.
        A wake-up also ends once DRAIN_BUDGET_S have gone by since it began. Its tokens are
        written as it ends (the loop's FlushQueue, run here rather than after the callbacks the
        loop queued meanwhile)."""
        self._drain_due = False
        sock = self.sock
        if sock is None or sock.closed:
            return
        recv, clock = sock.recv, time.monotonic
        deadline = clock() + self.DRAIN_BUDGET_S
        for _ in range(self.MAX_MESSAGES_PER_WAKEUP):
            if clock() > deadline:
                break
            try:
                identity = recv(_NOBLOCK)
            except zmq.Again:  # all read: the descriptor wakes the loop for more
                self._flush_now()
                return
            frame = recv(_NOBLOCK, copy=False)
            if frame.more:
                num_frames = 2
                while recv(_NOBLOCK, copy=False).more:
                    num_frames += 1
                log.warning("dropping a control message of %d frames", num_frames + 1)
                continue
            self._receive([identity, frame.bytes])
        self._drain_soon()
        self._flush_now()

    def _flush_now(self) -> None:
        """Write the tokens this wake-up brought (the loop's FlushQueue, at once)."""
        if self._loop is not None:
            flush_queue(self._loop).run()

    def _drain_soon(self) -> None:
        if not self._drain_due and self._loop is not None:
            self._drain_due = True
            self._loop.call_soon(self._drain)

    # A wake-up's tokens are written once it is over (router.sse.FlushQueue runs next): 64
    # messages keep the first one's wait short (256 doubled the router's own read-to-write
    # latency at 1,000 workers) and cost no more per token (benchmarks/router_scale_relay.py).
    MAX_MESSAGES_PER_WAKEUP = 64
    # ... and at most this long. A message costs 30-120 us of the loop at 1,000 workers (a token,
    # heartbeats, a stream's end), and the tokens waited for the FlushQueue's turn after the
    # loop's other queued callbacks: at 1,000 workers x 1,000 streams paced at 2,000 tokens/s
    # the router's read-to-write p99 was 7.6-8.9 ms (6.5-7.7 ms of its CPU), with the budget and
    # the flush at the wake-up's end 1.6 ms (1.0); saturated tokens/s and CPU per token the same
    # (benchmarks/router_scale.py --router-trace, --router-cpus 0 --load-cpus 1)
    DRAIN_BUDGET_S = 0.001

    def _receive(self, frames: list) -> None:
        """Decode one worker message and handle it; a bad one is dropped with a warning."""
        if len(frames) != 2:
            log.warning("dropping a control message of %d frames", len(frames))
            return
        identity, frame = frames  # small frames: copied out, cheaper than zmq.Frame objects
        try:
            if len(frame) <= SMALL_FRAME_BYTES:
                try:
                    msg = _decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise ProtocolError(f"bad control message: {exc}") from exc
            else:
                msg = decode_control(frame, self._limit(identity, frame))
        except ProtocolError as e:
            log.warning("dropping a bad control frame: %s", e)
            return
        try:
            if type(msg) is TokenBatch and self.dispatcher is not None:  # the relay: most of them
                worker = self.registry.touch(identity.decode(errors="replace"))
                if worker is not None:
                    self.dispatcher.on_token_batch(worker, msg)
                    return
            self.on_message(identity, msg)
        except Exception:  # one bad message must not stop the control loop
            log.exception("handling %s failed", type(msg).__name__)

    def _limit(self, identity: bytes, frame: bytes) -> int:
        """The most bytes this frame may have: a KV events message names at most twice the keys
        its sender's cache can hold (stored + evicted)."""
        if message_tag(bytes(frame[:64])) != "kv_events":
            return MAX_CONTROL_MESSAGE_BYTES
        worker = self.registry.get(identity.decode(errors="replace"))
        num_blocks = worker.info.num_blocks if worker is not None else 0
        return MAX_SMALL_BYTES + 2 * num_blocks * (KEY_BYTES + 3)

    def on_message(self, identity: bytes, msg: msgspec.Struct) -> None:
        if isinstance(msg, Register):
            old = self.registry.get(msg.worker_id)
            if (
                old is not None
                and old.identity == identity
                and old.info.heartbeat_identity != msg.heartbeat_identity
            ):
                # A new process under this id (its old connection closed, or the socket would
                # have ignored this one): the old one's requests are lost, fail them over first.
                self.registry.mark_dead(old, "was replaced by a new process")
            if old is not None and old.dead_reason and old.identity == identity:
                self.reap()  # its old self is gone: fail that over before it starts anew
            ack = self.registry.register(identity, msg)
            if ack.accepted:
                # A worker sends a full KV snapshot after every Register (maybe as a new process
                # whose seq starts again at 0): start its index afresh.
                self.prefix_index.remove(msg.worker_id)
            self.send_to(identity, ack)
            return
        if isinstance(msg, Heartbeat):  # heartbeats may come from a socket of their own
            worker_id = msg.worker_id
            known = self.registry.get(worker_id)
            if known is not None and not known.sends_from(identity):
                # Not from this worker's connections: a spoof, or a stale socket. Ignored.
                self._warn_once(
                    f"spoof:{worker_id}:{identity!r}",
                    "ignoring a heartbeat for %r from another connection (%r)",
                    worker_id,
                    identity,
                )
                return
            worker = self.registry.on_heartbeat(msg)
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
            self._warn_once(
                worker_id,
                "%s from unregistered worker %r: asked it to register",
                type(msg).__name__,
                worker_id,
            )

    def _warn_once(self, key: str, fmt: str, *args: object) -> None:
        if key not in self._warned and len(self._warned) < 10_000:  # bounded: ids are untrusted
            self._warned.add(key)
            log.warning(fmt, *args)

    def send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        return self.send_to(worker.identity, msg)

    def send_to(self, identity: bytes, msg: msgspec.Struct) -> bool:
        sock = self.sock
        assert sock is not None
        error = None
        frame = encode(msg)  # before the first frame goes: nothing may fail between the two
        try:
            # Two frames as send_multipart sends them, without its Python wrapper. A ROUTER
            # socket refuses the first (identity) frame when the peer is unreachable or its
            # queue is full, so no half-sent message is left behind.
            sock.send(identity, _SEND_MORE)
            sock.send(frame, _SEND_LAST)
        except zmq.ZMQError as e:  # unreachable (ROUTER_MANDATORY), or its queue is full
            error = e
        # A send can take the descriptor's signal for messages that arrived meanwhile.
        if sock.get(_EVENTS) & _POLLIN:
            self._drain_soon()
        if error is not None:
            name = identity.decode(errors="replace")
            log.warning("could not send %s to %r: %s", type(msg).__name__, name, error)
            worker = self.registry.get(name)
            if worker is not None and worker.identity == identity:
                # Unreachable is dead: the liveness loop fails its requests over (not from here,
                # inside the dispatcher's own send) and /health stops counting it meanwhile.
                self.registry.mark_dead(worker, "is unreachable")
            return False
        return True
