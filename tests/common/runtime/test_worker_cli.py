"""common/runtime/worker_cli.py: a CPU worker builds every C kernel of the CPU path before it
registers (`build_cpu_kernels`), so a fresh kernel cache's compiles do not fall on the first
request, where the router's stall check took the silent worker for a stuck one."""

from __future__ import annotations

import pytest

from common.kernels import cpu_attention, cpu_layer, cpu_ops, cpu_qgemm, cpu_quant
from common.runtime.worker_cli import build_cpu_kernels


def test_build_cpu_kernels_builds_every_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    for module, name in ((cpu_ops, "available"), (cpu_attention, "available"),
                         (cpu_layer, "available"), (cpu_quant, "c_available"),
                         (cpu_qgemm, "available")):  # fmt: skip
        monkeypatch.setattr(module, name, lambda m=module: built.append(m.__name__) or False)
    build_cpu_kernels()  # a kernel that cannot be built (False) is no error: torch runs instead
    assert sorted(built) == sorted(
        m.__name__ for m in (cpu_ops, cpu_attention, cpu_layer, cpu_quant, cpu_qgemm)
    )
