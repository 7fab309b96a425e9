"""`pdserve bench` against a live colocated server (tiny model): every profile and dataset kind
writes results.json, results.csv and plot.png with the right number of sane requests; SIGINT ends a
running bench with partial results and exit code 130."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.cli import main
from tests.e2e.cluster import Cluster

SMALL = ["--prompt-tokens", "16", "--output-tokens", "4"]


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    with Cluster(str(chat_model_dir), tmp_path_factory.mktemp("bench-cluster"), 0, 1) as cluster:
        yield cluster


def bench_args(server: Cluster, out: Path, *extra: str) -> list[str]:
    return [
        "bench", "--base-url", server.url + "/v1", "--model", server.model,
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def check_outputs(out: Path, num_requests: int, sweep: bool = False) -> dict:
    """The three files exist; every request completed with sane timings; returns results.json."""
    doc = json.loads((out / "results.json").read_text())
    requests = [r for run in doc["runs"] for r in run["requests"]]
    assert len(requests) == num_requests
    for r in requests:
        assert r["error"] is None, r["error"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["output_tokens"] > 0 and r["prompt_tokens"] > 0
        assert r["start_s"] <= r["chunk_times_s"][0] <= r["end_s"]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == len(run["requests"]) and s["errors"] == 0
        assert s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["output_token_throughput"] > 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    if sweep:
        assert len(rows) == len(doc["runs"])
        assert len(list(csv.DictReader((out / "requests.csv").open()))) == num_requests
    else:
        assert len(rows) == num_requests
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    return doc


@pytest.mark.parametrize(
    "profile",
    [
        ["--profile", "synchronous"],
        ["--profile", "concurrent", "--concurrency", "2"],
        ["--profile", "constant", "--rate", "20"],
        ["--profile", "poisson", "--rate", "20", "--seed", "3"],
    ],
    ids=lambda p: p[1],
)
def test_profile(server, tmp_path, capsys, profile):
    args = bench_args(server, tmp_path, *profile, "--num-requests", "4", *SMALL)
    assert main([*args, "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"]) == 0
    doc = check_outputs(tmp_path, 4)
    summary = doc["runs"][0]["summary"]
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert "| run |" in capsys.readouterr().out


def test_sweep_measures_then_sweeps_rates(server, tmp_path):
    args = bench_args(server, tmp_path, "--profile", "sweep", "--num-requests", "2", *SMALL)
    assert main(args) == 0
    doc = check_outputs(tmp_path, 2 * 7, sweep=True)
    names = [run["summary"]["name"] for run in doc["runs"]]
    assert names[:2] == ["synchronous", "concurrent@2"]
    rates = [run["summary"]["rate"] for run in doc["runs"][2:]]
    assert len(rates) == 5 and rates == sorted(rates)


def test_sweep_given_rates(server, tmp_path):
    args = bench_args(
        server, tmp_path, "--profile", "sweep", "--rates", "5,10", "--num-requests", "2", *SMALL
    )
    assert main(args) == 0
    check_outputs(tmp_path, 4, sweep=True)


@pytest.mark.parametrize("dataset", ["shared-prefix", "repetitive", "jsonl"], ids=lambda d: d)
def test_dataset(server, tmp_path, dataset):
    extra = ["--tenants", "2", "--system-prompt-tokens", "64", "--question-tokens", "8"]
    if dataset == "jsonl":
        path = tmp_path / "in.jsonl"
        path.write_text(
            json.dumps({"prompt": "Hello there", "max_tokens": 3})
            + "\n"
            + json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
            + "\n"
        )
        dataset = str(path)
    out = tmp_path / "out"
    args = bench_args(server, out, "--dataset", dataset, "--num-requests", "4", *SMALL, *extra)
    assert main([*args, "--profile", "concurrent", "--concurrency", "2"]) == 0
    doc = check_outputs(out, 4)
    if dataset == "shared-prefix":  # two tenants' system prompts dominate the prompt length
        assert all(r["prompt_tokens"] > 64 for r in doc["runs"][0]["requests"])


def test_random_dataset_sends_exact_token_counts(server, tmp_path):
    args = bench_args(server, tmp_path, "--dataset", "random", "--num-requests", "3", *SMALL)
    assert main(args) == 0
    doc = check_outputs(tmp_path, 3)
    for r in doc["runs"][0]["requests"]:
        assert (r["prompt_tokens"], r["output_tokens"]) == (16, 4)


def test_sigint_writes_partial_results(server, tmp_path):
    args = bench_args(
        server, tmp_path, "--profile", "concurrent", "--concurrency", "2", "--num-requests",
        "1000", "--prompt-tokens", "16", "--output-tokens", "64",
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # progress lines: wait until some requests finished
            line = proc.stderr.readline()
            if not line:
                break
            if "[bench" in line and not line.split("] ")[1].startswith("0/"):
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "| run |" in stdout
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["interrupted"] is True
    summary = doc["runs"][0]["summary"]
    assert 0 < summary["completed"] < 1000
    assert summary["cancelled"] <= 2 and summary["errors"] == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == summary["requests"] == summary["completed"] + summary["cancelled"]
    assert (tmp_path / "plot.png").exists()
