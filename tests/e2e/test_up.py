"""`pdserve up`: one command brings up router + workers, prints the URL, and stops them all;
a worker that dies is restarted while the others keep serving. A busy port (`up` or `router`)
is one line naming it and its flag, before anything loads.

Ports 0: the OS picks both router ports and `up` prints the HTTP one it was given."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from common.runtime.launcher import parse_metrics

# The check comes before any model or tokenizer loads: Python and the CLI's imports, about 0.4 s
# of CPU (under a second of wall time on an idle machine; a loaded shared box stretches the wall
# time, hence its looser bound). Before the check a busy control port took 12-27 s and ended in a
# 36-line ZeroMQ traceback, after the router had loaded the tokenizer (seconds of CPU).
BUSY_PORT_CPU_S = 1.0
BUSY_PORT_WALL_S = 10.0


def children_alive(marker: str) -> list[str]:
    """Command lines of live processes that carry `marker` (the model directory)."""
    alive = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and "common.cli" in cmd and state != "Z":
            alive.append(cmd)
    return alive


def test_up_serves_and_stops_everything(chat_model_dir):
    marker = str(chat_model_dir)  # in the command line of up, the router and both workers
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "common.cli",
            "up",
            "--model",
            str(chat_model_dir),
            "--dtype",
            "float32",
            "--port",
            "0",
            "--control-port",
            "0",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--routing",
            "round_robin",
            "--local-prefill-max-tokens",
            "0",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "2",
            "--",
            "--kv-cache-memory",
            "64MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m and int(m.group(1)) > 0, line
        port = int(m.group(1))
        # With prefill workers the banner says which prompts reach them (the router's setting).
        note = proc.stdout.readline()
        assert "every prompt is prefilled on a prefill worker" in note, note
        assert "--local-prefill-max-tokens 0" in note, note
        children = children_alive(marker)
        assert len(children) == 4
        router = [c for c in children if " router " in c]
        assert len(router) == 1
        assert "--routing round_robin --local-prefill-max-tokens 0" in router[0]
        (decode,) = [c for c in children if " decode " in c]
        (prefill,) = [c for c in children if " prefill " in c]
        assert "--speculative ngram --num-speculative-tokens 2" in decode
        assert "--speculative" not in prefill
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(
            model=str(chat_model_dir), max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
        assert r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 5
    while children_alive(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children_alive(marker) == []


def child_pids(marker: str, role: str) -> list[int]:
    """Pids of the live `pdserve <role>` children that carry `marker`."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in args and role.encode() in args and state != "Z":
            pids.append(int(pid))
    return pids


def test_up_restarts_a_killed_worker_and_the_others_keep_serving(chat_model_dir, tmp_path):
    model = str(chat_model_dir)
    # The children write their logs to up's stderr: a file, so that no pipe fills and blocks them.
    stderr = open(tmp_path / "up.err", "w+")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "up", "--model", model, "--dtype", "float32",
         "--port", "0", "--control-port", "0", "--prefill", "0", "--decode", "2",
         "--num-threads", "1", "--", "--kv-cache-memory", "64MiB"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        assert m, line
        url = m.group(1)
        body = {"model": model, "prompt": "Tell me a long story", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        streams: list[list[str]] = [[] for _ in range(4)]

        def consume(i: int) -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    streams[i].append(line)

        threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        # least-loaded dispatch puts two streams on each worker; kill one once all flow
        deadline = time.monotonic() + 60
        while not all(len(s) > 4 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        decode_pids = child_pids(model, "decode")
        assert len(decode_pids) == 2
        os.kill(decode_pids[0], signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert proc.poll() is None  # `up` lives on
        failed = [s for s in streams if any('"error"' in e for e in s)]
        finished = [s for s in streams if any('"finish_reason": "length"' in e for e in s)]
        # the killed worker's streams move to the other worker: every stream finishes
        assert not failed and len(finished) == 4, [s[-2:] for s in streams]
        # the killed worker comes back: two decode workers again, both registered
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = child_pids(model, "decode")
            workers = {
                labels["worker"]
                for name, labels, _ in parse_metrics(httpx.get(url + "/metrics").text)
                if name == "pdserve:num_blocks"
            }
            if len(pids) == 2 and decode_pids[0] not in pids and len(workers) == 2:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the worker was not restarted: {pids} {workers}")
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        stderr.seek(0)
        err = stderr.read()
        stderr.close()
    assert code == 0, err[-3000:]
    assert "restarting it in" in err
    deadline = time.monotonic() + 5
    while children_alive(model) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children_alive(model) == []


@pytest.mark.parametrize("command", ["up", "router"])
@pytest.mark.parametrize("flag", ["--port", "--control-port"])
def test_a_busy_port_is_one_line_naming_it_and_its_flag(command: str, flag: str) -> None:
    other = "--control-port" if flag == "--port" else "--port"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(
            [sys.executable, "-m", "common.cli", command, flag, str(port), other, "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed_s = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the process and all it waited for
        cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"pdserve: error: port {port} ({flag}) is already in use on 127.0.0.1: stop what holds "
        f"it, or pass {flag} with another port (0 = any free port)"
    ]
    assert result.stdout == ""
    assert cpu_s < BUSY_PORT_CPU_S and elapsed_s < BUSY_PORT_WALL_S, (cpu_s, elapsed_s)
