"""The decode side of a KV transfer: accept pushed blocks, validate them, write them, ack.

`KVReceiver` is owned by the decode worker, which calls `poll(resolve)` between engine steps;
`resolve(header)` maps a transfer to the destination block ids the worker reserved for it (or
None: unknown or aborted request). A transfer is written into the cache only when everything
checks out: layout and dtype, sizes, destination blocks, every block's checksum. Whatever happens
the sender gets a `KVAck` and the worker a `ReceivedKV`; a frame too broken to name its request
is dropped. Nothing a peer sends can raise out of `poll`. A peer's `KVFetch` (it asks for blocks
this worker holds) is not answered here: `poll` keeps it, bounded, for the worker to serve
(`take_fetches`, `kvtransfer.peer_fetch.serve`), which answers by pushing through its sender.

Socket: a ROUTER bound at `bind`; senders (`kvtransfer.sender`) connect DEALERs. shm segments
stay mapped between transfers (`shm.SegmentCache`, at most `shm_cache_segments`): a sender reuses
its segments, and a mapping is dropped once its file is unlinked.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from common.protocol import (
    MAX_KV_HEADER_BYTES,
    KVAck,
    KVFetch,
    KVHeader,
    ProtocolError,
    decode_kv,
    encode,
)
from common.sockets import keepalive
from kvtransfer import cuda_ipc, payload, shm
from kvtransfer.sender import SOCKET_BUFFER_BYTES

if TYPE_CHECKING:
    from common.runtime.auth import ClusterKeys

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = MAX_KV_HEADER_BYTES  # a few hundred bytes, or a prompt's logprobs with them
MAX_MESSAGES_PER_POLL = 64  # keep one poll short even under a flood
MAX_WAITING_FETCHES = 256  # peers' fetches kept until served; more are dropped (they time out)
SHM_SWEEP_EVERY_S = 1.0  # how often to drop the mappings of segments their senders unlinked


@dataclass
class ReceivedKV:
    """One transfer that ended here: written into the cache (ok) or refused (reason)."""

    header: KVHeader
    ok: bool
    reason: str
    damaged: bool = False  # refused because the bytes did not arrive as sent (checksum, length)


class _Refused(Exception):
    """A transfer that must not be written; the message is the reason sent back."""


class _Damaged(_Refused):
    """The payload's bytes are not those sent (a block's checksum mismatch, truncated, no
    checksum per block): a link or memory fault, not a wrong request. Never written; the receiver
    may recompute the KV."""


class KVReceiver:
    """Receives KV pushed by prefill workers into `kv_cache`; `address` is where to push."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        bind: str = "tcp://127.0.0.1:*",
        context: zmq.Context | None = None,
        shm_cache_segments: int = shm.CACHE_SEGMENTS,
        keys: ClusterKeys | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """`keys`: the cluster secret's (common.runtime.auth): only CURVE peers that know it may
        push KV here, and the tcp payloads travel encrypted. `kv_scales`: an 8-bit cache's
        scales, which every payload carries after its blocks."""
        payload.kv_layout(kv_cache)  # asserts the cache layout
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        # Set by a receiver that recomputes damaged KV itself (the decode worker): acks say so
        self.recompute_damaged = False
        self._own_context = context is None
        self.context = context if context is not None else zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        if keys is not None:
            keys.serve(self.socket)
        self.socket.setsockopt(zmq.LINGER, 0)
        keepalive(self.socket)
        self.socket.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
        # No legitimate frame is larger than the whole cache: zmq drops a peer that tries.
        cache_bytes = kv_cache.nbytes + (0 if kv_scales is None else kv_scales.nbytes)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max(cache_bytes, MAX_HEADER_BYTES))
        self.socket.bind(bind)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc = cuda_ipc.CudaIpcImporter()
        self.segments = shm.SegmentCache(shm_cache_segments)
        self._last_sweep = 0.0
        self._fetches: list[KVFetch] = []
        self.fetches_dropped = 0

    def take_fetches(self) -> list[KVFetch]:
        """Peers' `KVFetch`es received by `poll` since the last call, oldest first."""
        fetches, self._fetches = self._fetches, []
        return fetches

    def poll(
        self, resolve: Callable[[KVHeader], list[int] | None], timeout_ms: int = 0
    ) -> list[ReceivedKV]:
        """Handle the transfers that have arrived (waiting up to timeout_ms for the first)."""
        now = time.monotonic()
        if now - self._last_sweep >= SHM_SWEEP_EVERY_S:
            self.segments.sweep()
            self._last_sweep = now
        if timeout_ms > 0 and not self.socket.poll(timeout_ms):
            return []
        received = []
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            result = self._handle(frames, resolve)
            if result is not None:
                received.append(result)
        return received

    def _handle(self, frames: list[zmq.Frame], resolve) -> ReceivedKV | None:
        identity, body = frames[0].bytes, frames[1:]
        if not body or len(body[0]) > MAX_HEADER_BYTES:
            log.warning("dropped a kv message without a usable header (%d frames)", len(body))
            return None
        try:
            header = decode_kv(body[0].bytes)
        except ProtocolError as exc:
            log.warning("dropped a malformed kv message: %s", exc)
            return None
        if isinstance(header, KVFetch):
            if len(self._fetches) < MAX_WAITING_FETCHES:
                self._fetches.append(header)
            else:
                self.fetches_dropped += 1
            return None
        if not isinstance(header, KVHeader):
            log.warning("dropped an unexpected %s on the kv socket", type(header).__name__)
            return None
        damaged = False
        try:
            self._receive(header, body[1:], resolve)
            reason = ""
        except _Refused as exc:
            reason, damaged = str(exc), isinstance(exc, _Damaged)
        except Exception as exc:  # a bug or a broken resolve must not take the receiver down
            # The traceback as text: a record holding the frames would keep a segment mapped.
            log.error("kv transfer of %s failed:\n%s", header.request_id, traceback.format_exc())
            reason = f"receiver error: {exc}"
        if reason:
            log.warning("refused kv of %s: %s", header.request_id, reason)
        recompute = damaged and self.recompute_damaged
        ack = KVAck(header.request_id, ok=not reason, reason=reason, recompute=recompute)
        try:
            self.socket.send_multipart([identity, encode(ack)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is gone or not reading; its deadline will end the transfer
        return ReceivedKV(header, not reason, reason, damaged)

    def _receive(self, header: KVHeader, frames: list[zmq.Frame], resolve) -> None:
        """Validate and write one transfer; _Refused when it must not be written."""
        mismatch = payload.layout_mismatch(header, self.kv_cache)
        if mismatch:
            raise _Refused(mismatch)
        if not 0 <= header.num_blocks <= self.kv_cache.shape[2]:
            raise _Refused(f"bad num_blocks {header.num_blocks}")
        expected = payload.payload_nbytes(self.kv_cache, header.num_blocks, self.kv_scales)
        if header.nbytes != expected:
            raise _Refused(f"nbytes mismatch: header says {header.nbytes}, blocks hold {expected}")
        if header.transport == "tcp":
            if len(frames) != 1:
                raise _Refused(f"expected one payload frame, got {len(frames)}")
            buffer = frames[0].buffer
            if len(buffer) != header.nbytes:
                raise _Damaged(f"truncated payload: {len(buffer)} of {header.nbytes} bytes")
            dst = self._destination(header, resolve)
            self._write(header, buffer, dst)
        elif header.transport == "shm":
            if frames:
                raise _Refused("shm transfer with a payload frame")
            if not header.nbytes:
                self._write(header, b"", self._destination(header, resolve))
                return
            try:
                segment = self.segments.map(header.shm_name, header.nbytes)
            except shm.SegmentError as exc:
                raise _Refused(str(exc)) from None
            dst = self._destination(header, resolve)
            self._write(header, memoryview(segment)[: header.nbytes], dst)
        elif header.transport == "cuda_ipc":
            if frames:
                raise _Refused("cuda_ipc transfer with a payload frame")
            if self.kv_scales is not None:
                raise _Refused("an 8-bit KV cache travels over tcp or shm, not cuda_ipc")
            try:
                ref = cuda_ipc.decode_ref(header.ipc_handle)
                source = self._ipc.check(ref, header)
            except cuda_ipc.CudaIpcError as exc:
                raise _Refused(str(exc)) from None
            dst = self._destination(header, resolve)
            if header.num_blocks:
                self._ipc.copy(source, ref, self.kv_cache, dst)
        else:
            raise _Refused(f"unknown transport {header.transport!r}")

    def _destination(self, header: KVHeader, resolve) -> torch.Tensor:
        block_ids = resolve(header)
        if block_ids is None:
            raise _Refused("unknown or aborted request")
        if len(block_ids) != header.num_blocks:
            raise _Refused(f"{len(block_ids)} destination blocks for {header.num_blocks}")
        try:
            return payload.block_index(block_ids, self.kv_cache.shape[2], self.kv_cache.device)
        except ValueError as exc:
            raise _Refused(f"bad destination blocks: {exc}") from None

    def _write(self, header: KVHeader, buffer, dst: torch.Tensor) -> None:
        """Check every block's checksum, then (only then) copy the payload into the cache."""
        sent = header.block_checksums
        if len(sent) != header.num_blocks:  # nothing to check the blocks against: recompute
            raise _Damaged(f"{len(sent)} block checksums for {header.num_blocks} blocks")
        got = payload.block_checksums(buffer, self.kv_cache, self.kv_scales, header.num_blocks)
        bad = [i for i, (a, b) in enumerate(zip(got, sent)) if a != b]
        if bad:
            shown = ", ".join(f"{i} ({got[i]:#010x} != {sent[i]:#010x})" for i in bad[:4])
            more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            raise _Damaged(f"checksum mismatch in block {shown}{more} of {header.num_blocks}")
        if header.nbytes:
            payload.scatter_payload(self.kv_cache, self.kv_scales, dst, buffer)

    def close(self) -> None:
        self.socket.close(linger=0)
        self._ipc.close()
        self.segments.close()
        if self._own_context:
            self.context.term()
