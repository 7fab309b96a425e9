"""The prefill worker: computes prompts, samples their first token, pushes KV to decode workers.

Owns the prefill side of a request: the engine runs the prompt (batched, chunked, prefix-cached)
with `max_tokens=1` and holds its blocks afterwards; the KV sender pushes the blocks the decode
worker lacks, with the first token (and the prompt's logprobs when asked for: they are computed
where the prompt is), and the blocks stay pinned until the decode side acks, refuses,
or the deadline passes. They then remain in the prefix cache. Its KV receiver takes the answers
of its peer fetches (a `Prefill` whose `PeerHint` names a worker holding the prompt's prefix:
`common.runtime.worker`), and peers' fetches of what it holds. Started by `pdserve prefill`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import zmq

from common import protocol
from common.engine.engine import Engine
from common.engine.sampler import generator_state
from common.protocol import KVHeader, Prefill, RequestFailed
from common.runtime.auth import ClusterKeys
from common.runtime.histogram import KV_TRANSFER_BUCKETS, Histogram
from common.runtime.worker import WorkerBase
from kvtransfer import KVReceiver, KVSender

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: Prefill
    received_at: float


class PrefillWorker(WorkerBase):
    """One engine, one control connection, one KV sender; `run` loops until stopped."""

    role = "prefill"

    def __init__(
        self,
        engine: Engine,
        router_address: str,
        worker_id: str,
        context: zmq.Context | None = None,
        kv_transport: str = "auto",
        keys: ClusterKeys | None = None,
        kv_bind: str = "tcp://127.0.0.1:*",
        kv_advertise_host: str | None = None,
    ) -> None:
        """`kv_bind`: where its KV receiver listens (peer fetches' answers, peers' fetches)."""
        super().__init__(engine, router_address, worker_id, context, keys)
        self.kv_transport = kv_transport  # anything but auto overrides the router's choice
        cache, scales = engine.runner.kv_cache, engine.runner.kv_scales
        self.attach_kv(
            KVSender(cache, context=self.context, keys=keys, kv_scales=scales),
            KVReceiver(cache, bind=kv_bind, context=self.context, keys=keys, kv_scales=scales),
            kv_advertise_host,
        )
        self.sender: KVSender
        self.jobs: dict[str, _Job] = {}
        self.kv_bytes = 0
        self.kv_seconds = Histogram(KV_TRANSFER_BUCKETS)  # send to ack, successful transfers

    def counters(self) -> dict[str, float]:
        return {
            "kv_transfer_failures_total": self.kv_failures,
            "kv_transfer_bytes_total": self.kv_bytes,
        }

    def histograms(self) -> dict[str, protocol.HistogramSnapshot]:
        return {"kv_transfer_seconds": self.kv_seconds.snapshot()}

    def is_idle(self) -> bool:
        return (
            not self.jobs
            and not self.engine.has_unfinished()
            and not self.deferred
            and not self.compiling
        )

    def step(self) -> None:
        """One engine step; push the KV of finished prompts; settle finished transfers."""
        if self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    self._send_kv(out.request_id)
        _, results = self.poll_kv()
        for result in results:
            self.engine.release(result.request_id)
            job = self.jobs.pop(result.request_id, None)
            if result.ok:
                self.kv_bytes += result.nbytes
                self.kv_seconds.observe(result.seconds)
            elif job is not None:
                self.kv_failures += 1
                if result.recompute:  # damaged on the way: the decode worker recomputes it
                    log.warning("KV of %s arrived damaged (%s): the decode worker recomputes it",
                                result.request_id, result.reason)  # fmt: skip
                else:
                    failed = RequestFailed(result.request_id, "transfer", result.reason)
                    self.reply(result.request_id, failed)
            self.forget(result.request_id)  # done here: the decode worker has it, or it failed

    def handle(self, message: protocol.ControlMessage) -> None:
        if isinstance(message, Prefill):
            params = dataclasses.replace(
                message.params, max_tokens=1, min_tokens=min(message.params.min_tokens, 1)
            )
            try:
                self.engine.add_request(
                    message.request_id, message.prompt_token_ids, params, hold_blocks=True
                )
            except ValueError as exc:
                rid = message.request_id
                self.reply(rid, RequestFailed(rid, "prefill", str(exc)))
                return
            self.jobs[message.request_id] = _Job(message, time.monotonic())
        else:
            log.warning("unexpected %s from the router", type(message).__name__)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if self.jobs.pop(request_id, None) is not None:
            self.sender.abort(request_id)

    def _send_kv(self, request_id: str) -> None:
        job = self.jobs.get(request_id)
        seq = self.engine.held.get(request_id)
        if job is None or seq is None:
            self.engine.release(request_id)
            self.forget(request_id)
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
            transport=req.transport if self.kv_transport == "auto" else self.kv_transport,
            first_token_id=seq.output_token_ids[0],
            first_logprob=seq.output_logprobs[0],
            first_top_logprobs=seq.output_top_logprobs[0],
            generator_state=generator_state(seq.generator),
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
        )
        remaining = req.deadline_s - (time.monotonic() - job.received_at)
        try:
            self.sender.send(req.decode_kv_address, header, blocks, max(remaining, 0.1))
        except Exception as exc:  # a bad address or transport must fail this request only
            log.warning("sending KV of %s failed: %s", request_id, exc)
            self.jobs.pop(request_id, None)
            self.engine.release(request_id)
            self.kv_failures += 1
            self.reply(request_id, RequestFailed(request_id, "transfer", str(exc)))
