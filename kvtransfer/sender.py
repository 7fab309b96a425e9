"""The prefill side of a KV transfer: push blocks to a decode worker, track each until it ends.

`KVSender` is owned by the prefill worker, which calls `send` when a prompt's KV is ready and
`poll` between engine steps. Every `send` ends in exactly one `TransferResult` from `poll`:
the receiver's ack or refusal, the deadline, an abort, or a failure to send at all. Until then
the worker keeps the blocks pinned; after it, it may release them whatever the outcome.

One DEALER socket per peer address, created on first use; at most `MAX_PEERS`, the least
recently used idle ones (nothing in flight to them) closed beyond that, and a peer's socket is
closed after a transfer to it or a fetch of the worker's (`drop_peer`) ends without an answer, so
that a dead peer's socket and queued frames do not stay. Each socket's connection events are
watched (a zmq monitor), so that `peer_down` tells at once when a peer's connection was lost or
refused (a process that died: its kernel closes the connection), rather than after a timeout.
Transports:
- tcp: frames [encode(header), payload]; the payload is the gathered blocks, sent zero-copy and
  held until the transfer ends.
- shm: the payload is gathered straight into a shared-memory segment from the sender's pool
  (`kvtransfer.shm`) and only the header travels; when the receiver replies the segment goes
  back to the pool, still mapped; after a deadline, abort or failed send it is unlinked.
- cuda_ipc: the cache is exported once per peer (`kvtransfer.cuda_ipc`); the header names the
  source blocks and the peer copies them on its GPU.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.protocol import KVAck, KVHeader, ProtocolError, decode_kv, encode
from common.sockets import keepalive
from kvtransfer import cuda_ipc, payload, shm

if TYPE_CHECKING:
    from common.runtime.auth import ClusterKeys

log = logging.getLogger(__name__)

TRANSPORTS = ("tcp", "shm", "cuda_ipc")
SOCKET_BUFFER_BYTES = 4 << 20  # larger kernel buffers for big tcp payloads (capped by the OS)
MAX_PEERS = 64  # sockets kept; beyond it the least recently used idle ones are closed
# A peer's connection: up, lost, or refused (zmq retries a refused connect every ~0.1 s)
_LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
_MAX_LINK_EVENTS_PER_CHECK = 64
_monitor_ids = itertools.count()  # one inproc endpoint per monitor in the process, never reused


@dataclass
class TransferResult:
    """How one `send` ended; the sender's blocks may be released either way."""

    request_id: str
    ok: bool
    reason: str
    nbytes: int
    seconds: float
    recompute: bool = False  # it failed, but the receiver computes the KV itself (KVAck)


@dataclass
class _Transfer:
    address: str
    header: KVHeader
    started: float
    deadline: float
    payload: torch.Tensor | None = None  # tcp: what zmq may still be reading
    segment: shm.Segment | None = None  # shm: lent by the pool until the transfer ends


