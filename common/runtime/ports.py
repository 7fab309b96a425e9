"""Busy ports, found before anything heavy loads: one line naming the port and its flag.

A port some other process listens on would otherwise surface only when the router binds it,
after the tokenizer (and, under `pdserve up`, the workers' models) has loaded, as a raw ZeroMQ
traceback for the control port. `check_port_free` tries the bind itself and closes the socket at
once; called by `pdserve up` (`common.runtime.up`) and `pdserve router` (`router.cli`) first
thing. A port taken between that check and the real bind still fails the bind (`PortInUse`
from `router.server` for the control socket).
"""

from __future__ import annotations

import errno
import socket


class PortInUse(RuntimeError):
    """Another process holds a port a flag names; the message is the one line users read."""

    def __init__(self, host: str, port: int, flag: str) -> None:
        super().__init__(
            f"port {port} ({flag}) is already in use on {host or '0.0.0.0'}: stop what holds it, "
            f"or pass {flag} with another port (0 = any free port)"
        )
        self.host, self.port, self.flag = host, port, flag


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raise PortInUse when something listens on `host`:`port` (port 0: the OS picks, never
    busy). Other bind errors (a host this machine does not have) are left to the real bind."""
    if not port:
        return
    bind_host = "0.0.0.0" if host in ("", "*") else host  # ZeroMQ's "*": every interface
    try:
        infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            # As uvicorn and ZeroMQ bind: connections in TIME_WAIT do not make a port busy.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortInUse(host, port, flag) from None
