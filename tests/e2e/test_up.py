"""`pdserve up`: one command brings up router + workers, prints the URL, and stops them all.

Ports 0: the OS picks both router ports and `up` prints the HTTP one it was given."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai


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
