"""Test doubles for the router's tests: fake workers on real ZeroMQ sockets, and the router itself
running in a thread.

`FakeWorker` is a DEALER (identity = worker id) in a thread of its own that speaks the real control
protocol: it registers, heartbeats, answers `Reserve` / `Generate` / `Prefill` by emitting
`TokenOutput` sequences the test controls (by default it echoes the prompt's tokens back; prompt
logprobs, when asked for, are `fake_prompt_logprobs`), one message per token or, with
`batch=True`, each turn's outputs in one `TokenBatch` as the real decode worker sends them; records
every message it receives, and can be told to refuse, fail, stay silent or die. A fake prefill
worker "pushes KV" by telling the fake decode worker named in its `Prefill` (through `KV_BUS`,
keyed by the decode worker's kv address), which then starts emitting tokens. No model weights.

`RouterThread` runs a real `RouterServer` (uvicorn + control socket) on free loopback ports with
the default model's tokenizer.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from common import protocol
from common.api.tokenizer import Tokenizer
from common.protocol import (
    Abort,
    BlockBooksQuery,
    BlockBooksReply,
    Generate,
    Heartbeat,
    Prefill,
    Register,
    RegisterAck,
    RequestFailed,
    Reserve,
    ReserveReply,
    TokenBatch,
    TokenOutput,
)
from common.sampling_params import SamplingParams
from router.server import RouterConfig, RouterServer

KV_BUS: dict[str, FakeWorker] = {}  # kv_address -> fake decode worker
VOCAB = 49152  # the default model's


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    from common.model.model_files import resolve_model

    return Tokenizer.from_source(resolve_model("default"))


def fake_prompt_logprobs(prompt: list[int], k: int) -> list[tuple[float, int, list]]:
    """What a fake decode worker reports as prompt logprobs: token j+1 gets -0.25 * (j + 1), rank
    j + 1 and k alternatives (prompt[j+1] + a + 1, -0.1 - a)."""
    return [
        (-0.25 * (j + 1), j + 1, [((t + a + 1) % VOCAB, -0.1 - a) for a in range(k)])
        for j, t in enumerate(prompt[1:])
    ]


class _Stream:
    """Tokens a fake decode worker is emitting for one request."""

    def __init__(self, request_id: str, tokens: list[int], params: SamplingParams, prompt: list):
        self.request_id = request_id
        self.tokens = tokens
        self.params = params
        self.prompt = prompt
        self.num_prompt_tokens = len(prompt)
        self.num_sent = 0
        self.next_s = 0.0


class FakeWorker:
    """A fake prefill or decode worker; see the module docstring. Stop it with `close` or `die`."""

    def __init__(
        self,
        router_address: str,
        role: str,
        worker_id: str,
        *,
        model: str = "default",
        block_size: int = 16,
        max_model_len: int = 2048,
        host: str = "testhost",
        transports: tuple[str, ...] = ("tcp", "shm"),
        version: int = protocol.PROTOCOL_VERSION,
        reserve: str = "ok",  # ok | refuse | idle (refuse while streaming) | silent
        generate: str = "echo",  # echo | fail | silent
        prefill: str = "ok",  # ok | fail | silent
        output_token_ids: list[int] | None = None,  # emitted (cycled) instead of the prompt
        eos_token_id: int | None = None,
        num_cached_tokens: int = 0,  # what ReserveReply says the decode worker holds
        token_delay_s: float = 0.01,
        heartbeat_interval_s: float = 0.2,
        register: bool = True,
        kv_salt: bytes = b"",  # prefix-key salt; a test sends KVEvents itself (`send`)
        answer_block_books: bool = False,  # reply to BlockBooksQuery with balanced books
        batch: bool = False,  # each turn's outputs in one TokenBatch, not one message each
        tokens_per_output: int = 1,  # tokens each output carries (a fast worker's several steps)
    ) -> None:
        self.batch = batch
        self.tokens_per_output = tokens_per_output
        self.role, self.worker_id = role, worker_id
        self.reserve_mode, self.generate_mode, self.prefill_mode = reserve, generate, prefill
        self.output_token_ids = output_token_ids
        self.eos_token_id = eos_token_id
        self.num_cached_tokens = num_cached_tokens
        self.token_delay_s = token_delay_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.answer_block_books = answer_block_books
        self.kv_address = f"tcp://fake-kv/{worker_id}" if role == "decode" else ""
        self.registration = Register(
            version=version,
            role=role,
            worker_id=worker_id,
            model=model,
            block_size=block_size,
            num_blocks=1000,
            max_model_len=max_model_len,
            dtype="float32",
            host=host,
            kv_address=self.kv_address,
            transports=list(transports),
            kv_salt=kv_salt,
        )
        self.kv_events_seq = -1  # what heartbeats report as the last KVEvents seq sent
        self.received: list[Any] = []  # every control message from the router, in order
        self.acks: list[RegisterAck] = []
        self.heartbeats_on = True
        self._streams: dict[str, _Stream] = {}
        self._reserved: dict[str, Reserve] = {}
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()  # from other threads
        self._stop = threading.Event()
        if role == "decode":
            KV_BUS[self.kv_address] = self
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(router_address)
        self._thread = threading.Thread(target=self._run, name=worker_id, daemon=True)
        self._thread.start()
        if register:
            self.send(self.registration)

    # ---- control from the test ------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        self._inbox.put(("send", msg))

    def kv_arrived(self, request_id: str) -> None:
        """A fake prefill worker delivered this request's KV."""
        self._inbox.put(("kv", request_id))

    def die(self) -> None:
        """Stop at once: no more messages of any kind (a crashed process)."""
        self._stop.set()
        self._thread.join(5)
        KV_BUS.pop(self.kv_address, None)

    close = die

    def messages(self, kind: type) -> list[Any]:
        return [m for m in list(self.received) if isinstance(m, kind)]

    def wait_for(
        self, kind: type, predicate: Callable[[Any], bool] = lambda m: True, timeout_s: float = 5.0
    ) -> Any:
        """The first received message of `kind` matching `predicate`; AssertionError on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.messages(kind):
                if predicate(m):
                    return m
            time.sleep(0.01)
        raise AssertionError(f"{self.worker_id}: no {kind.__name__} in {timeout_s} s")

    def wait_registered(self, timeout_s: float = 5.0) -> RegisterAck:
        deadline = time.monotonic() + timeout_s
        while not self.acks:
            assert time.monotonic() < deadline, f"{self.worker_id}: no RegisterAck"
            time.sleep(0.01)
        return self.acks[-1]

    # ---- the worker's thread --------------------------------------------------------------------

    def _run(self) -> None:
        next_heartbeat = time.monotonic() + self.heartbeat_interval_s  # after Register
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self.heartbeats_on and now >= next_heartbeat:
                    self._send(Heartbeat(self.worker_id, len(self._streams), 0, 900, 1000, 0,
                                         {"fake_steps_total": 3.0},
                                         kv_events_seq=self.kv_events_seq))  # fmt: skip
                    next_heartbeat = now + self.heartbeat_interval_s
                while True:
                    try:
                        what, item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if what == "send":
                        self._send(item)
                    elif item in self._reserved:
                        r = self._reserved.pop(item)
                        self._start_stream(r.request_id, r.prompt_token_ids, r.params)
                self._emit_due(now)
                if self._sock.poll(5):
                    while self._sock.poll(0):
                        self._handle(protocol.decode_control(self._sock.recv()))
        finally:
            self._sock.close()

    def _send(self, msg: Any) -> None:
        self._sock.send(protocol.encode(msg))

    def _handle(self, msg: Any) -> None:
        self.received.append(msg)
        if isinstance(msg, RegisterAck):
            self.acks.append(msg)
        elif isinstance(msg, Reserve):
            mode = self.reserve_mode
            if mode == "idle":  # room only once its streams have ended
                mode = "refuse" if self._streams else "ok"
            if mode == "ok":
                self._reserved[msg.request_id] = msg
                self._send(ReserveReply(msg.request_id, True, self.num_cached_tokens))
            elif mode == "refuse":
                self._send(ReserveReply(msg.request_id, False, reason="no free KV blocks"))
        elif isinstance(msg, Generate):
            if self.generate_mode == "echo":  # a migrated request goes on where it was
                n = msg.num_output_tokens
                prompt = msg.prompt_token_ids[: len(msg.prompt_token_ids) - n]
                self._start_stream(msg.request_id, prompt, msg.params, num_sent=n)
            elif self.generate_mode == "fail":
                self._send(RequestFailed(msg.request_id, "decode", "injected failure"))
        elif isinstance(msg, Prefill):
            if self.prefill_mode == "ok":
                decode = KV_BUS.get(msg.decode_kv_address)
                if decode is not None:
                    decode.kv_arrived(msg.request_id)
            elif self.prefill_mode == "fail":
                self._send(RequestFailed(msg.request_id, "prefill", "injected failure"))
        elif isinstance(msg, Abort):
            self._streams.pop(msg.request_id, None)
            self._reserved.pop(msg.request_id, None)
        elif isinstance(msg, BlockBooksQuery) and self.answer_block_books:
            self._send(BlockBooksReply(self.worker_id, msg.query_id, 1000, 1000, 0, 0, 0, 0, []))

    def _start_stream(
        self, request_id: str, prompt: list[int], params: SamplingParams, num_sent: int = 0
    ) -> None:
        tokens = self.output_token_ids or prompt
        stream = _Stream(request_id, list(tokens), params, list(prompt))
        stream.num_sent = num_sent
        self._streams[request_id] = stream

    def _emit_due(self, now: float) -> None:
        outputs = []
        for rid, s in list(self._streams.items()):
            if now < s.next_s:
                continue
            s.next_s = now + self.token_delay_s
            out = self._next_output(s)
            outputs.append(out)
            if out.finished:
                del self._streams[rid]
        if self.batch and outputs:
            self._send(TokenBatch(outputs))
        elif not self.batch:
            for out in outputs:
                self._send(out)

    def _next_output(self, s: _Stream) -> TokenOutput:
        """The stream's next `tokens_per_output` tokens (fewer if it finishes first)."""
        k = s.params.logprobs
        n_prompt = s.params.prompt_logprobs
        first = s.num_sent == 0 and n_prompt is not None
        tokens: list[int] = []
        finished = stop = False
        while len(tokens) < self.tokens_per_output and not finished:
            token = s.tokens[s.num_sent % len(s.tokens)]
            s.num_sent += 1
            tokens.append(token)
            stop = token in s.params.stop_token_ids or (
                token == self.eos_token_id and not s.params.ignore_eos
            )
            stop = stop and s.num_sent >= s.params.min_tokens
            finished = stop or s.num_sent >= s.params.max_tokens
        return TokenOutput(
            request_id=s.request_id,
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens) if k is not None else [],
            top_logprobs=[[((t + j) % VOCAB, -0.5 - j) for j in range(k)] for t in tokens]
            if k is not None
            else [],
            finished=finished,
            finish_reason=("stop" if stop else "length") if finished else None,
            num_prompt_tokens=s.num_prompt_tokens,
            num_cached_tokens=0,
            prompt_logprobs=fake_prompt_logprobs(s.prompt, n_prompt) if first else None,
        )


class RouterThread:
    """A real router (HTTP + control socket) on free loopback ports, in a thread of its own."""

    def __init__(self, **config: Any) -> None:
        config.setdefault("port", 0)
        config.setdefault("control_port", 0)
        # In-process, the router's event loop shares the GIL with the test's clients and fake
        # workers: its lag would measure them. Tests of the guard set it.
        config.setdefault("max_loop_lag_s", 0.0)
        self.server = RouterServer(RouterConfig(**config), default_tokenizer(), 8192)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: self.server.run(on_ready=ready.set),
            name="router",
            daemon=True,
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the router did not start")
        self.url = f"http://127.0.0.1:{self.server.http_port}"
        self.control = self.server.control_address
        self.workers: list[FakeWorker] = []

    def worker(self, role: str, worker_id: str, **kwargs: Any) -> FakeWorker:
        """A fake worker connected to this router, registered (stopped with the router)."""
        w = FakeWorker(self.control, role, worker_id, **kwargs)
        self.workers.append(w)
        if kwargs.get("register", True):
            assert w.wait_registered().accepted, w.acks
        return w

    def stop(self) -> None:
        for w in self.workers:
            w.close()
        self.server.stop()
        self._thread.join(10)

    def __enter__(self) -> RouterThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
