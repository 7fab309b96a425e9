"""Load profiles (as GuideLLM): when each request is sent.

`synchronous` (one at a time), `concurrent` (N in flight), `constant` (a fixed arrival rate),
`poisson` (exponential inter-arrival times at a rate, seeded) and `sweep` (constant at several
rates, by default between the synchronous and the max-concurrency throughput). A run stops
launching at `num_requests` or `duration_s`, whichever comes first; cancelling it cancels its
in-flight requests, whose results are kept marked "cancelled".
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.bench.client import RequestResult, send_request
from common.bench.datasets import BenchRequest

if TYPE_CHECKING:
    import httpx

PROFILES = ("synchronous", "concurrent", "constant", "poisson", "sweep")
NUM_SWEEP_RATES = 5


@dataclass
class Run:
    """One profile run: its parameters and, as they finish, its request results."""

    name: str
    profile: str
    rate: float | None = None
    concurrency: int | None = None
    t0: float = 0.0
    duration_s: float = 0.0
    total: int | None = None
    results: list[RequestResult] = field(default_factory=list)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 else 0.0


class Source:
    """Hands out the dataset's requests, cycling, until the count or the time limit is reached."""

    def __init__(
        self,
        dataset: list[BenchRequest],
        num_requests: int | None,
        duration_s: float | None,
        t0: float,
    ) -> None:
        self.dataset, self.num_requests, self.duration_s, self.t0 = (
            dataset,
            num_requests,
            duration_s,
            t0,
        )
        self.sent = 0

    def next(self) -> tuple[int, BenchRequest] | None:
        if self.num_requests is not None and self.sent >= self.num_requests:
            return None
        if self.duration_s is not None and time.perf_counter() - self.t0 >= self.duration_s:
            return None
        index = self.sent
        self.sent += 1
        return index, self.dataset[index % len(self.dataset)]


async def execute(
    run: Run,
    client: httpx.AsyncClient,
    model: str,
    dataset: list[BenchRequest],
    num_requests: int | None,
    duration_s: float | None,
    seed: int = 0,
) -> Run:
    """Runs one non-sweep profile to completion (or cancellation), filling `run.results`."""
    run.t0 = time.perf_counter()
    run.total = num_requests
    source = Source(dataset, num_requests, duration_s, run.t0)
    tasks: set[asyncio.Task] = set()

    async def send(index: int, request: BenchRequest) -> None:
        await send_request(client, model, request, index, run.t0, run.results)

    async def one_by_one() -> None:
        while (item := source.next()) is not None:
            await send(*item)

    def spawn(coro) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)

    try:
        if run.profile == "synchronous":
            await one_by_one()
        elif run.profile == "concurrent":
            for _ in range(run.concurrency or 1):
                spawn(one_by_one())
        elif run.profile in ("constant", "poisson"):
            rng = random.Random(seed)
            rate = run.rate or 1.0
            next_s = 0.0
            while (item := source.next()) is not None:
                delay = run.t0 + next_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                spawn(send(*item))
                next_s += rng.expovariate(rate) if run.profile == "poisson" else 1.0 / rate
        else:
            raise ValueError(f"unknown profile {run.profile!r}")
        if tasks:
            await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        run.duration_s = time.perf_counter() - run.t0
    return run


def request_rate(run: Run) -> float:
    """Completed requests per second of the run."""
    done = sum(r.ok for r in run.results)
    return done / run.duration_s if run.duration_s > 0 else 0.0


def sweep_rates(sync_rate: float, max_rate: float) -> list[float]:
    """NUM_SWEEP_RATES rates evenly spaced strictly between the two measured throughputs."""
    if max_rate <= sync_rate:
        max_rate = 2 * sync_rate
    step = (max_rate - sync_rate) / (NUM_SWEEP_RATES + 1)
    return [round(sync_rate + step * (i + 1), 4) for i in range(NUM_SWEEP_RATES)]
