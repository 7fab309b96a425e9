"""The router's Prometheus metrics, rendered as text for `GET /metrics`.

Owns the router-side series (request latencies as histograms, token and request counters) and the
rendering of everything `/metrics` shows, including per-worker series from the workers' heartbeats
(labelled worker="id"): block gauges, KV cache usage, routing counts and the prefix index size,
every counter a worker reports in `Heartbeat.counters` and every histogram in
`Heartbeat.histograms`, passed through as `pdserve:<name>`. Names are `pdserve:` + vLLM's
suffix where vLLM has one. No prometheus_client dependency: the text format is small.

Every family users query is there from the first scrape, HELP and TYPE included, so dashboards,
autoscaler rules and alerts see zeros, not "no data", on a cluster that has served nothing:
request_success_total and request_errors_total start at 0 for every finish reason and error code
the router answers with, and the worker series in `WORKER_FAMILIES` at 0 for each worker that
heartbeats without them; before any worker is live, the per-worker families carry HELP and TYPE
only (they have no worker to label yet). Worker counters are the worker's own totals, replaced by
each heartbeat, never summed here: a worker's prefix-cache queries count once per request.

Called by `router.app` (a `RequestTimer` per request, `render` for /metrics, with the admission
counts of `router.admission`).
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from common.protocol import HistogramSnapshot
from common.runtime.histogram import KV_TRANSFER_BUCKETS, Histogram
from router.admission import Admission
from router.kv_index import PrefixIndex
from router.registry import Worker

PREFIX = "pdserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# Seconds, from a GPU's few milliseconds per token to a 2-core CPU's minutes per long request.
E2E_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_:]")

# Series at 0 from the first scrape: what a choice can finish with, the codes requests fail with.
FINISH_REASONS = ("stop", "length", "tool_calls")
ERROR_CODES = (400, 404, 413, 429, 499, 500, 503, 504)

# A worker's KV tier (--kv-offload-memory: "cpu", as vLLM names host RAM; --kv-offload-dir: "disk"),
# reported by workers that have one: name -> (type, help).
KV_TIER_FAMILIES: dict[str, tuple[str, str]] = {
    "external_prefix_cache_queries_total": ("counter", "Prompt tokens looked up with a KV tier "
                                            "present, once per request."),
    "external_prefix_cache_hits_total": ("counter", "Prompt tokens reloaded from the KV tier "
                                         "instead of computed."),
    "kv_offload_reloads_declined_total": ("counter", "Blocks found in the KV tier but computed: "
                                          "prefill measured cheaper than the reload."),
    **{f"kv_offload_{tier}_{name}": (kind, f"{what} ({where}).")
       for tier, where in (("cpu", "host RAM tier"), ("disk", "disk tier"))
       for name, kind, what in (
           ("block_lookup_total", "counter", "KV blocks looked up in the tier"),
           ("block_hit_total", "counter", "KV blocks found in the tier"),
           ("block_miss_total", "counter", "KV blocks not found, or found damaged"),
           ("block_store_total", "counter", "KV blocks written to the tier"),
           ("block_eviction_total", "counter", "KV blocks dropped to stay within the bound"),
           ("stores_skipped_total", "counter", "KV blocks not stored: queue full, write error"),
           ("usage_bytes", "gauge", "Bytes of KV blocks held"),
           ("capacity_bytes", "gauge", "Bytes of KV blocks the tier may hold"),
       )},
    "kv_offload_disk_corrupt_total": ("counter", "Block files refused by the checksum or size "
                                      "check (deleted, computed instead)."),
    "kv_offload_disk_write_errors_total": ("counter", "Block files that could not be written "
                                           "(a full disk, a missing directory)."),
}  # fmt: skip

# What workers report in their heartbeats: name -> (type, help, roles that report it).
WORKER_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "num_preemptions_total": ("counter", "Sequences preempted (KV freed, recomputed later).",
                              ("prefill", "decode")),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the worker's prefix "
                                   "cache, once per request.", ("prefill", "decode")),
    "prefix_cache_hits_total": ("counter", "Prompt tokens found in the worker's prefix cache.",
                                ("prefill", "decode")),
    "spec_decode_num_drafts_total": ("counter", "Verify steps of drafting sequences.",
                                     ("prefill", "decode")),
    "spec_decode_num_draft_tokens_total": ("counter", "Draft tokens proposed.",
                                           ("prefill", "decode")),
    "spec_decode_num_accepted_tokens_total": ("counter", "Draft tokens accepted.",
                                              ("prefill", "decode")),
    "kv_transfer_failures_total": ("counter", "KV transfers that failed.", ("prefill", "decode")),
    "kv_transfer_bytes_total": ("counter", "KV bytes sent to decode workers.", ("prefill",)),
    "kv_transfer_seconds": ("histogram", "KV transfer, send to acknowledgement.", ("prefill",)),
    "kv_transfer_received_bytes_total": ("counter", "KV bytes received from prefill workers.",
                                         ("decode",)),
    "kv_transfer_recomputed_total": ("counter", "KV transfers that arrived damaged and were "
                                     "prefilled on the decode worker instead.", ("decode",)),
    "kv_cache_bytes_per_token": ("gauge", "Bytes one cached token takes (all layers, K and V, "
                                 "8-bit scales).", ("prefill", "decode")),
    "prefill_kv_computed_tokens_total": ("counter", "Tokens computed in prefill: not taken from "
                                         "the prefix cache or its tier.", ("prefill", "decode")),
    "kv_peer_fetched_tokens_total": ("counter", "Prompt tokens whose KV was fetched from a peer "
                                     "worker instead of computed.", ("prefill", "decode")),
    "kv_peer_fetched_bytes_total": ("counter", "KV bytes fetched from peer workers.",
                                    ("prefill", "decode")),
    "kv_peer_fetch_failures_total": ("counter", "Peer fetches that brought no blocks (the peer "
                                     "died, did not answer in time, held none): computed "
                                     "instead.", ("prefill", "decode")),
    "kv_peer_fetch_declined_total": ("counter", "Peer fetch hints not followed: computing "
                                     "measured cheaper.", ("prefill", "decode")),
    "kv_peer_served_tokens_total": ("counter", "Tokens of KV blocks sent to peer workers that "
                                    "fetched them.", ("prefill", "decode")),
    "cpu_borrowed_thread_steps_total": ("counter", "Engine steps run with more torch threads "
                                        "than the worker's own, borrowed from idle workers on "
                                        "the same machine (pdserve up --lend-cores).",
                                        ("prefill", "decode")),
    "cpu_core_give_back_wait_seconds_total": ("counter", "Time the worker waited for cores it "
                                              "had lent to come back.", ("prefill", "decode")),
    "cpu_cores_given_back_inside_a_step_total": ("counter", "Times the worker handed borrowed "
                                                 "cores back between the layers of a step, to a "
                                                 "worker that turned busy.",
                                                 ("prefill", "decode")),
    **{name: (kind, help_, ("prefill", "decode"))
       for name, (kind, help_) in KV_TIER_FAMILIES.items()},
}  # fmt: skip

# Per-worker series the router derives itself (its own counts, heartbeat gauges): name -> (type,
# help).
_ROUTER_WORKER_FAMILIES = {
    "worker_num_requests_in_flight": ("gauge", "Requests the router has on the worker."),
    "prefill_dispatched_total": ("counter", "Prompts the router sent to the worker."),
    "prefix_routing_matched_tokens_total": ("counter", "Prompt tokens the router's index said "
                                            "the worker held when it got the prompt."),
    "prefill_queued_tokens": ("gauge", "Prompt tokens dispatched to the worker, first token not "
                              "yet back (routing load)."),
    "kv_index_blocks": ("gauge", "Prefix blocks the router's index holds for a worker."),
    "num_free_blocks": ("gauge", "Free KV blocks (heartbeat)."),
    "num_blocks": ("gauge", "KV blocks (heartbeat)."),
    "kv_cache_usage_perc": ("gauge", "KV cache usage, 1 = full."),
    "worker_num_requests_running": ("gauge", "Sequences running (heartbeat)."),
    "worker_num_requests_waiting": ("gauge", "Sequences waiting (heartbeat)."),
    "worker_queued_prefill_tokens": ("gauge", "Prompt tokens queued (heartbeat)."),
    "spec_decode_mean_accepted_length": ("gauge", "Tokens a drafting sequence gains per verify "
                                         "step: 1 + accepted / drafts."),
}  # fmt: skip

Labels = tuple[tuple[str, str], ...]


@dataclass
class _Family:
    type: str
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)  # (suffix, labels, v)


class RouterMetrics:
    """Counters and histograms the router keeps itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue_time = Histogram(TTFT_BUCKETS)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success_total: dict[str, int] = defaultdict(int)  # by finish reason
        self.request_errors_total: dict[int, int] = defaultdict(int)  # by HTTP status

    def start_request(self) -> RequestTimer:
        return RequestTimer(self, self.clock())

    def render(
        self,
        num_running: int,
        num_waiting: int,
        workers: Iterable[Worker],
        index: PrefixIndex | None = None,
        admission: Admission | None = None,
        num_migrations: int = 0,
    ) -> str:
        families: dict[str, _Family] = {}

        def declare(name: str, type_: str, help_: str) -> None:
            """HELP and TYPE even while the family has no sample (no worker to label yet)."""
            families.setdefault(name, _Family(type_, help_))

        def add(name: str, type_: str, help_: str, value: float, labels: Labels = ()) -> None:
            family = families.setdefault(name, _Family(type_, help_))
            family.samples.append(("", labels, value))

        def add_histogram(
            name: str, help_: str, h: Histogram | HistogramSnapshot, labels: Labels = ()
        ) -> None:
            family = families.setdefault(name, _Family("histogram", help_))
            cumulative = 0
            for bound, count in zip((*h.buckets, math.inf), h.counts):
                cumulative += count
                family.samples.append(("_bucket", (*labels, ("le", _number(bound))), cumulative))
            family.samples.append(("_sum", labels, h.sum))
            family.samples.append(("_count", labels, h.count))

        add("num_requests_running", "gauge", "Choices being served by workers.", num_running)
        add("num_requests_waiting", "gauge", "Choices waiting for a decode worker.", num_waiting)
        if admission is not None:
            add("num_requests_admitted_waiting", "gauge",
                "Requests admitted and not yet dispatched (reading, tokenizing or queued for a "
                "decode worker); --max-waiting-requests bounds it.",
                admission.num_waiting)  # fmt: skip
            add("num_requests_rejected_total", "counter",
                "Requests refused with a 429: --max-waiting-requests were waiting, the relay "
                "held --max-buffered-tokens, or the event loop ran --max-loop-lag-s late.",
                admission.num_rejected)  # fmt: skip
            add("router_event_loop_lag_seconds", "gauge",
                "How late the router's event loop runs its timers, smoothed over about a second "
                "(the router's CPU shortage).", admission.loop_lag.lag_s)  # fmt: skip
        add_histogram("time_to_first_token_seconds", "Request arrival to first token.", self.ttft)
        add_histogram("inter_token_latency_seconds", "Time between output tokens.", self.itl)
        add_histogram("e2e_request_latency_seconds", "Request arrival to last token.", self.e2e)
        add_histogram("request_queue_time_seconds", "Request arrival to dispatch.", self.queue_time)
        add("prompt_tokens_total", "counter", "Prompt tokens served.", self.prompt_tokens_total)
        add(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            self.generation_tokens_total,
        )
        success_help = "Finished choices by finish reason."
        for reason in sorted({*FINISH_REASONS, *self.request_success_total}):
            n = self.request_success_total.get(reason, 0)
            add("request_success_total", "counter", success_help, n, (("finished_reason", reason),))
        for code in sorted({*ERROR_CODES, *self.request_errors_total}):
            add("request_errors_total", "counter", "Requests answered with an error.",
                self.request_errors_total.get(code, 0), (("code", str(code)),))  # fmt: skip
        add("request_migrations_total", "counter",
            "Choices moved to another decode worker after theirs died or stalled mid-stream.",
            num_migrations)  # fmt: skip
        if index is not None:
            add("kv_index_resyncs_total", "counter",
                "Full KV snapshots the router asked workers for (lost KV events).",
                index.num_resyncs_asked)  # fmt: skip
        _add_workers(declare, add, add_histogram, list(workers), index)
        return _render(families)


