"""The decode worker: reserves blocks, receives prompt KV, decodes in continuous batches.

Owns the decode side of a request: `Reserve` holds blocks before the prefill starts (refused when
full), the KV receiver writes arriving blocks into them, and the sequence then joins the running
batch and streams `TokenOutput`s to the router. `Generate` prefills locally (colocated mode and
short prompts). A reservation whose KV does not arrive in time (the deadline its `Reserve`
carries: the router's prefill deadline) is dropped and reported failed.
Its KV sender answers peers' fetches of what it holds, and its receiver takes the answers of its
own (`common.runtime.worker`). Started by `pdserve decode` (and `pdserve up`).
"""

from __future__ import annotations

import logging
import time

import zmq

from common import protocol
from common.engine.engine import Engine, RequestOutput
from common.protocol import (
    Generate,
    KVHeader,
    RequestFailed,
    Reserve,
    ReserveReply,
    TokenOutput,
)
from common.runtime.auth import ClusterKeys
from common.runtime.worker import WorkerBase
from kvtransfer import KVReceiver, KVSender

log = logging.getLogger(__name__)

RESERVATION_TIMEOUT_S = 120.0  # without a deadline in the Reserve: a prefill this late is lost


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
        prompt_logprobs=out.prompt_logprobs,
    )


class DecodeWorker(WorkerBase):
    """One engine, one control connection, one KV receiver; `run` loops until stopped."""

    role = "decode"

    def __init__(
        self,
        engine: Engine,
        router_address: str,
        worker_id: str,
        kv_bind: str,
        kv_advertise_host: str | None = None,
        context: zmq.Context | None = None,
        keys: ClusterKeys | None = None,
    ) -> None:
        super().__init__(engine, router_address, worker_id, context, keys)
        cache, scales = engine.runner.kv_cache, engine.runner.kv_scales
        self.attach_kv(
            KVSender(cache, context=self.context, keys=keys, kv_scales=scales),
            KVReceiver(cache, bind=kv_bind, context=self.context, keys=keys, kv_scales=scales),
            kv_advertise_host,
        )
        self.receiver: KVReceiver
        self.receiver.recompute_damaged = True  # damaged KV: prefill here, never fail or use it
        self.reserved_until: dict[str, float] = {}  # request id -> when its KV is overdue
        self.kv_bytes = 0
        self.kv_recomputed = 0  # transfers that arrived damaged and were prefilled here

    def counters(self) -> dict[str, float]:
        return {
            "kv_transfer_failures_total": self.kv_failures,
            "kv_transfer_received_bytes_total": self.kv_bytes,
            "kv_transfer_recomputed_total": self.kv_recomputed,
        }

    def is_idle(self) -> bool:
        return (
            not self.engine.has_unfinished()
            and not self.engine.reserved
            and not self.deferred
            and not self.compiling
        )

    def step(self) -> None:
        """Write arrived KV, drop overdue reservations, run one engine step."""
        received_kv, _ = self.poll_kv()
        for received in received_kv:
            self._on_kv(received.header, received.ok, received.reason, received.damaged)
        self._expire_reservations()
        if self.engine.has_unfinished():
            self.send_token_outputs([token_output(out) for out in self.engine.step()])

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.reserved_until.pop(request_id, None)

    def handle(self, message: protocol.ControlMessage) -> None:
        rid = getattr(message, "request_id", "")
        if isinstance(message, Reserve):
            if self.draining:  # the router then asks another decode worker
                self.reply(rid, ReserveReply(rid, False, reason="draining"))
                return
            try:
                cached = self.engine.reserve(
                    message.request_id, message.prompt_token_ids, message.params
                )
            except ValueError as exc:
                self.reply(rid, ReserveReply(rid, False, reason=str(exc)))
                return
            if cached is None:
                reply = ReserveReply(message.request_id, ok=False, reason="no free KV blocks")
            else:
                lifetime = message.deadline_s if message.deadline_s > 0 else RESERVATION_TIMEOUT_S
                self.reserved_until[message.request_id] = time.monotonic() + lifetime
                reply = ReserveReply(message.request_id, ok=True, num_cached_tokens=cached)
            self.reply(message.request_id, reply)
        elif isinstance(message, Generate):
            try:
                self.engine.add_request(
                    rid,
                    message.prompt_token_ids,
                    message.params,
                    num_output_tokens=message.num_output_tokens,
                )
            except ValueError as exc:
                self.reply(rid, RequestFailed(rid, "decode", str(exc)))
        else:
            log.warning("unexpected %s from the router", type(message).__name__)

    def resolve_kv(self, header: KVHeader) -> list[int] | None:
        blocks = self.engine.reserved_block_ids(header.request_id)
        if blocks is None:
            return None
        end = header.start_block + header.num_blocks
        if header.start_block < 0 or end > len(blocks):
            return None
        return blocks[header.start_block : end]

    def _on_kv(self, header: KVHeader, ok: bool, reason: str, damaged: bool = False) -> None:
        rid = header.request_id
        if rid not in self.engine.reserved:
            return  # aborted meanwhile, or never ours: the receiver already refused it
        self.reserved_until.pop(rid, None)
        if not ok and damaged:  # never decoded from bad KV: computed here instead
            log.warning("KV of %s arrived damaged (%s): prefilling it here", rid, reason)
            self.kv_failures += 1
            self.kv_recomputed += 1
            self.engine.prefill_reserved(rid)
            return
        if not ok:
            self.kv_failures += 1
            self.engine.abort(rid)
            self.reply(rid, RequestFailed(rid, "transfer", reason))
            return
        self.kv_bytes += header.nbytes
        try:
            out = self.engine.admit_prefilled(
                rid,
                header.first_token_id,
                header.first_logprob,
                header.first_top_logprobs,
                generator_state=header.generator_state,
                prompt_logprobs=header.prompt_logprobs,
            )
        except ValueError as exc:  # a bad generator state or prompt logprobs fail this one only
            self.kv_failures += 1
            self.engine.abort(rid)
            self.reply(rid, RequestFailed(rid, "transfer", str(exc)))
            return
        self.reply(rid, token_output(out))

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for rid, until in list(self.reserved_until.items()):
            if now > until:
                del self.reserved_until[rid]
                if self.engine.abort(rid):
                    self.kv_failures += 1
                    self.reply(rid, RequestFailed(rid, "transfer", "KV did not arrive in time"))
