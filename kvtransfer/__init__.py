"""KV transfer from prefill to decode workers (DESIGN.md section 6), and the choice of transport.

The prefill worker owns a `KVSender`, the decode worker a `KVReceiver`; both poll them from their
event loops. The router calls `choose_transport` (`kvtransfer.transport`) when it pairs a prefill
with a decode worker. Modules: `sender` / `receiver` (the two ends), `payload` (layout, block
checksums, block copies), `shm` and `cuda_ipc` (same-host transports; tcp is plain ZeroMQ frames).

The two ends (and torch, which they need) are imported on first use, so that the router can import
`choose_transport` without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtransfer.transport import choose_transport

if TYPE_CHECKING:
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

_LAZY = {
    "kv_layout": "kvtransfer.payload",
    "KVReceiver": "kvtransfer.receiver",
    "ReceivedKV": "kvtransfer.receiver",
    "TRANSPORTS": "kvtransfer.sender",
    "KVSender": "kvtransfer.sender",
    "TransferResult": "kvtransfer.sender",
}


def __getattr__(name: str) -> Any:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
