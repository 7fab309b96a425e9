"""A Prometheus-style cumulative histogram, kept by the router and by workers alike.

Owns the bucket arithmetic and the bucket sets that suit both a 2-core CPU and a GPU (latencies
from a millisecond to minutes). Workers send theirs to the router as `HistogramSnapshot` in each
heartbeat; `router.metrics` renders both kinds.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from common.protocol import HistogramSnapshot

# Seconds. KV transfers: sub-millisecond (CUDA IPC, a few blocks) to tens of seconds (tcp, long
# prompts on a slow network).
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip


class Histogram:
    """Counts per bucket (`le` upper bounds, plus +Inf), sum and count."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(list(self.buckets), list(self.counts), self.sum, self.count)
