"""deploy/nginx/api.conf, the compose entry point, run for real: nginx with that config in front of
two stand-in routers, answering through a stand-in of Docker's DNS.

Docker's DNS answers the service name `router` with every replica's address; here a small DNS
server on loopback answers it with 127.0.0.1 and 127.0.0.2, where two stand-in routers listen on
the same port. The config is used as written except for three addresses: the listen port, the
resolver (Docker's 127.0.0.11 -> the stand-in) and the routers' port. Checked: requests reach
both routers, a stream passes through unbuffered, a router that is gone or answers 503 costs a
retry on the other (not an error), and a router that appears in DNS later gets requests. Needs the
`nginx` binary (Debian: apt-get install nginx-light); skipped without it.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.deploy.test_compose import NGINX_CONF

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx not installed (apt-get install nginx)")
ROUTER_IPS = ("127.0.0.1", "127.0.0.2")  # all of 127/8 is loopback on Linux
VALID_S = 5  # the config's resolver valid=


class FakeDns:
    """Answers A queries for `router` with `self.addresses`; NXDOMAIN for any other name."""

    def __init__(self) -> None:
        self.addresses: list[str] = list(ROUTER_IPS)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(512)
            except OSError:
                return  # closed
            self.sock.sendto(self._answer(query), peer)

    def _answer(self, query: bytes) -> bytes:
        (ident,) = struct.unpack("!H", query[:2])
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1 : i + 1 + query[i]].decode())
            i += 1 + query[i]
        question = query[12 : i + 5]  # name, type, class
        qtype = struct.unpack("!H", query[i + 1 : i + 3])[0]
        known = ".".join(labels).lower() == "router"
        answers = list(self.addresses) if known and qtype == 1 else []
        flags = 0x8180 if known else 0x8183  # response, recursion desired + available; NXDOMAIN
        out = struct.pack("!HHHHHH", ident, flags, 1, len(answers), 0, 0) + question
        for address in answers:  # name: a pointer to the question's; type A, class IN, TTL 5
            out += struct.pack("!HHHIH", 0xC00C, 1, 1, VALID_S, 4) + socket.inet_aton(address)
        return out

    def close(self) -> None:
        self.sock.close()


class StandInRouter(BaseHTTPRequestHandler):
    """GET: 200, the router's address as the body. POST: 503 when `unavailable`, else an SSE
    stream of two events, the second only once `release` is set (so the test can see the first
    arrive alone)."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        self._reply(200, self.server.name.encode())

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.hits[self.server.name] += 1
        if self.server.unavailable:
            self._reply(503, b'{"error": {"message": "no workers"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {self.server.name}\n\n".encode())
        self.wfile.flush()
        self.server.release.wait(10)
        self.wfile.write(b"data: [DONE]\n\n")

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _start_router(address: str, port: int, hits: Counter) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((address, port), StandInRouter)
    server.daemon_threads = True
    server.name, server.hits = address, hits
    server.unavailable, server.release = False, threading.Event()
    server.release.set()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port(*addresses: str) -> int:
    """A TCP port free on every one of `addresses`."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        try:
            for address in addresses:
                with socket.socket() as s:
                    s.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no common free port")


class Stack:
    """nginx with deploy/nginx/api.conf, the fake DNS and one stand-in router per ROUTER_IPS."""

    def __init__(self, tmp: Path) -> None:
        self.dns = FakeDns()
        self.hits: Counter = Counter()
        router_port = _free_port(*ROUTER_IPS)
        self.routers = {ip: _start_router(ip, router_port, self.hits) for ip in ROUTER_IPS}
        self.port = _free_port("127.0.0.1")
        conf = NGINX_CONF.read_text()
        conf, n1 = re.subn(r"\blisten 8000;", f"listen 127.0.0.1:{self.port};", conf)
        conf, n2 = re.subn(
            r"\bresolver 127\.0\.0\.11\b", f"resolver 127.0.0.1:{self.dns.port}", conf
        )
        conf, n3 = re.subn(r"\brouter:8000\b", f"router:{router_port}", conf)
        assert (n1, n2, n3) == (1, 1, 1), "the config no longer has the addresses this test swaps"
        (tmp / "api.conf").write_text(conf)
        temp = "".join(
            f"{kind}_temp_path {tmp / kind};\n"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (tmp / "nginx.conf").write_text(
            # One process as the current user (a master running as root would switch its workers
            # to `nobody`, which cannot reach pytest's temporary directories).
            f"daemon off;\nmaster_process off;\npid {tmp / 'nginx.pid'};\n"
            f"error_log {tmp / 'error.log'} info;\nevents {{}}\n"
            f"http {{\naccess_log off;\n{temp}include {tmp / 'api.conf'};\n}}\n"
        )
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [NGINX, "-e", str(tmp / "startup.log"), "-p", str(tmp), "-c", str(tmp / "nginx.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"nginx did not start:\n{self.log()}")
                time.sleep(0.05)

    def log(self) -> str:
        return "".join(
            p.read_text(errors="replace")
            for p in (self.tmp / "startup.log", self.tmp / "error.log")
            if p.exists()
        )[-3000:]

    def post(self, client: httpx.Client) -> httpx.Response:
        return client.post(self.url + "/v1/completions", json={"prompt": "hi", "stream": True})

    def close(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)  # graceful; SIGTERM is nginx's fast shutdown
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for router in self.routers.values():
            router.shutdown()
            router.server_close()
        self.dns.close()


@pytest.fixture
def stack(tmp_path: Path):
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_config_passes_nginx_own_check(stack: Stack) -> None:
    result = subprocess.run(
        [NGINX, "-t", "-e", "stderr", "-p", str(stack.tmp), "-c", str(stack.tmp / "nginx.conf")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_requests_reach_every_router(stack: Stack) -> None:
    with httpx.Client(timeout=10) as client:
        seen = Counter(client.get(stack.url + "/v1/models").text for _ in range(40))
    assert set(seen) == set(ROUTER_IPS), (seen, stack.log())


def test_a_stream_passes_through_unbuffered(stack: Stack) -> None:
    for router in stack.routers.values():
        router.release.clear()  # the stream's end waits until its first event came through
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST", stack.url + "/v1/completions", json={"prompt": "hi", "stream": True}
        ) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_bytes()
        first = next(chunks)
        assert first.startswith(b"data: 127.0.0.") and b"[DONE]" not in first
        for router in stack.routers.values():
            router.release.set()
        assert b"data: [DONE]" in first + b"".join(chunks)


def test_a_router_without_workers_costs_a_retry_not_an_error(stack: Stack) -> None:
    stack.routers["127.0.0.2"].unavailable = True  # its /health and requests would be 503
    with httpx.Client(timeout=10) as client:
        codes = Counter(stack.post(client).status_code for _ in range(20))
    assert codes == {200: 20}, stack.log()
    assert stack.hits["127.0.0.2"] > 0  # it was asked, and the other answered instead


def test_a_router_that_is_gone_costs_a_retry_not_an_error(stack: Stack) -> None:
    gone = stack.routers.pop("127.0.0.2")  # still in DNS, as in the seconds after it stopped
    gone.shutdown()
    gone.server_close()
    with httpx.Client(timeout=10) as client:
        responses = [stack.post(client) for _ in range(20)]
    assert [r.status_code for r in responses] == [200] * 20, stack.log()
    assert all(r.text.startswith("data: 127.0.0.1") for r in responses)


def test_a_router_added_later_gets_requests(stack: Stack) -> None:
    stack.dns.addresses = ["127.0.0.1"]  # one replica, then `--scale router=2`
    with httpx.Client(timeout=10) as client:
        before = {client.get(stack.url + "/").text for _ in range(10)}
        assert before == {"127.0.0.1"}
        stack.dns.addresses = list(ROUTER_IPS)
        time.sleep(VALID_S + 1)  # nginx asks the DNS again once its answer expired
        after = Counter(client.get(stack.url + "/").text for _ in range(40))
    assert set(after) == set(ROUTER_IPS), (after, stack.log())
