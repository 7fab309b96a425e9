"""KV transfer from prefill to decode workers (DESIGN.md section 6), and the choice of transport.

The prefill worker owns a `KVSender`, the decode worker a `KVReceiver`; both poll them from their
event loops. The router calls `choose_transport` when it pairs a prefill with a decode worker.
Modules: `sender` / `receiver` (the two ends), `payload` (layout, checksum, block copies), `shm`
and `cuda_ipc` (same-host transports; tcp is plain ZeroMQ frames).
"""

from __future__ import annotations

from kvtransfer.payload import kv_layout
from kvtransfer.receiver import KVReceiver, ReceivedKV
from kvtransfer.sender import TRANSPORTS, KVSender, TransferResult

__all__ = [
    "KVReceiver",
    "KVSender",
    "ReceivedKV",
    "TRANSPORTS",
    "TransferResult",
    "choose_transport",
    "kv_layout",
]


def choose_transport(requested: str, same_host: bool, device_type: str) -> str:
    """The transport for one prefill -> decode pair.

    'auto': cuda_ipc on one host with CUDA caches, shm on one host otherwise, tcp across hosts.
    An explicit 'tcp' / 'shm' / 'cuda_ipc' is kept as asked (shm works for CUDA caches too, through
    host memory); ValueError for anything else, or cuda_ipc without CUDA.
    """
    if requested == "auto":
        if not same_host:
            return "tcp"
        return "cuda_ipc" if device_type == "cuda" else "shm"
    if requested not in TRANSPORTS:
        raise ValueError(f"kv transport must be auto, tcp, shm or cuda_ipc, not {requested!r}")
    if requested == "cuda_ipc" and device_type != "cuda":
        raise ValueError(f"cuda_ipc needs CUDA caches, not {device_type!r}")
    return requested
