"""Which KV transport a prefill -> decode pair uses: by where the workers run and what they can do.

Owns the one transport choice in the system; torch-free so that the router, which calls it for every
Prefill it sends (`router.dispatch`), does not import torch.
"""

from __future__ import annotations

from collections.abc import Collection


def choose_transport(
    same_host: bool, prefill_transports: Collection[str], decode_transports: Collection[str]
) -> str:
    """The transport for one prefill -> decode pair, from what both workers advertise.

    Workers advertise tcp and shm always, and cuda_ipc when their KV cache is on CUDA
    (`common.runtime.worker.WorkerBase.registration`). On one host: cuda_ipc when both advertise it
    (the KV never leaves the GPU), else shm when both do (through host memory); tcp otherwise.
    The router calls this for every Prefill it sends; a prefill worker started with an explicit
    `--kv-transport` uses that instead.
    """
    both = set(prefill_transports) & set(decode_transports)
    if same_host:
        for transport in ("cuda_ipc", "shm"):
            if transport in both:
                return transport
    return "tcp"
