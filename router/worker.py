"""A worker as the router sees it, and the live workers of one role ordered by load.

Owns `Worker`: one registered worker's `Register` message, the ZeroMQ identities it speaks from,
when it was last heard from, its latest `Heartbeat`, and its load as the router itself counts it
(requests dispatched and not finished, prompt tokens queued for prefill); and `LiveWorkers`: the
workers of one role that take new work, by id, with the least loaded found without looking at
every worker (a heap of (load, id) entries: a worker whose load changes is pushed again, entries
that no longer match their worker's load are dropped when they reach the top, and the heap is
rebuilt when stale entries outnumber the live ones). Beside the heap: the workers at each load
(the order's first field) and the lowest and highest load (two heaps of loads, kept the same
lazy way), and the ids in sorted order with each one's position (rebuilt only when a worker
joins or leaves), for policies that rotate among equals. A routing decision at 1,000 workers
then costs what it costs at 10.

A `Worker` tells its owner when a field its load or liveness is read from changes (`watch`):
the registry keeps each role's `LiveWorkers` up to date that way, whoever changed the field (the
dispatcher counting a request, a heartbeat, a test). Used by `router.registry` (which builds and
indexes them), `router.policy` and `router.dispatch`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator

from common.protocol import Heartbeat, Register, Role


class Worker:
    """One registered worker, as the router sees it.

    The fields its load or liveness is read from (`num_in_flight`, `queued_prefill_tokens`,
    `heartbeat`, `dead_reason`, `info`) are properties that tell the watcher (`watch`) when set;
    the others are plain attributes, set at no extra cost (`last_seen_s` moves with every message).
    """

    __slots__ = (
        "_info", "identity", "last_seen_s", "_heartbeat", "progress_s", "_dead_reason",
        "_num_in_flight", "_queued_prefill_tokens", "refused_until_s", "num_prefill_dispatched",
        "prefix_matched_tokens", "_on_change",
    )  # fmt: skip

    def __init__(
        self,
        info: Register,
        identity: bytes,  # the DEALER identity that registered: where commands go
        last_seen_s: float,
        heartbeat: Heartbeat | None = None,
        progress_s: float = 0.0,  # when its heartbeat's loop count last moved (or it registered)
        dead_reason: str = "",  # set when found unreachable: removed at the next `expire`
        num_in_flight: int = 0,  # requests dispatched here, not yet finished (the router's count)
        queued_prefill_tokens: int = 0,  # prefill: prompt tokens dispatched, no first token yet
        refused_until_s: float = 0.0,  # decode: skipped for new requests until then (it refused)
        num_prefill_dispatched: int = 0,  # prefill: prompts sent here (for /metrics)
        prefix_matched_tokens: int = 0,  # prefill: prompt tokens the index said it held
    ) -> None:
        self._on_change: Callable[[Worker, bool], None] | None = None
        self._info = info
        self.identity = identity
        self.last_seen_s = last_seen_s
        self._heartbeat = heartbeat
        self.progress_s = progress_s
        self._dead_reason = dead_reason
        self._num_in_flight = num_in_flight
        self._queued_prefill_tokens = queued_prefill_tokens
        self.refused_until_s = refused_until_s
        self.num_prefill_dispatched = num_prefill_dispatched
        self.prefix_matched_tokens = prefix_matched_tokens

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.worker_id!r})"

    def watch(self, on_change: Callable[[Worker, bool], None] | None) -> None:
        """Call `on_change(self, load_only)` whenever a watched field is set (None: stop);
        `load_only`: only its load may have changed (a count of the router's, or a heartbeat
        that did not start or stop its drain), not whether it takes new work."""
        self._on_change = on_change

    def _changed(self, load_only: bool) -> None:
        on_change = self._on_change
        if on_change is not None:
            on_change(self, load_only)

    @property
    def info(self) -> Register:
        return self._info

    @info.setter
    def info(self, value: Register) -> None:
        self._info = value
        self._changed(False)

    @property
    def heartbeat(self) -> Heartbeat | None:
        return self._heartbeat

    @heartbeat.setter
    def heartbeat(self, value: Heartbeat | None) -> None:
        was_draining = self.draining
        self._heartbeat = value
        self._changed(self.draining == was_draining)  # mostly the load it reports

    @property
    def dead_reason(self) -> str:
        return self._dead_reason

    @dead_reason.setter
    def dead_reason(self, value: str) -> None:
        self._dead_reason = value
        self._changed(False)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @num_in_flight.setter
    def num_in_flight(self, value: int) -> None:
        self._num_in_flight = value
        self._changed(True)

    @property
    def queued_prefill_tokens(self) -> int:
        return self._queued_prefill_tokens

    @queued_prefill_tokens.setter
    def queued_prefill_tokens(self, value: int) -> None:
        self._queued_prefill_tokens = value
        self._changed(True)

    @property
    def worker_id(self) -> str:
        return self._info.worker_id

    @property
    def role(self) -> Role:
        return self._info.role

    @property
    def draining(self) -> bool:
        return self._heartbeat is not None and self._heartbeat.draining

    def sends_from(self, identity: bytes) -> bool:
        """Whether a message from this ZeroMQ identity may speak for this worker."""
        return identity == self.identity or (
            bool(self._info.heartbeat_identity) and identity == self._info.heartbeat_identity
        )

    def has_work(self) -> bool:
        """Requests dispatched here and not finished, or sequences it reports holding."""
        hb = self._heartbeat
        return self._num_in_flight > 0 or (hb is not None and hb.num_running + hb.num_waiting > 0)

    @property
    def decode_load(self) -> int:
        """Sequences running or reserved: the router's count, or the worker's if it knows more."""
        hb = self._heartbeat
        reported = hb.num_running + hb.num_waiting if hb is not None else 0
        return max(self._num_in_flight, reported)

    @property
    def prefill_load(self) -> int:
        """Prompt tokens left to compute: the router's own count from dispatch until the first
        token (a heartbeat is up to a second old: a burst must not pile onto one worker before
        it reports), or the worker's, if it reports more (the load other routers placed)."""
        hb = self._heartbeat
        reported = hb.queued_prefill_tokens if hb is not None else 0
        return max(self._queued_prefill_tokens, reported)

    @property
    def kv_cache_usage(self) -> float | None:
        """Fraction of KV blocks in use, from the last heartbeat."""
        hb = self._heartbeat
        if hb is None or hb.num_blocks <= 0:
            return None
        return 1.0 - hb.num_free_blocks / hb.num_blocks


