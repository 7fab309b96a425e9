"""The cluster secret and the ZeroMQ CURVE keys derived from it: who may join a cluster.

Owns reading the secret (`--cluster-secret-file`, else $PDSERVE_CLUSTER_SECRET_FILE, else
$PDSERVE_CLUSTER_SECRET itself; `pdserve up` generates one and hands it to its children in the
environment), deriving two CURVE key pairs from it deterministically (the server's, for the
router's control socket, and the clients', for every worker), and applying them to sockets. A
worker without the secret does not know the server's public key, so its CURVE handshake fails
and the router never sees a message from it; what passes is encrypted. Without a secret nothing
is encrypted and the control socket must stay on loopback (`check_bind`). Used by
`router.control` (server side) and `common.runtime.worker` (client side).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"


def read_secret(secret_file: str = "") -> bytes:
    """The cluster secret from the file flag, or the environment; b'' when none is set."""
    path = secret_file or os.environ.get(SECRET_FILE_ENV, "")
    if path:
        secret = Path(path).expanduser().read_bytes().strip()
        if not secret:
            raise ValueError(f"the cluster secret file {path} is empty")
        return secret
    return os.environ.get(SECRET_ENV, "").strip().encode()


def _keypair(secret: bytes, purpose: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys derived from the cluster secret for `purpose`."""
    raw = hashlib.blake2b(secret, digest_size=32, person=b"pdserve-curve", salt=purpose).digest()
    private = z85.encode(raw)
    return zmq.curve_public(private), private


@dataclass(frozen=True)
class ClusterKeys:
    """Both key pairs of one cluster (everyone holding the secret can derive them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE: no cluster secret possible")
        server_public, server_secret = _keypair(secret, b"server")
        client_public, client_secret = _keypair(secret, b"client")
        return cls(server_public, server_secret, client_public, client_secret)

    def serve(self, sock: zmq.Socket) -> None:
        """Make a socket (before bind) accept only CURVE clients that know the server key."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def connect_as_client(self, sock: zmq.Socket) -> None:
        """Make a socket (before connect) speak CURVE to a server of this cluster."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def load_keys(secret_file: str = "") -> ClusterKeys | None:
    """The cluster's keys, or None without a secret."""
    secret = read_secret(secret_file)
    return ClusterKeys.from_secret(secret) if secret else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_bind(host: str, keys: ClusterKeys | None, what: str) -> None:
    """Without a secret, `what` may listen on loopback only (say so); ValueError otherwise."""
    if keys is not None:
        log.info("%s: CURVE-authenticated with the cluster secret", what)
        return
    if not is_loopback(host):
        raise ValueError(
            f"{what} on {host} without a cluster secret would let anyone who reaches it join the "
            f"cluster: set --cluster-secret-file or {SECRET_ENV}, or bind a loopback address"
        )
    log.warning(
        "%s: no cluster secret (--cluster-secret-file / %s): unauthenticated, so bound to "
        "loopback (%s) only",
        what,
        SECRET_ENV,
        host,
    )
