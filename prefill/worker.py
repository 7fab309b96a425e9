"""The prefill worker: computes prompts, samples their first token, pushes KV to decode workers.

Owns the prefill side of a request: the engine runs the prompt (batched, chunked, prefix-cached)
with `max_tokens=1` and holds its blocks afterwards; the KV sender pushes the blocks the decode
worker lacks, with the first token, and the blocks stay pinned until the decode side acks, refuses,
or the deadline passes. They then remain in the prefix cache. Started by `pdserve prefill`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from dataclasses import dataclass

import zmq

from common import protocol
from common.engine import Engine
from common.protocol import Abort, KVHeader, Prefill, Register, RegisterAck, RequestFailed
from common.worker import ControlConnection, Heartbeater, engine_heartbeat, register
from kvtransfer import KVSender

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: Prefill
    received_at: float


class PrefillWorker:
    """One engine, one control connection, one KV sender; `run` loops until stopped."""

    def __init__(
        self,
        engine: Engine,
        router_address: str,
        worker_id: str,
        context: zmq.Context | None = None,
        kv_transport: str = "auto",
    ) -> None:
        self.engine = engine
        self.kv_transport = kv_transport  # anything but auto overrides the router's choice
        self.worker_id = worker_id
        self.context = context or zmq.Context.instance()
        self.control = ControlConnection(router_address, worker_id, self.context)
        self.sender = KVSender(engine.runner.kv_cache, context=self.context)
        self.jobs: dict[str, _Job] = {}
        self.kv_failures = 0
        self.kv_bytes = 0
        self.kv_seconds = 0.0
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
            "kv_transfer_bytes_total": self.kv_bytes,
            "kv_transfer_seconds_total": self.kv_seconds,
        }

    def registration(self) -> Register:
        transports = ["tcp", "shm"]
        if self.engine.runner.device.type == "cuda":
            transports.append("cuda_ipc")
        return Register(
            version=protocol.PROTOCOL_VERSION,
            role="prefill",
            worker_id=self.worker_id,
            model=str(self.engine.config.model),
            block_size=self.engine.config.block_size,
            num_blocks=self.engine.pool.num_blocks,
            max_model_len=self.engine.max_model_len,
            dtype=self.engine.config.dtype,
            host=socket.gethostname(),
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
        if self.heartbeat.reregister.is_set():  # the router lost us (restart, or declared dead)
            self.heartbeat.reregister.clear()
            self.control.send(self.registration())
        idle = not self.engine.has_unfinished() and self.sender.num_pending() == 0
        for message in self.control.poll(timeout_ms=10 if idle else 0):
            self._handle(message)
        if self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    self._send_kv(out.request_id)
        for result in self.sender.poll():
            self.engine.release(result.request_id)
            job = self.jobs.pop(result.request_id, None)
            if result.ok:
                self.kv_bytes += result.nbytes
                self.kv_seconds += result.seconds
            elif job is not None:
                self.kv_failures += 1
                self.control.send(RequestFailed(result.request_id, "transfer", result.reason))

    def _handle(self, message: protocol.ControlMessage) -> None:
        if isinstance(message, Prefill):
            params = dataclasses.replace(
                message.params, max_tokens=1, min_tokens=min(message.params.min_tokens, 1)
            )
            try:
                self.engine.add_request(
                    message.request_id, message.prompt_token_ids, params, hold_blocks=True
                )
            except ValueError as exc:
                self.control.send(RequestFailed(message.request_id, "prefill", str(exc)))
                return
            self.jobs[message.request_id] = _Job(message, time.monotonic())
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id)
            if self.jobs.pop(message.request_id, None) is not None:
                self.sender.abort(message.request_id)
        elif isinstance(message, RegisterAck):
            if not message.accepted and message.reason != protocol.REREGISTER_REASON:
                log.error("the router dropped this worker: %s", message.reason)
                self.running = False
            elif not message.accepted:
                self.control.send(self.registration())
        else:
            log.warning("unexpected %s from the router", type(message).__name__)

    def _send_kv(self, request_id: str) -> None:
        job = self.jobs.get(request_id)
        seq = self.engine.held.get(request_id)
        if job is None or seq is None:
            self.engine.release(request_id)
            return
        req = job.request
        bs = self.engine.config.block_size
        start = req.num_decode_cached_tokens // bs
        blocks = seq.block_table[start:]
        cache = self.engine.runner.kv_cache
        header = KVHeader(
            request_id=request_id,
            start_block=start,
            num_blocks=len(blocks),
            num_layers=cache.shape[0],
            block_size=bs,
            num_kv_heads=cache.shape[4],
            head_dim=cache.shape[5],
            dtype=str(cache.dtype).removeprefix("torch."),
            nbytes=0,
            checksum=0,
            transport=req.transport if self.kv_transport == "auto" else self.kv_transport,
            first_token_id=seq.output_token_ids[0],
            first_logprob=seq.output_logprobs[0],
            first_top_logprobs=seq.output_top_logprobs[0],
        )
        remaining = req.deadline_s - (time.monotonic() - job.received_at)
        try:
            self.sender.send(req.decode_kv_address, header, blocks, max(remaining, 0.1))
        except Exception as exc:  # a bad address or transport must fail this request only
            log.warning("sending KV of %s failed: %s", request_id, exc)
            self.jobs.pop(request_id, None)
            self.engine.release(request_id)
            self.kv_failures += 1
            self.control.send(RequestFailed(request_id, "transfer", str(exc)))

    def close(self) -> None:
        self.heartbeat.stop()
        self.sender.close()
        self.control.close()