def _add_workers(
    declare: Callable[[str, str, str], None],
    add: Callable[..., None],
    add_histogram: Callable[..., None],
    workers: list[Worker],
    index: PrefixIndex | None,
) -> None:
    for name, (kind, help_) in _ROUTER_WORKER_FAMILIES.items():
        if name != "kv_index_blocks" or index is not None:
            declare(name, kind, help_)
    for name, (kind, _, _) in WORKER_FAMILIES.items():
        declare(name, kind, _worker_help(name))
    for role in ("prefill", "decode"):
        n = sum(w.role == role for w in workers)
        add("num_workers", "gauge", "Live workers by role.", n, (("role", role),))
    for w in sorted(workers, key=lambda w: w.worker_id):
        labels = (("worker", w.worker_id), ("role", w.role))

        def put(name: str, value: float, labels: Labels = labels) -> None:
            kind, help_ = _ROUTER_WORKER_FAMILIES[name]
            add(name, kind, help_, value, labels)

        put("worker_num_requests_in_flight", w.num_in_flight)
        if w.role == "prefill":
            put("prefill_dispatched_total", w.num_prefill_dispatched)
            put("prefix_routing_matched_tokens_total", w.prefix_matched_tokens)
            put("prefill_queued_tokens", w.queued_prefill_tokens)
        if index is not None:
            put("kv_index_blocks", index.num_keys(w.worker_id))
        hb = w.heartbeat
        if hb is None:
            continue
        put("num_free_blocks", hb.num_free_blocks)
        put("num_blocks", hb.num_blocks)
        usage = w.kv_cache_usage
        if usage is not None:
            put("kv_cache_usage_perc", usage)
        put("worker_num_requests_running", hb.num_running)
        put("worker_num_requests_waiting", hb.num_waiting)
        put("worker_queued_prefill_tokens", hb.queued_prefill_tokens)
        # What the worker reports (its own totals, replaced by each heartbeat), and 0 for the
        # documented series its role has that it left out.
        counters = {
            name: 0.0
            for name, (kind, _, roles) in WORKER_FAMILIES.items()
            if kind == "counter" and w.role in roles
        }
        counters.update(hb.counters)
        for name, value in sorted(counters.items()):
            name = _NAME_BAD_CHARS.sub("_", name)
            if not name or name[0].isdigit():
                continue
            kind = "counter" if name.endswith("_total") else "gauge"
            add(name, kind, _worker_help(name), value, labels)
        drafts = hb.counters.get("spec_decode_num_drafts_total", 0.0)
        if drafts > 0:
            accepted = hb.counters.get("spec_decode_num_accepted_tokens_total", 0.0)
            put("spec_decode_mean_accepted_length", 1.0 + accepted / drafts)
        histograms: dict[str, Histogram | HistogramSnapshot] = {}
        if w.role == "prefill":
            histograms["kv_transfer_seconds"] = Histogram(KV_TRANSFER_BUCKETS)  # none sent yet
        histograms.update(hb.histograms)
        for name, snapshot in sorted(histograms.items()):
            name = _NAME_BAD_CHARS.sub("_", name)
            if name and not name[0].isdigit() and len(snapshot.counts) == len(snapshot.buckets) + 1:
                add_histogram(name, _worker_help(name), snapshot, labels)


