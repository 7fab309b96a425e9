"""One streamed request, timed: start, every content chunk, end, token counts from usage, error.

`RequestResult` is the one record of a timed request and holds the one definition of each latency
(TTFT, ITL, TPOT, E2E) that `pdserve bench` and the benchmarks in `benchmarks/` report.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from common.bench.datasets import BenchRequest

if TYPE_CHECKING:
    import httpx


@dataclass
class RequestResult:
    """The timings of one request, in seconds since the run's start (`chunk_times_s` likewise)."""

    index: int
    start_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def itls_s(self) -> list[float]:
        """Inter-token latencies: every gap between two chunks that carry text."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1), as vLLM's
        benchmarks define it; None for fewer than two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(e2e_s=self.e2e_s, tpot_s=self.tpot_s)
        return d


def _content(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(
    client: httpx.AsyncClient,
    model: str,
    request: BenchRequest,
    index: int,
    t0: float,
    sink: list[RequestResult],
) -> RequestResult:
    """Streams one request and appends its result to `sink`, also when cancelled (then marked
    "cancelled" and re-raised); other failures become the result's `error`."""
    import httpx  # here, not at the top: `pdserve --help` does not need it

    result = RequestResult(index=index, start_s=time.perf_counter() - t0)
    try:
        async with client.stream("POST", request.path.lstrip("/"), json=request.body(model)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {body[:300]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    break
                now = time.perf_counter() - t0
                if _content(chunk):
                    if result.ttft_s is None:
                        result.ttft_s = now - result.start_s
                    result.chunk_times_s.append(now)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
        if result.error is None and result.output_tokens == 0:
            result.output_tokens = len(result.chunk_times_s)  # server sent no usage
    except asyncio.CancelledError:
        result.error = "cancelled"
        raise
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end_s = time.perf_counter() - t0
        sink.append(result)
    return result
