"""`common.cli.bound_openmp_spin`: workers' OpenMP threads spin briefly unless told otherwise."""

from __future__ import annotations

import sys

import pytest

from common import cli


@pytest.fixture()
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh `pdserve` process, where torch is not imported yet."""
    monkeypatch.delitem(sys.modules, "torch")


def test_sets_the_spin_count_before_torch_loads(no_torch) -> None:
    env: dict[str, str] = {}
    assert cli.bound_openmp_spin(env)
    assert env == {"GOMP_SPINCOUNT": cli.OPENMP_SPINCOUNT}


@pytest.mark.parametrize("given", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_the_users_own_setting_wins(no_torch, given: dict[str, str]) -> None:
    env = dict(given)
    assert not cli.bound_openmp_spin(env)
    assert env == given


def test_too_late_once_torch_is_loaded() -> None:
    pytest.importorskip("torch")
    env: dict[str, str] = {}
    assert not cli.bound_openmp_spin(env)  # libgomp read its environment when torch loaded it
    assert env == {}