def _worker_help(name: str) -> str:
    family = WORKER_FAMILIES.get(name)
    return family[1] + " Reported by the worker." if family else "Reported by workers."


def _render(families: dict[str, _Family]) -> str:
    lines = []
    for name, family in families.items():
        full = PREFIX + name
        lines.append(f"# HELP {full} {family.help}")
        lines.append(f"# TYPE {full} {family.type}")
        for suffix, labels, value in family.samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            label_text = "{" + label_text + "}" if label_text else ""
            lines.append(f"{full}{suffix}{label_text} {_number(value)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


class RequestTimer:
    """One request's timestamps, observed into the histograms as they happen."""

    def __init__(self, metrics: RouterMetrics, arrival_s: float) -> None:
        self.metrics = metrics
        self.arrival_s = arrival_s
        self._first_token_seen = False
        self._last_token_s: dict[int, float] = {}  # per choice

    def dispatched(self) -> None:
        self.metrics.queue_time.observe(self.metrics.clock() - self.arrival_s)

    def tokens(self, index: int, num_tokens: int) -> None:
        """Choice `index` received `num_tokens` new tokens."""
        if num_tokens <= 0:
            return
        now = self.metrics.clock()
        if not self._first_token_seen:
            self._first_token_seen = True
            self.metrics.ttft.observe(now - self.arrival_s)
        last = self._last_token_s.get(index)
        if last is not None:
            observe, itl = self.metrics.itl.observe, (now - last) / num_tokens
            for _ in range(num_tokens):
                observe(itl)
        self._last_token_s[index] = now

    def finished(
        self, prompt_tokens: int, completion_tokens: int, finish_reasons: Iterable[str]
    ) -> None:
        m = self.metrics
        m.e2e.observe(m.clock() - self.arrival_s)
        m.prompt_tokens_total += prompt_tokens
        m.generation_tokens_total += completion_tokens
        for reason in finish_reasons:
            m.request_success_total[reason] += 1

    def failed(self, code: int) -> None:
        self.metrics.request_errors_total[code] += 1
