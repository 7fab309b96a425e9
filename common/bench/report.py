"""Benchmark reports: per-run metrics, results.json / results.csv / plot.png, Markdown summary.

Metrics per run: TTFT, ITL, TPOT and E2E at p50/p90/p99 (ms), request and output-token throughput,
goodput (requests/s meeting both SLOs: TTFT, and mean ITL as TPOT), error and cancelled counts.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np

from common.bench.profiles import Run

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")


def _percentiles(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"p{p}": None for p in PERCENTILES}
    ms = np.percentile(np.array(values_s) * 1000.0, PERCENTILES)
    return {f"p{p}": round(float(v), 3) for p, v in zip(PERCENTILES, ms)}


def summarize(run: Run, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    cancelled = sum(r.error == "cancelled" for r in run.results)
    duration = run.duration_s or 1e-9
    values = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "itl": [gap for r in ok for gap in r.itls_s],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "e2e": [r.e2e_s for r in ok],
    }
    summary: dict[str, Any] = {
        "name": run.name,
        "profile": run.profile,
        "rate": run.rate,
        "concurrency": run.concurrency,
        "duration_s": round(run.duration_s, 4),
        "requests": len(run.results),
        "completed": len(ok),
        "errors": len(run.results) - len(ok) - cancelled,
        "cancelled": cancelled,
        "request_throughput": round(len(ok) / duration, 4),
        "output_token_throughput": round(sum(r.output_tokens for r in ok) / duration, 3),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
    }
    for name in LATENCIES:
        for key, v in _percentiles(values[name]).items():
            summary[f"{name}_{key}_ms"] = v
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        good = 0
        for r in ok:
            ttft_ok = slo_ttft_ms is None or (
                r.ttft_s is not None and r.ttft_s * 1e3 <= slo_ttft_ms
            )
            itl_ok = slo_itl_ms is None or (r.tpot_s or 0.0) * 1e3 <= slo_itl_ms
            good += ttft_ok and itl_ok
        summary["goodput"] = round(good / duration, 4)
    else:
        summary["goodput"] = None
    return summary


REQUEST_COLUMNS = (
    "run",
    "index",
    "start_s",
    "end_s",
    "ttft_s",
    "e2e_s",
    "tpot_s",
    "itl_mean_s",
    "prompt_tokens",
    "output_tokens",
    "error",
)


def _request_rows(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        for r in sorted(run.results, key=lambda r: r.index):
            itls = r.itls_s
            rows.append(
                {
                    "run": run.name,
                    "index": r.index,
                    "start_s": round(r.start_s, 6),
                    "end_s": round(r.end_s, 6),
                    "ttft_s": r.ttft_s,
                    "e2e_s": round(r.e2e_s, 6),
                    "tpot_s": r.tpot_s,
                    "itl_mean_s": sum(itls) / len(itls) if itls else None,
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": r.output_tokens,
                    "error": r.error or "",
                }
            )
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | tuple) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(
    output_dir: Path,
    config: dict[str, Any],
    runs: list[Run],
    summaries: list[dict[str, Any]],
    interrupted: bool,
) -> None:
    """results.json, results.csv (per request; per run for sweep, plus requests.csv), plot.png."""
    output_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": config,
        "interrupted": interrupted,
        "runs": [
            {"summary": s, "requests": [r.to_dict() for r in sorted(run.results, key=_index)]}
            for run, s in zip(runs, summaries)
        ],
    }
    (output_dir / "results.json").write_text(json.dumps(doc, indent=1))
    rows = _request_rows(runs)
    if config.get("profile") == "sweep":
        columns = list(summaries[0]) if summaries else ["name"]
        _write_csv(output_dir / "results.csv", summaries, columns)
        _write_csv(output_dir / "requests.csv", rows, REQUEST_COLUMNS)
        plot_sweep(output_dir / "plot.png", summaries)
    else:
        _write_csv(output_dir / "results.csv", rows, REQUEST_COLUMNS)
        plot_timeline(output_dir / "plot.png", runs)


def _index(r) -> int:
    return r.index


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(path: Path, summaries: list[dict[str, Any]]) -> None:
    """Latency percentiles against achieved request throughput, one panel per metric."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(4 * len(LATENCIES), 3.6))
    points = sorted(summaries, key=lambda s: s["request_throughput"])
    x = [s["request_throughput"] for s in points]
    for ax, name in zip(axes, LATENCIES):
        for p in PERCENTILES:
            y = [s[f"{name}_p{p}_ms"] for s in points]
            ax.plot(x, [np.nan if v is None else v for v in y], marker="o", label=f"p{p}")
        ax.set_title(f"{name.upper()} (ms)")
        ax.set_xlabel("requests/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(path: Path, runs: list[Run]) -> None:
    """One bar per request from start to end, the wait for the first token in orange; errors red."""
    plt = _pyplot()
    results = sorted((r for run in runs for r in run.results), key=_index)
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.18 * len(results) + 1.2)))
    for row, r in enumerate(results):
        color = "tab:red" if r.error else "tab:blue"
        ax.barh(row, r.e2e_s, left=r.start_s, height=0.6, color=color)
        if r.ttft_s is not None:
            ax.barh(row, r.ttft_s, left=r.start_s, height=0.6, color="tab:orange")
    ax.set_xlabel("seconds since start (orange: until the first token, blue: decoding)")
    ax.set_ylabel("request")
    ax.set_title(", ".join(run.name for run in runs) or "no requests")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def markdown(summaries: list[dict[str, Any]]) -> str:
    head = [
        "run",
        "ok/err",
        "req/s",
        "out tok/s",
        "goodput",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "TPOT p50 ms",
        "E2E p50/p99 ms",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        cells = [
            s["name"],
            f"{s['completed']}/{s['errors'] + s['cancelled']}",
            f"{s['request_throughput']:.2f}",
            _fmt(s["output_token_throughput"]),
            "-" if s["goodput"] is None else f"{s['goodput']:.2f}",
            "/".join(_fmt(s[f"ttft_p{p}_ms"]) for p in PERCENTILES),
            "/".join(_fmt(s[f"itl_p{p}_ms"]) for p in PERCENTILES),
            _fmt(s["tpot_p50_ms"]),
            f"{_fmt(s['e2e_p50_ms'])}/{_fmt(s['e2e_p99_ms'])}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
