"""The router's table of workers: registration, liveness and load.

Owns one `Worker` (`router.worker`) per registered worker id, and per role the live ones (taking
new work: not draining, not found unreachable) as a `LiveWorkers` index kept up to date as
workers register, heartbeat, drain, die and take or finish requests, so that choosing a worker
never scans them all (`live_index`; `live` lists them). Validates registrations: the protocol
version, the model and the block size must agree across the cluster, and the KV layout (dtype,
layers, KV heads, head size) with the workers of the other role, else the worker is refused. A
worker is dead and removed (`expire`; the caller fails or re-dispatches its requests) when it was
silent for `timeout_s`, when its main loop made no progress for `stall_timeout_s` while it had
work (its heartbeats count the loop's turns), or when the control plane found it unreachable
(`mark_dead`).

Also asks every worker for its KV block books (`block_books`, for `/debug/block_books` and the
e2e leak checks) and matches the replies.

Called by the control plane in `router.control` (messages in), by `router.policy` and
`router.dispatch` (choosing workers, counting load) and by `router.app` (/health, /metrics).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Collection

import msgspec

from common.protocol import (
    HEARTBEAT_TIMEOUT_S,
    PROTOCOL_VERSION,
    BlockBooksQuery,
    BlockBooksReply,
    Heartbeat,
    Register,
    RegisterAck,
    Role,
)
from router.worker import LiveWorkers, Worker, order_for

__all__ = ["Registry", "Worker"]

log = logging.getLogger(__name__)

ROLES: tuple[Role, ...] = ("prefill", "decode")


class Registry:
    """Live workers by id. Not thread-safe: used from the router's event loop only."""

    def __init__(
        self,
        model_names: Collection[str],
        block_size: int | None = None,
        timeout_s: float = HEARTBEAT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        stall_timeout_s: float = 30.0,
    ) -> None:
        self.model_names = set(model_names)  # what a worker's Register.model may say
        self.block_size = block_size  # fixed by flag, else by the first worker while any lives
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s  # 0: never declare a stuck loop dead
        self.clock = clock
        self.workers: dict[str, Worker] = {}
        self._live: dict[str, LiveWorkers] = {r: LiveWorkers(order_for(r)) for r in ROLES}
        self._max_model_len: int | None = -1  # -1: to be counted again
        self._books: dict[tuple[str, int], asyncio.Future[BlockBooksReply]] = {}
        self._book_queries = itertools.count()

    def register(self, identity: bytes, msg: Register) -> RegisterAck:
        """Accept or refuse a `Register`; a known worker id re-registering is updated in place."""
        reason = self._refusal(identity, msg)
        if reason:
            log.warning("refusing worker %r: %s", msg.worker_id, reason)
            return RegisterAck(accepted=False, reason=reason)
        now = self.clock()
        worker = self.workers.get(msg.worker_id)
        if worker is None:
            self._max_model_len = -1
            worker = self.workers[msg.worker_id] = Worker(
                info=msg, identity=identity, last_seen_s=now, progress_s=now
            )
            worker.watch(self._changed)
            self._changed(worker)
            log.info(
                "%s worker %r registered (%d blocks, host %s)",
                msg.role,
                msg.worker_id,
                msg.num_blocks,
                msg.host,
            )
        else:  # the same connection again: requests in flight on it are still its own
            worker.info, worker.last_seen_s, worker.progress_s = msg, now, now
            self._max_model_len = -1
        return RegisterAck(accepted=True)

    def _refusal(self, identity: bytes, msg: Register) -> str:
        if msg.version != PROTOCOL_VERSION:
            return f"protocol version {msg.version}, the router speaks {PROTOCOL_VERSION}"
        if identity != msg.worker_id.encode():
            return "the control socket identity must equal worker_id"
        # (A second connection under a live worker's identity never gets here: the control
        # socket ignores it. See router.control.)
        old = self.workers.get(msg.worker_id)
        if old is not None and old.dead_reason:
            return f"worker id {msg.worker_id!r} is being removed ({old.dead_reason})"
        if msg.model not in self.model_names:
            return f"model {msg.model!r}, the router serves {sorted(self.model_names)}"
        block_size = self.block_size
        if block_size is None:
            other = next((w for w in self.workers.values() if w.worker_id != msg.worker_id), None)
            block_size = other.info.block_size if other is not None else None
        if block_size is not None and msg.block_size != block_size:
            return f"block size {msg.block_size}, the cluster uses {block_size}"
        if old is not None and old.role != msg.role:
            return f"worker id {msg.worker_id!r} is already registered as {old.role}"
        return self._layout_refusal(msg)

    def _layout_refusal(self, msg: Register) -> str:
        """Why KV could not move between this worker and the other role's, or '' if it can."""
        for other in self.workers.values():
            if other.role == msg.role or other.worker_id == msg.worker_id:
                continue
            for name in ("dtype", "num_layers", "num_kv_heads", "head_dim"):
                mine, theirs = getattr(msg, name), getattr(other.info, name)
                if mine != theirs:
                    return (
                        f"KV cache {name} {mine!r}, but {other.role} worker {other.worker_id!r} "
                        f"has {theirs!r}: no KV transfer between them could work"
                    )
        return ""

    def touch(self, worker_id: str) -> Worker | None:
        """Any message from a worker proves it alive; None for an unknown worker."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen_s = self.clock()
        return worker

    def on_heartbeat(self, msg: Heartbeat) -> Worker | None:
        worker = self.touch(msg.worker_id)
        if worker is not None:
            old = worker.heartbeat
            if old is None or msg.loop_count != old.loop_count:
                worker.progress_s = self.clock()
            worker.heartbeat = msg
        return worker

    def mark_dead(self, worker: Worker, reason: str) -> None:
        """The worker cannot be reached: no new work now, removed at the next `expire`."""
        if not worker.dead_reason and self.workers.get(worker.worker_id) is worker:
            worker.dead_reason = reason

    def _death(self, worker: Worker, now: float) -> str:
        """Why the worker counts as dead now, or ''."""
        if worker.dead_reason:
            return worker.dead_reason
        if worker.last_seen_s < now - self.timeout_s:
            return f"missed heartbeats for {self.timeout_s:.1f} s"
        counted = worker.heartbeat is not None and worker.heartbeat.loop_count >= 0
        stalled_s = now - worker.progress_s
        if self.stall_timeout_s > 0 and counted and worker.has_work():
            if stalled_s > self.stall_timeout_s:
                return f"its main loop made no progress for {stalled_s:.1f} s while it had work"
        return ""

    def expire(self) -> list[Worker]:
        """Remove and return the dead workers: silent for longer than `timeout_s`, stuck with work
        for longer than `stall_timeout_s`, or marked unreachable."""
        now = self.clock()
        silent_before, stalled_before = now - self.timeout_s, now - self.stall_timeout_s
        stalls = self.stall_timeout_s > 0
        # Run 5 times a second over every worker: a cheap look first, the reason only for those.
        suspects = [
            w
            for w in self.workers.values()
            if w.dead_reason
            or w.last_seen_s < silent_before
            or (
                stalls
                and w.progress_s < stalled_before
                and w.heartbeat is not None
                and w.heartbeat.loop_count >= 0
            )
        ]
        dead = []
        for worker in suspects:
            reason = self._death(worker, now)
            if reason:
                log.warning("%s worker %r %s: removed", worker.role, worker.worker_id, reason)
                del self.workers[worker.worker_id]
                self._max_model_len = -1
                self._changed(worker)
                worker.watch(None)
                dead.append(worker)
        return dead

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    def live(self, role: Role) -> list[Worker]:
        """Workers of `role` that take new work (a draining worker only finishes what it has)."""
        return list(self._live[role])

    def live_index(self, role: Role) -> LiveWorkers:
        """The live workers of `role`, least loaded first (kept up to date: do not modify)."""
        return self._live[role]

    def has_live(self, role: Role) -> bool:
        return len(self._live[role]) > 0

    def _changed(self, worker: Worker, load_only: bool = False) -> None:
        """A field of the worker's load or liveness changed: refile it in its role's index
        (`load_only`: under its new load, if it is there). (A registered worker keeps its role:
        registering again under another is refused.)"""
        live = self._live[worker.role]
        if load_only:
            live.refile(worker)
        elif (
            self.workers.get(worker.worker_id) is worker
            and not worker.dead_reason
            and not worker.draining
        ):
            live.add(worker)
        else:
            live.discard(worker)

    def max_model_len(self) -> int | None:
        """The longest prompt + output every live worker can hold; None with no workers.
        (Asked per request: kept from the last registration or removal, not counted again.)"""
        if self._max_model_len == -1:
            lens = [w.info.max_model_len for w in self.workers.values() if w.info.max_model_len > 0]
            self._max_model_len = min(lens) if lens else None
        return self._max_model_len

    async def block_books(
        self, send: Callable[[Worker, msgspec.Struct], bool], timeout_s: float = 5.0
    ) -> dict[str, BlockBooksReply | None]:
        """Every registered worker's KV block books (None: no answer within `timeout_s`)."""
        query_id = next(self._book_queries)
        loop = asyncio.get_running_loop()
        asked: dict[str, asyncio.Future[BlockBooksReply]] = {}
        for worker in list(self.workers.values()):
            future = loop.create_future()
            self._books[(worker.worker_id, query_id)] = future
            asked[worker.worker_id] = future
            if not send(worker, BlockBooksQuery(query_id)):
                future.cancel()
        try:
            pending = [f for f in asked.values() if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=timeout_s)
        finally:
            for worker_id in asked:
                self._books.pop((worker_id, query_id), None)
        return {
            worker_id: f.result() if f.done() and not f.cancelled() else None
            for worker_id, f in asked.items()
        }

    def on_block_books(self, worker: Worker, msg: BlockBooksReply) -> None:
        future = self._books.get((worker.worker_id, msg.query_id))
        if future is not None and not future.done():
            future.set_result(msg)
