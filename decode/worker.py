"""The decode worker: reserves blocks, receives prompt KV, decodes in continuous batches.

Owns the decode side of a request: `Reserve` holds blocks before the prefill starts (refused when
full), the KV receiver writes arriving blocks into them, and the sequence then joins the running
batch and streams `TokenOutput`s to the router. `Generate` prefills locally (colocated mode and
short prompts). A reservation whose KV does not arrive in time is dropped and reported failed.
Started by `pdserve decode` (and `pdserve up`).
"""

from __future__ import annotations

import logging
import socket
import time

import zmq

from common import protocol
from common.engine import Engine, RequestOutput
from common.protocol import (
    Abort,
    Generate,
    KVHeader,
    Register,
    RegisterAck,
    RequestFailed,
    Reserve,
    ReserveReply,
    TokenOutput,
)
from common.worker import ControlConnection, Heartbeater, engine_heartbeat, register
from kvtransfer import KVReceiver

log = logging.getLogger(__name__)

RESERVATION_TIMEOUT_S = 120.0  # a prefill this late is treated as lost


def token_output(out: RequestOutput) -> TokenOutput:
    return TokenOutput(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        logprobs=out.new_logprobs,
        top_logprobs=out.new_top_logprobs,
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )


class DecodeWorker:
    """One engine, one control connection, one KV receiver; `run` loops until stopped."""

    def __init__(
        self,
        engine: Engine,
        router_address: str,
        worker_id: str,
        kv_bind: str,
        kv_advertise_host: str | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.context = context or zmq.Context.instance()
        self.control = ControlConnection(router_address, worker_id, self.context)
        self.receiver = KVReceiver(engine.runner.kv_cache, bind=kv_bind, context=self.context)
        address = self.receiver.address
        if kv_advertise_host:
            port = address.rsplit(":", 1)[1]
            address = f"tcp://{kv_advertise_host}:{port}"
        self.kv_address = address
        self.reserved_at: dict[str, float] = {}
        self.kv_failures = 0
        self.kv_bytes = 0
        self.running = True
        self.heartbeat = Heartbeater(
            router_address,
            worker_id,
            self.context,
            lambda: engine_heartbeat(worker_id, engine, self._counters),
        )

    def _counters(self) -> dict[str, float]:
        return {
            "kv_transfer_failures_total": self.kv_failures,
            "kv_transfer_received_bytes_total": self.kv_bytes,
        }

    def registration(self) -> Register:
        transports = ["tcp", "shm"]
        if self.engine.runner.device.type == "cuda":
            transports.append("cuda_ipc")
        return Register(
            version=protocol.PROTOCOL_VERSION,
            role="decode",
            worker_id=self.worker_id,
            model=str(self.engine.config.model),
            block_size=self.engine.config.block_size,
            num_blocks=self.engine.pool.num_blocks,
            max_model_len=self.engine.max_model_len,
            dtype=self.engine.config.dtype,
            host=socket.gethostname(),
            kv_address=self.kv_address,
            transports=transports,
        )

    def run(self) -> None:
        register(self.control, self.registration())
        self.heartbeat.start()
        try:
            while self.running:
                self.step()
        finally:
            self.close()

    def step(self) -> None:
        """Handle commands and arrived KV, then run one engine step (or wait if idle)."""
        if self.heartbeat.reregister.is_set():  # the router lost us (restart, or declared dead)
            self.heartbeat.reregister.clear()
            self.control.send(self.registration())
        idle = not self.engine.has_unfinished()
        for message in self.control.poll(timeout_ms=10 if idle else 0):
            self._handle(message)
        for received in self.receiver.poll(self._resolve):
            self._on_kv(received.header, received.ok, received.reason)
        self._expire_reservations()
        if self.engine.has_unfinished():
            for out in self.engine.step():
                self.control.send(token_output(out))

    def _handle(self, message: protocol.ControlMessage) -> None:
        if isinstance(message, Reserve):
            try:
                cached = self.engine.reserve(
                    message.request_id, message.prompt_token_ids, message.params
                )
            except ValueError as exc:
                self.control.send(ReserveReply(message.request_id, ok=False, reason=str(exc)))
                return
            if cached is None:
                reply = ReserveReply(message.request_id, ok=False, reason="no free KV blocks")
            else:
                self.reserved_at[message.request_id] = time.monotonic()
                reply = ReserveReply(message.request_id, ok=True, num_cached_tokens=cached)
            self.control.send(reply)
        elif isinstance(message, Generate):
            try:
                self.engine.add_request(
                    message.request_id, message.prompt_token_ids, message.params
                )
            except ValueError as exc:
                self.control.send(RequestFailed(message.request_id, "decode", str(exc)))
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id)
            self.reserved_at.pop(message.request_id, None)
        elif isinstance(message, RegisterAck):
            if not message.accepted and message.reason != protocol.REREGISTER_REASON:
                log.error("the router dropped this worker: %s", message.reason)
                self.running = False
            elif not message.accepted:
                self.control.send(self.registration())
        else:
            log.warning("unexpected %s from the router", type(message).__name__)

    def _resolve(self, header: KVHeader) -> list[int] | None:
        blocks = self.engine.reserved_block_ids(header.request_id)
        if blocks is None:
            return None
        end = header.start_block + header.num_blocks
        if header.start_block < 0 or end > len(blocks):
            return None
        return blocks[header.start_block : end]

    def _on_kv(self, header: KVHeader, ok: bool, reason: str) -> None:
        rid = header.request_id
        if rid not in self.engine.reserved:
            return  # aborted meanwhile, or never ours: the receiver already refused it
        self.reserved_at.pop(rid, None)
        if not ok:
            self.kv_failures += 1
            self.engine.abort(rid)
            self.control.send(RequestFailed(rid, "transfer", reason))
            return
        self.kv_bytes += header.nbytes
        out = self.engine.admit_prefilled(
            rid, header.first_token_id, header.first_logprob, header.first_top_logprobs
        )
        self.control.send(token_output(out))

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for rid, since in list(self.reserved_at.items()):
            if now - since > RESERVATION_TIMEOUT_S:
                del self.reserved_at[rid]
                if self.engine.abort(rid):
                    self.kv_failures += 1
                    self.control.send(RequestFailed(rid, "transfer", "KV did not arrive in time"))

    def close(self) -> None:
        self.heartbeat.stop()
        self.receiver.close()
        self.control.close()
