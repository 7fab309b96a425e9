"""Core lending between the workers of one machine (common.runtime.cores): the borrowing rule,
giving cores back, dead borrowers, slot claims."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.runtime import cores
from common.runtime.cores import CoreLender, create_ledger


@pytest.fixture
def other_pid() -> Iterator[int]:
    """A live process standing for a second worker (slots are claimed by pid)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class Threads:
    """Records what a lender sets torch's thread count to."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def test_a_busy_worker_borrows_an_idle_ones_cores_and_gives_them_back(
    tmp_path: Path, other_pid: int
) -> None:
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=2, slots=4)
    decode_threads, prefill_threads = Threads(), Threads()
    decode = CoreLender(ledger, 1, decode_threads)
    prefill = CoreLender(ledger, 1, prefill_threads, pid=other_pid)
    assert decode.slot != prefill.slot
    # the prefill worker idles: the decode worker runs on both cores
    assert prefill.before_step(busy=False) == 1
    assert decode.before_step(busy=True) == 2
    assert decode_threads.calls == [2]
    assert decode.counters()["cpu_borrowed_thread_steps_total"] == 1
    # a prompt arrives: the prefill worker waits until the decode worker's next step starts
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(prefill.before_step(busy=True)))
    waiter.start()
    time.sleep(0.01)
    assert not got, "the prefill worker ran while its core was lent"
    assert decode.before_step(busy=True) == 1  # sees the prefill worker busy: gives it back
    waiter.join(timeout=5)
    assert got == [1]
    assert decode_threads.calls == [2, 1]
    assert prefill.counters()["cpu_core_give_back_wait_seconds_total"] > 0
    # both busy: nobody borrows, nobody waits
    start = time.monotonic()
    assert decode.before_step(busy=True) == 1 and prefill.before_step(busy=True) == 1
    assert time.monotonic() - start < cores.GIVE_BACK_WAIT_S
    # the decode worker's sequences finish: the prefill worker gets its core
    decode.before_step(busy=False)
    assert prefill.before_step(busy=True) == 2
    decode.close()
    prefill.close()


def test_a_borrower_that_does_not_give_back_delays_a_step_by_at_most_the_wait(
    tmp_path: Path, other_pid: int
) -> None:
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=2, slots=2)
    stuck = CoreLender(ledger, 1, Threads(), pid=other_pid)
    assert stuck.before_step(busy=True) == 2  # then a long step: it does not look again
    me = CoreLender(ledger, 1, Threads())
    start = time.monotonic()
    assert me.before_step(busy=True) == 1
    waited = time.monotonic() - start
    assert cores.GIVE_BACK_WAIT_S <= waited < cores.GIVE_BACK_WAIT_S + 0.5
    me.close()
    stuck.close()


def test_a_borrower_gives_back_inside_its_step_what_a_lender_turned_busy_needs(
    tmp_path: Path, other_pid: int
) -> None:
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=2, slots=2)
    prefill_threads = Threads()
    prefill = CoreLender(ledger, 1, prefill_threads, pid=other_pid)
    decode = CoreLender(ledger, 1, Threads())
    assert decode.before_step(busy=False) == 1
    assert prefill.before_step(busy=True) == 2  # a long prefill step on both cores begins
    prefill.give_back()  # between two layers, nobody wants the core: it keeps it
    assert prefill_threads.calls == [2] and prefill.extra == 1
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(decode.before_step(busy=True)))
    start = time.monotonic()
    waiter.start()  # a stream's KV arrives: the decode worker turns busy and waits
    time.sleep(0.005)
    prefill.give_back()  # the next layer boundary: the core goes back at once
    waiter.join(timeout=5)
    assert got == [1] and time.monotonic() - start < cores.GIVE_BACK_WAIT_S
    assert prefill_threads.calls == [2, 1] and prefill.threads == 1
    assert prefill.counters()["cpu_cores_given_back_inside_a_step_total"] == 1
    prefill.give_back()  # nothing borrowed any more: nothing to do
    assert prefill_threads.calls == [2, 1]
    assert prefill.before_step(busy=True) == 1  # its next step: both busy, nobody borrows
    decode.close()
    prefill.close()


def test_a_dead_workers_slot_lends_and_is_claimed_again(tmp_path: Path, other_pid: int) -> None:
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=4, slots=3)
    me = CoreLender(ledger, 2, Threads())
    # a worker that died mid-step, holding its cores and two more
    ghost = me._slots[1]
    ghost[cores.OWN], ghost[cores.BUSY], ghost[cores.EXTRA] = 2, 1, 2
    ghost[cores.PID] = dead_pid()
    start = time.monotonic()
    assert me.before_step(busy=True) == 4  # no wait, and its cores count as idle
    assert time.monotonic() - start < cores.GIVE_BACK_WAIT_S
    # its restarted successor takes the dead one's slot, not a fresh one
    again = CoreLender(ledger, 2, Threads(), pid=other_pid)
    assert again.slot == 1 and me.slot == 0
    again.close()
    me.close()


def test_more_workers_than_cores_never_wait_on_each_other(tmp_path: Path, other_pid: int) -> None:
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=1, slots=3)
    a = CoreLender(ledger, 1, Threads())
    b = CoreLender(ledger, 1, Threads(), pid=other_pid)
    start = time.monotonic()
    for _ in range(5):
        assert a.before_step(busy=True) == 1 and b.before_step(busy=True) == 1
    assert time.monotonic() - start < cores.GIVE_BACK_WAIT_S
    a.close()
    b.close()


def test_slots_run_out_and_a_bad_file_is_refused(tmp_path: Path, other_pid: int) -> None:
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=2, slots=1)
    first = CoreLender(ledger, 1, Threads(), pid=other_pid)
    with pytest.raises(ValueError, match="taken"):
        CoreLender(ledger, 1, Threads())
    first.close()
    CoreLender(ledger, 1, Threads()).close()  # freed by close
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a core ledger"):
        CoreLender(junk, 1, Threads())


def test_from_env_is_off_without_a_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cores.LEDGER_ENV, raising=False)
    assert cores.from_env(1, Threads()) is None
    monkeypatch.setenv(cores.LEDGER_ENV, str(tmp_path / "missing"))
    assert cores.from_env(1, Threads()) is None  # logged, not raised: the worker still serves
    ledger = tmp_path / "cores"
    create_ledger(ledger, total_cores=2, slots=2)
    monkeypatch.setenv(cores.LEDGER_ENV, str(ledger))
    lender = cores.from_env(1, Threads())
    assert lender is not None and lender.total == 2
    lender.close()


@pytest.fixture
def cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Eight cores of affinity; a cgroup tree under tmp_path with this process in /pods/w (v2)
    and /pods/w in the v1 cpu hierarchy; no quota written yet."""
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    (tmp_path / "self").write_text("1:cpu,cpuacct:/pods/w\n0::/pods/w\n")
    (tmp_path / "root" / "pods" / "w").mkdir(parents=True)
    (tmp_path / "root" / "cpu,cpuacct" / "pods" / "w").mkdir(parents=True)
    monkeypatch.setattr(cores, "PROC_CGROUP", tmp_path / "self")
    monkeypatch.setattr(cores, "CGROUP_ROOT", tmp_path / "root")
    return tmp_path / "root"


