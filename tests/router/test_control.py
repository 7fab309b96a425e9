"""router/control.py on a real ROUTER socket: a command reaches its worker whole, one to an
identity no connection holds fails without leaving part of a message behind, and a worker a send
cannot reach is marked dead; reading, a message of more than one frame is dropped whole and the
ones around it handled, each in order."""

from __future__ import annotations

import time

import msgspec
import zmq

from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Heartbeat,
    Register,
    RegisterAck,
    TokenBatch,
    TokenOutput,
    encode,
)
from router.control import ControlPlane
from router.kv_index import PrefixIndex
from router.registry import Registry


def receive(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing arrived"
    return sock.recv_multipart()


def test_sends_reach_the_worker_whole_and_unreachable_ones_fail_cleanly() -> None:
    registry = Registry({"default"})
    plane = ControlPlane(registry, PrefixIndex())
    address = plane.bind("127.0.0.1", 0)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d0")
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(address)
        dealer.send(b"hello")  # the ROUTER learns the identity from a first message
        assert plane.sock is not None and plane.sock.poll(5000)
        assert plane.sock.recv_multipart() == [b"d0", b"hello"]
        registry.register(b"d0", Register(
            PROTOCOL_VERSION, "decode", "d0", "default", 16, 100, 4096, "float32", "h",
        ))  # fmt: skip
        worker = registry.get("d0")
        assert worker is not None

        assert plane.send_to(b"nobody", RegisterAck(accepted=False, reason="x")) is False
        assert plane.send(worker, Abort("r-1")) is True
        (frame,) = receive(dealer)  # one frame: the identity frame was for the ROUTER socket
        assert msgspec.msgpack.decode(frame)["request_id"] == "r-1"
        assert not dealer.poll(100)  # nothing of the failed send arrived after it
        assert not worker.dead_reason

        dealer.close()
        deadline = time.monotonic() + 5
        while plane.send(worker, Abort("r-2")):  # until the socket sees the peer gone
            assert time.monotonic() < deadline, "the closed connection stayed reachable"
            time.sleep(0.05)
        assert worker.dead_reason == "is unreachable"
        assert worker not in registry.live_index("decode")
    finally:
        dealer.close()
        plane.close()
        context.term()


class Recorder:
    """Stands in for the dispatcher: records the token batches and other messages it is given."""

    def __init__(self) -> None:
        self.got: list[tuple[str, object]] = []

    def on_token_batch(self, worker, msg) -> None:
        self.got.append((worker.worker_id, msg))

    def on_message(self, worker, msg) -> None:
        self.got.append((worker.worker_id, msg))


def test_a_message_of_several_frames_is_dropped_whole_and_the_rest_read_in_order() -> None:
    registry = Registry({"default"})
    plane = ControlPlane(registry, PrefixIndex())
    recorder = Recorder()
    plane.dispatcher = recorder  # type: ignore[assignment]
    address = plane.bind("127.0.0.1", 0)
    registry.register(b"d0", Register(
        PROTOCOL_VERSION, "decode", "d0", "default", 16, 100, 4096, "float32", "h",
    ))  # fmt: skip
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d0")
    dealer.setsockopt(zmq.LINGER, 0)

    def batch(i: int) -> TokenBatch:
        return TokenBatch([TokenOutput(f"r-{i}", [i], [], [], False, None, 3, 0)])

    try:
        dealer.connect(address)
        dealer.send(encode(batch(1)))
        dealer.send_multipart([encode(batch(2)), encode(batch(3)), b"junk"])  # not a message
        dealer.send(b"\xc1 not msgpack")  # dropped with a warning
        dealer.send(encode(batch(4)))
        dealer.send(encode(Heartbeat("d0", 0, 0, 100, 100)))  # to the registry
        dealer.send(encode(batch(5)))
        assert plane.sock is not None
        deadline = time.monotonic() + 5
        while len(recorder.got) < 3:
            assert time.monotonic() < deadline, f"only {recorder.got} arrived"
            plane.sock.poll(100)
            plane._drain()
        tokens = [msg.outputs[0].token_ids[0] for _, msg in recorder.got]
        assert tokens == [1, 4, 5] and all(w == "d0" for w, _ in recorder.got)
        assert registry.get("d0").heartbeat.num_free_blocks == 100  # type: ignore[union-attr]
    finally:
        dealer.close()
        plane.close()
        context.term()


def test_a_wake_up_writes_its_tokens_as_it_ends_and_keeps_to_its_time_budget(monkeypatch) -> None:
    # the tokens a wake-up brings are written as it ends (router.sse.FlushQueue, run by _drain,
    # not after whatever the loop queued meanwhile), and a wake-up ends once DRAIN_BUDGET_S went
    # by: its first message's tokens do not wait behind 64 others' handling
    import asyncio

    from router.sse import flush_queue

    registry = Registry({"default"})
    plane = ControlPlane(registry, PrefixIndex())
    order: list[str] = []

    class Writer(Recorder):
        def on_token_batch(self, worker, msg) -> None:
            super().on_token_batch(worker, msg)
            flush_queue().add(lambda i=msg.outputs[0].token_ids[0]: order.append(f"write {i}"))
            time.sleep(0.002)  # a message that takes longer than the whole budget

    recorder = Writer()
    plane.dispatcher = recorder  # type: ignore[assignment]
    registry.register(b"d0", Register(
        PROTOCOL_VERSION, "decode", "d0", "default", 16, 100, 4096, "float32", "h",
    ))  # fmt: skip
    monkeypatch.setattr(ControlPlane, "DRAIN_BUDGET_S", 0.001)

    async def main() -> None:
        address = plane.bind("127.0.0.1", 0)
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"d0")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            for i in range(3):
                dealer.send(
                    encode(TokenBatch([TokenOutput(f"r-{i}", [i], [], [], False, None, 3, 0)]))
                )
            assert plane.sock is not None
            plane._loop = asyncio.get_running_loop()
            time.sleep(0.2)  # all three there before the first wake-up
            while len(recorder.got) < 3 and plane.sock.poll(1000):
                plane._drain()
                order.append("wake-up over")
        finally:
            dealer.close()
            context.term()

    try:
        asyncio.run(main())
    finally:
        plane.close()
    # one message a wake-up (each outlasts the budget), its token written before it returned
    assert order == [
        "write 0",
        "wake-up over",
        "write 1",
        "wake-up over",
        "write 2",
        "wake-up over",
    ]
