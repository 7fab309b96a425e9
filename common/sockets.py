"""Liveness options for every TCP ZeroMQ socket of the cluster (control plane and KV transfer).

TCP keepalive keeps idle links through NAT and load balancers from being dropped silently, and
ZMTP heartbeats make a peer that vanished without closing its connection (a host that died, a
partition) show up as a disconnect within seconds instead of never. Harmless on ipc:// and
inproc://, where ZeroMQ ignores them. Called where each socket is made.
"""

from __future__ import annotations

import zmq

KEEPALIVE_IDLE_S = 30  # probes start after this much silence
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3
HEARTBEAT_IVL_MS = 2000  # ZMTP PING this often
HEARTBEAT_TIMEOUT_MS = 10_000  # no traffic for this long after a PING: the peer is gone


def keepalive(sock: zmq.Socket) -> zmq.Socket:
    """Set TCP keepalive and ZMTP heartbeats on `sock` (before it connects or binds)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return sock