class KVSender:
    """Sends the KV of block lists to decode workers; single-threaded, never blocks on a peer.
    `shm_pool_bytes` caps the shm segments kept mapped for reuse (`shm.SegmentPool`)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        context: zmq.Context | None = None,
        shm_pool_bytes: int = shm.POOL_BYTES,
        keys: ClusterKeys | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """`kv_scales`: an 8-bit cache's scales, shipped after its blocks in every payload."""
        payload.kv_layout(kv_cache)  # asserts the cache layout
        self.keys = keys  # the cluster secret's: CURVE to every decode worker's receiver
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        self._own_context = context is None
        self.context = context if context is not None else zmq.Context()
        self._peers: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # each peer socket's connection events
        self._down: set[str] = set()  # peers whose latest connection event was a loss
        self._pending: dict[str, _Transfer] = {}
        self._done: list[TransferResult] = []
        self._ipc_exports: dict[str, cuda_ipc.CudaIpcExport] = {}
        self.segments = shm.SegmentPool(shm_pool_bytes)
        if shm.remove_stale():
            log.warning("removed stale KV segments from %s", shm.SHM_DIR)

    def send(self, address: str, header: KVHeader, block_ids: list[int], deadline_s: float) -> None:
        """Start pushing kv_cache[:, :, block_ids] to `address`; `deadline_s` is seconds from now.

        Fills header.nbytes, header.block_checksums and header.shm_name / header.ipc_handle. The
        layout fields must already match the cache (`payload.kv_layout`). ValueError for a
        request id already in flight, an unknown transport or bad block ids; every other failure
        arrives as a TransferResult from `poll`.
        """
        self._check(header, len(block_ids))
        index = payload.block_index(block_ids, self.kv_cache.shape[2], self.kv_cache.device)

        def fill(out: memoryview | None) -> torch.Tensor:
            return payload.gather_payload(self.kv_cache, self.kv_scales, index, out=out)

        self._start(address, header, deadline_s, fill, block_ids)

    def stage(self, address: str, header: KVHeader, deadline_s: float) -> memoryview | None:
        """Start a transfer whose payload the caller fills itself, over as many turns as it
        likes (a peer fetch's answer, `kvtransfer.peer_fetch.FetchServer`), then sends with
        `send_staged`; tcp or shm only. The deadline runs from now. Fills header.nbytes (and
        shm_name) and returns the `header.nbytes` bytes to fill (`payload.assemble_payload`); None
        when it ended at once (a result from `poll` says why). ValueError as `send`."""
        self._check(header, header.num_blocks)
        if header.transport == "cuda_ipc":
            raise ValueError("a staged transfer travels over tcp or shm")
        rid = header.request_id
        now = time.monotonic()
        transfer = _Transfer(address, header, started=now, deadline=now + deadline_s)
        self._pending[rid] = transfer
        header.nbytes = payload.payload_nbytes(self.kv_cache, header.num_blocks, self.kv_scales)
        header.block_checksums = []
        try:
            if header.transport == "tcp":
                transfer.payload = torch.empty(header.nbytes, dtype=torch.uint8)
                return payload.as_bytes(transfer.payload)
            header.shm_name = ""
            if not header.nbytes:
                return memoryview(b"")
            transfer.segment = self.segments.acquire(header.nbytes)
            header.shm_name = transfer.segment.name
            return memoryview(transfer.segment.mapping)[: header.nbytes]
        except (OSError, RuntimeError) as exc:  # no memory or no shm left: a failed transfer
            self._finish(rid, False, f"send failed: {exc}")
            return None

    def send_staged(self, request_id: str, block_checksums: list[int]) -> None:
        """Send a staged transfer, its buffer filled (`stage`); one whose deadline passed or that
        was aborted meanwhile has its result already, and nothing is sent."""
        transfer = self._pending.get(request_id)
        if transfer is None:
            return
        transfer.header.block_checksums = block_checksums
        frames = [] if transfer.payload is None else [payload.as_bytes(transfer.payload)]
        self._transmit(transfer, frames)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def _check(self, header: KVHeader, num_blocks: int) -> None:
        if header.request_id in self._pending:
            raise ValueError(f"a transfer of {header.request_id} is already in flight")
        if header.transport not in TRANSPORTS:
            raise ValueError(f"unknown kv transport {header.transport!r}")
        mismatch = payload.layout_mismatch(header, self.kv_cache)
        if mismatch:  # raised, not asserted: part of the header comes from the router's Prefill
            raise ValueError(f"header does not describe this kv_cache: {mismatch}")
        if header.num_blocks != num_blocks:
            raise ValueError(f"header says {header.num_blocks} blocks, {num_blocks} given")

    def _start(self, address: str, header: KVHeader, deadline_s: float, fill, block_ids) -> None:
        """Register the transfer, fill its payload and send it; every failure is a result."""
        rid = header.request_id
        now = time.monotonic()
        transfer = _Transfer(address, header, started=now, deadline=now + deadline_s)
        self._pending[rid] = transfer
        try:
            frames = self._prepare(transfer, fill, block_ids)
        except (zmq.ZMQError, OSError, cuda_ipc.CudaIpcError) as exc:
            self._finish(rid, False, f"send failed: {exc}")
            return
        except Exception as exc:  # still exactly one result, and no segment left behind
            # The traceback as text: a record holding the frames would keep the segment mapped.
            log.error("kv send of %s failed:\n%s", rid, traceback.format_exc())
            self._finish(rid, False, f"send failed: {exc}")
            return
        self._transmit(transfer, frames)

    def _transmit(self, transfer: _Transfer, frames: list) -> None:
        """Send a registered transfer's header and payload frames; a failure is its result."""
        rid = transfer.header.request_id
        try:
            socket = self._peer(transfer.address)
            socket.send_multipart([encode(transfer.header), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._finish(rid, False, "peer send queue full")
        except (zmq.ZMQError, OSError) as exc:
            self._finish(rid, False, f"send failed: {exc}")
        except Exception as exc:  # still exactly one result
            log.error("kv send of %s failed:\n%s", rid, traceback.format_exc())
            self._finish(rid, False, f"send failed: {exc}")

    def request(self, address: str, message: bytes) -> bool:
        """Send one small message (a `KVFetch`) to a peer's kv socket; False if it could not be
        queued (the asker then computes instead of waiting)."""
        try:
            self._peer(address).send(message, flags=zmq.NOBLOCK)
            return True
        except (zmq.ZMQError, OSError):
            return False

    def _prepare(self, transfer: _Transfer, fill, block_ids: list[int]) -> list:
        """Fill the header's size, checksums and transport fields; return the payload frames."""
        header = transfer.header
        n = header.num_blocks
        header.nbytes = payload.payload_nbytes(self.kv_cache, n, self.kv_scales)
        header.block_checksums = []
        if header.transport == "tcp":
            data = fill(None)
            transfer.payload = data
            view = payload.as_bytes(data)
            header.block_checksums = self._checksums(view, n)
            return [view]
        if header.transport == "shm":
            header.shm_name = ""
            if header.nbytes:
                transfer.segment = self.segments.acquire(header.nbytes)
                data = memoryview(transfer.segment.mapping)[: header.nbytes]
                fill(data)
                header.block_checksums = self._checksums(data, n)
                header.shm_name = transfer.segment.name
            return []
        if self.kv_scales is not None:
            raise cuda_ipc.CudaIpcError("an 8-bit KV cache travels over tcp or shm, not cuda_ipc")
        if self.kv_cache.is_cuda:
            # The peer reads our memory directly: the prefill that wrote it must have finished.
            torch.cuda.synchronize(self.kv_cache.device)
        exported = self._ipc_exports.get(transfer.address)
        if exported is None:
            exported = self._ipc_exports[transfer.address] = cuda_ipc.export(self.kv_cache)
        header.ipc_handle = cuda_ipc.encode_ref(exported, block_ids)
        return []

    def _checksums(self, data: memoryview, num_blocks: int) -> list[int]:
        return payload.block_checksums(data, self.kv_cache, self.kv_scales, num_blocks)

    def _peer(self, address: str) -> zmq.Socket:
        socket = self._peers.pop(address, None)
        if socket is not None:
            self._peers[address] = socket  # the most recently used, last
        else:
            self._trim_peers(MAX_PEERS - 1)
            socket = self.context.socket(zmq.DEALER)
            if self.keys is not None:
                self.keys.connect_as_client(socket)
            socket.setsockopt(zmq.LINGER, 0)
            keepalive(socket)
            socket.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
            # an endpoint of its own: pyzmq's default names it by the fd, which a socket made
            # after this one closes may reuse while the old monitor is still bound
            monitor = socket.get_monitor_socket(
                _LINK_EVENTS, f"inproc://kvsender-monitor-{next(_monitor_ids)}"
            )
            monitor.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(address)
            except zmq.ZMQError:
                monitor.close(linger=0)
                socket.close(linger=0)
                raise
            self._peers[address] = socket
            self._monitors[address] = monitor
            self._down.discard(address)
        return socket

    def peer_down(self, address: str) -> bool:
        """Whether the connection to `address` was lost or refused and is not back (its peer
        died, or nothing listens there); False while it connects or is up, or with no socket."""
        monitor = self._monitors.get(address)
        if monitor is None:
            return False
        for _ in range(_MAX_LINK_EVENTS_PER_CHECK):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_CONNECTED:
                self._down.discard(address)
            else:
                self._down.add(address)
        return address in self._down

    def poll(self) -> list[TransferResult]:
        """Collect acks from every peer and expire deadlines; the transfers that ended since."""
        for address, socket in list(self._peers.items()):
            while True:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_reply(address, frames)
        now = time.monotonic()
        for rid, transfer in list(self._pending.items()):
            if now > transfer.deadline:
                self._finish(rid, False, "deadline")
        results, self._done = self._done, []
        return results

    def _on_reply(self, address: str, frames: list[bytes]) -> None:
        try:
            ack = decode_kv(frames[-1]) if len(frames) == 1 else None
        except ProtocolError as exc:
            log.warning("bad reply from %s: %s", address, exc)
            return
        if not isinstance(ack, KVAck):
            log.warning("unexpected reply from %s (%d frames)", address, len(frames))
            return
        transfer = self._pending.get(ack.request_id)
        if transfer is None or transfer.address != address:
            return  # a late ack for a transfer that already ended (deadline or abort)
        self._finish(ack.request_id, ack.ok, ack.reason, replied=True, recompute=ack.recompute)

    def abort(self, request_id: str) -> None:
        """End a transfer now (result 'aborted' on the next poll); unknown ids are ignored."""
        if request_id in self._pending:
            self._finish(request_id, False, "aborted")

    def num_pending(self) -> int:
        return len(self._pending)

    def ack_sockets(self) -> list[zmq.Socket]:
        """The sockets of peers with a transfer in flight: where its ack will come. A worker
        waiting for acks polls them with its other sockets (`poll` reads every one each turn,
        so none stays readable across turns)."""
        addresses = {t.address for t in self._pending.values()}
        return [self._peers[a] for a in addresses if a in self._peers]

    def _finish(
        self, request_id: str, ok: bool, reason: str, replied: bool = False, recompute: bool = False
    ) -> None:
        transfer = self._pending.pop(request_id)
        if transfer.segment is not None:
            # Only a reply proves the receiver is done reading: else it may be reading still.
            if replied:
                self.segments.release(transfer.segment)
            else:
                self.segments.discard(transfer.segment)
        seconds = time.monotonic() - transfer.started
        nbytes = transfer.header.nbytes
        self._done.append(TransferResult(request_id, ok, reason, nbytes, seconds, recompute))
        if not ok and reason in ("deadline", "aborted"):
            self._drop_idle_peer(transfer.address)

    def _drop_idle_peer(self, address: str) -> None:
        """Close a peer's socket when nothing else is in flight to it, so that a dead or stuck
        peer's queued payloads are freed now (zmq would hold them until it reconnects)."""
        self.drop_peer(address)

    def drop_peer(self, address: str) -> bool:
        """Close the socket to `address` unless a transfer to it is in flight (a fetch that got
        no answer: the peer may be dead, and its queued messages go with the socket); a later
        send connects anew. True if it was closed."""
        if any(t.address == address for t in self._pending.values()):
            return False
        return self._close_peer(address)

    def _close_peer(self, address: str) -> bool:
        socket = self._peers.pop(address, None)
        monitor = self._monitors.pop(address, None)
        self._down.discard(address)
        if socket is not None:
            socket.disable_monitor()
        if monitor is not None:
            monitor.close(linger=0)
        if socket is None:
            return False
        socket.close(linger=0)
        return True

    def _trim_peers(self, keep: int) -> None:
        """Close the least recently used idle sockets until at most `keep` are open (sockets
        with transfers in flight are kept: their deadlines bound them)."""
        busy = {t.address for t in self._pending.values()}
        for address in list(self._peers):
            if len(self._peers) <= keep:
                return
            if address not in busy:
                self._close_peer(address)

    def num_peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        """Unlink every segment, pooled or lent, and close the sockets; pending transfers just
        end."""
        self.segments.close()
        self._pending.clear()
        for address in list(self._peers):
            self._close_peer(address)
        if self._own_context:
            self.context.term()
