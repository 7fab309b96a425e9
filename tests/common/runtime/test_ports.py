"""common/runtime/ports.py: a port another process listens on is found before anything binds it,
named with its flag; free ports and port 0 pass. (`pdserve up` / `pdserve router` on a busy port:
tests/e2e/test_up.py.)"""

from __future__ import annotations

import socket

import pytest

from common.runtime.ports import PortInUse, check_port_free


@pytest.fixture
def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_a_listening_port_is_busy_with_its_flag_in_one_line(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    with pytest.raises(PortInUse) as e:
        check_port_free("127.0.0.1", port, "--control-port")
    message = str(e.value)
    assert f"port {port} (--control-port)" in message and "\n" not in message
    assert (e.value.port, e.value.flag) == (port, "--control-port")
    # Every interface includes loopback: ZeroMQ's "*" and 0.0.0.0 see the same port taken.
    for host in ("0.0.0.0", "*"):
        with pytest.raises(PortInUse):
            check_port_free(host, port, "--port")


def test_free_ports_and_port_zero_pass(listening: socket.socket) -> None:
    check_port_free("127.0.0.1", 0, "--port")  # the OS picks: never busy
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    check_port_free("127.0.0.1", port, "--port")
    check_port_free("no-such-host.invalid", 8000, "--port")  # the real bind reports that