def decode_order(w: Worker) -> tuple:
    """Decode workers, least loaded first: running plus reserved sequences, then id."""
    return (w.decode_load, w.worker_id)


def prefill_order(w: Worker) -> tuple:
    """Prefill workers, least loaded first: queued prompt tokens, requests, then id."""
    return (w.prefill_load, w.num_in_flight, w.worker_id)


def order_for(role: Role) -> Callable[[Worker], tuple]:
    return decode_order if role == "decode" else prefill_order


class LiveWorkers:
    """Workers that take new work, by id, least loaded first by `order` (see the module doc)."""

    def __init__(self, order: Callable[[Worker], tuple], workers: Iterable[Worker] = ()) -> None:
        self.order = order
        self.by_id: dict[str, Worker] = {}
        self.salts: Counter[tuple[bytes, int]] = Counter()  # (kv_salt, block_size) -> workers
        self._salt_of: dict[str, tuple[bytes, int]] = {}
        self._filed: dict[str, tuple] = {}  # each worker's order in its newest heap entry
        self._heap: list[tuple[tuple, int, Worker]] = []
        self._seq = itertools.count()  # heap tie-break: entries never compare workers
        self._at_load: dict[float, set[str]] = {}  # order's first field -> worker ids
        self._low_loads: list[float] = []  # heaps of the loads in `_at_load` (lazy, as above)
        self._high_loads: list[float] = []  # negated
        self._ids: list[str] | None = None  # sorted; None after a worker joined or left
        self._position: dict[str, int] = {}
        for w in workers:
            self.add(w)

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.by_id.values())

    def __contains__(self, worker: Worker) -> bool:
        return self.by_id.get(worker.worker_id) is worker

    def get(self, worker_id: str) -> Worker | None:
        return self.by_id.get(worker_id)

    def add(self, worker: Worker) -> None:
        """File the worker under its load now (again, if it is here: its load changed)."""
        worker_id = worker.worker_id
        salt = (worker.info.kv_salt, worker.info.block_size)
        old = self.by_id.get(worker_id)
        if old is not worker or self._salt_of[worker_id] != salt:
            if old is not None:
                self.discard(old)
            self.by_id[worker_id] = worker
            self._salt_of[worker_id] = salt
            self.salts[salt] += 1
            self._ids = None
        self._file(worker, worker_id)

    def refile(self, worker: Worker) -> None:
        """The worker's load changed, nothing else: file it under the new one if it is here."""
        worker_id = worker.worker_id
        if self.by_id.get(worker_id) is worker:
            self._file(worker, worker_id)

    def _file(self, worker: Worker, worker_id: str) -> None:
        order = self.order(worker)
        filed = self._filed.get(worker_id)
        if filed == order:
            return  # filed under this load already (a heartbeat that changed nothing)
        if filed is None or filed[0] != order[0]:
            if filed is not None:
                self._leave_load(worker_id, filed[0])
            self._join_load(worker_id, order[0])
        self._filed[worker_id] = order
        heapq.heappush(self._heap, (order, next(self._seq), worker))
        self._compact()

    def discard(self, worker: Worker) -> None:
        if self.by_id.get(worker.worker_id) is worker:
            del self.by_id[worker.worker_id]
            salt = self._salt_of.pop(worker.worker_id)
            filed = self._filed.pop(worker.worker_id, None)
            if filed is not None:
                self._leave_load(worker.worker_id, filed[0])
            self._ids = None
            self.salts[salt] -= 1
            if self.salts[salt] <= 0:
                del self.salts[salt]
            self._compact()

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self.by_id) + 64:  # mostly stale entries: start afresh
            self._filed = {w.worker_id: self.order(w) for w in self.by_id.values()}
            self._heap = [(o, next(self._seq), self.by_id[i]) for i, o in self._filed.items()]
            heapq.heapify(self._heap)
            self._at_load = {}
            for worker_id, order in self._filed.items():
                self._at_load.setdefault(order[0], set()).add(worker_id)
            self._rebuild_load_heaps()

    def _join_load(self, worker_id: str, load: float) -> None:
        group = self._at_load.get(load)
        if group is None:
            group = self._at_load[load] = set()
            heapq.heappush(self._low_loads, load)
            heapq.heappush(self._high_loads, -load)
            if len(self._low_loads) > 2 * len(self._at_load) + 64:
                self._rebuild_load_heaps()
        group.add(worker_id)

    def _leave_load(self, worker_id: str, load: float) -> None:
        group = self._at_load.get(load)
        if group is not None:
            group.discard(worker_id)
            if not group:
                del self._at_load[load]  # its heap entries go stale

    def _rebuild_load_heaps(self) -> None:
        self._low_loads = list(self._at_load)
        self._high_loads = [-load for load in self._at_load]
        heapq.heapify(self._low_loads)
        heapq.heapify(self._high_loads)

    def at_load(self, load: float) -> set[str]:
        """Ids of the workers whose order starts with `load` (do not modify)."""
        return self._at_load.get(load, set())

    def load_range(self, exclude: Collection[str] = ()) -> tuple[float, float] | None:
        """The lowest and highest load (the order's first field) of the workers not in
        `exclude`; None if there are none. Without `exclude` it looks at no worker."""
        if exclude:  # a retry after a failed send: rare, so a look at every load will do
            loads = [k for k, ids in self._at_load.items() if any(i not in exclude for i in ids)]
            return (min(loads), max(loads)) if loads else None
        low, high, at_load = self._low_loads, self._high_loads, self._at_load
        while low and low[0] not in at_load:
            heapq.heappop(low)
        while high and -high[0] not in at_load:
            heapq.heappop(high)
        return (low[0], -high[0]) if low else None

    def ids_in_order(self) -> list[str]:
        """The workers' ids, sorted (do not modify); `position` gives each one's index."""
        if self._ids is None:
            self._ids = sorted(self.by_id)
            self._position = {worker_id: i for i, worker_id in enumerate(self._ids)}
        return self._ids

    def position(self, worker_id: str) -> int:
        """The worker's index in `ids_in_order()`."""
        self.ids_in_order()
        return self._position[worker_id]

    def least(self, now_s: float, accept: Callable[[Worker], bool] | None = None) -> Worker | None:
        """The least loaded worker that has not refused work since `now_s` (and that `accept`
        takes, when given); None if there is none."""
        heap, skipped, found = self._heap, [], None
        while heap:
            order, _, w = heap[0]
            if self.by_id.get(w.worker_id) is not w or self.order(w) != order:
                heapq.heappop(heap)  # stale: the worker left, or has a newer entry
                continue
            if w.refused_until_s > now_s or (accept is not None and not accept(w)):
                skipped.append(heapq.heappop(heap))
                continue
            found = w
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found


def as_live(
    workers: Iterable[Worker] | LiveWorkers, order: Callable[[Worker], tuple]
) -> LiveWorkers:
    """`workers` as a `LiveWorkers` (a plain list of workers is indexed on the spot)."""
    return workers if isinstance(workers, LiveWorkers) else LiveWorkers(order, workers)
