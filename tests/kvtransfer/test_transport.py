"""The one KV transport chooser: cuda_ipc, then shm on one host when both workers can; tcp else."""

from __future__ import annotations

import sys

import pytest

from kvtransfer import choose_transport

CPU = ("tcp", "shm")  # what a worker with its KV in host memory advertises
CUDA = ("tcp", "shm", "cuda_ipc")  # ... and one with its KV on a GPU


@pytest.mark.parametrize(
    ("same_host", "prefill", "decode", "expected"),
    [
        (True, CUDA, CUDA, "cuda_ipc"),
        (True, CPU, CPU, "shm"),
        (True, CUDA, CPU, "shm"),  # one side's KV is in host memory: no CUDA IPC
        (True, CPU, CUDA, "shm"),
        (False, CUDA, CUDA, "tcp"),
        (False, CPU, CPU, "tcp"),
        (True, ("tcp",), CUDA, "tcp"),  # a worker that cannot use shm
        (True, (), (), "tcp"),  # an old worker that lists nothing
    ],
)
def test_choose_transport(same_host, prefill, decode, expected) -> None:
    assert choose_transport(same_host, prefill, decode) == expected


def test_the_router_can_choose_without_torch() -> None:
    import subprocess

    code = "import sys, router.dispatch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