def test_usable_cores_reads_a_cgroup_quota(cgroup: Path) -> None:
    assert cores.usable_cores() == 8  # no quota anywhere: the affinity
    own, parent = cgroup / "pods" / "w", cgroup / "pods"
    (own / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5 (v2)
    assert cores.usable_cores() == 2
    (own / "cpu.max").write_text("max 100000\n")
    assert cores.usable_cores() == 8
    (parent / "cpu.max").write_text("300000 100000\n")  # an ancestor's quota binds too
    assert cores.usable_cores() == 3
    (own / "cpu.max").write_text("100000 100000\n")  # the tightest wins
    assert cores.usable_cores() == 1
    (cgroup / "cpu.max").write_text("2000000 100000\n")  # the root's, above the affinity
    (own / "cpu.max").unlink()
    (parent / "cpu.max").unlink()
    assert cores.usable_cores() == 8
    v1 = cgroup / "cpu,cpuacct" / "pods" / "w"
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")  # v1: 2 cores
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cores.usable_cores() == 2
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # v1 without a quota
    assert cores.usable_cores() == 8
    (cgroup / "pods" / "w" / "cpu.max").write_text("garbage\n")  # unreadable: no quota
    assert cores.usable_cores() == 8


def test_fit_threads_caps_torch_at_the_quota(cgroup: Path) -> None:
    threads, env = [8], {}  # no OMP_NUM_THREADS, whatever the test process has
    (cgroup / "pods" / "w" / "cpu.max").write_text("200000 100000\n")
    assert cores.fit_threads(lambda: threads[0], lambda n: threads.__setitem__(0, n), env) == 2
    assert threads == [2]
    assert cores.fit_threads(lambda: threads[0], pytest.fail, environ=env) is None  # fits
    threads = [1]
    assert cores.fit_threads(lambda: threads[0], pytest.fail, environ=env) is None  # fewer
    threads = [8]  # an OMP_NUM_THREADS of the user's own is kept, as asked
    assert cores.fit_threads(lambda: threads[0], pytest.fail, {"OMP_NUM_THREADS": "8"}) is None


def test_a_cpu_runner_without_a_thread_count_fits_the_quota(
    cgroup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from common.config import EngineConfig
    from common.model.model_runner import ModelRunner
    from tests.tiny_models import random_model, tiny_config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # it would be kept, as asked
    model = random_model(tiny_config())
    before = torch.get_num_threads()

    def runner(num_threads: int) -> int:
        cfg = EngineConfig(model="tiny", dtype="float32", device="cpu", kv_cache_memory="8MiB",
                           max_model_len=128, num_threads=num_threads)  # fmt: skip
        ModelRunner(cfg, model.config, model.state_dict().items())
        return torch.get_num_threads()

    try:
        torch.set_num_threads(2)
        (cgroup / "pods" / "w" / "cpu.max").write_text("100000 100000\n")  # one core
        assert runner(0) == 1
        torch.set_num_threads(2)
        assert runner(2) == 2  # a count asked for is kept as asked
    finally:
        torch.set_num_threads(before)


def test_a_step_run_layer_by_layer_calls_between_layers_after_each(tiny_llama) -> None:
    """The hook `give_back` rides on (the worker sets it when it lends cores): a prefill runs its
    layers in Python and calls it after each; a thread count set there holds for the rest."""
    import torch

    from common.config import EngineConfig
    from common.engine.engine import Engine
    from common.sampling_params import SamplingParams

    engine = Engine(
        EngineConfig(
            model=str(tiny_llama[1]), dtype="float32", kv_cache_memory="16MiB", max_model_len=256
        )  # fmt: skip
    )
    threads = torch.get_num_threads()
    seen: list[int] = []

    def hook() -> None:
        seen.append(torch.get_num_threads())
        torch.set_num_threads(1)  # what give_back does, mid-step

    engine.runner.model.between_layers = hook
    try:
        engine.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=1))
        assert engine.step()
    finally:
        torch.set_num_threads(threads)
    layers = len(engine.runner.model.layers)
    assert len(seen) == layers and seen[1:] == [1] * (layers - 1)
