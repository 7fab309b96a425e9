"""common/runtime/supervise.py: backoff, the restart limit, forgiveness after a stable run."""

from __future__ import annotations

from common.runtime.supervise import RestartPolicy, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]


def test_a_dead_worker_is_restarted_after_its_backoff_then_every_longest_backoff(capsys) -> None:
    clock = Clock()
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0, max_restarts=2, stable_s=60.0)
    sup = Supervisor(policy, clock)
    sup.started("decode-0")
    sup.started("decode-1")
    restarted: list[str] = []
    assert sup.check({"decode-0": -9}, restarted.append)
    assert restarted == []  # backoff first
    assert "decode-0 exited with -9; restarting it in 1.0 s" in capsys.readouterr().err
    clock.now = 1.0
    sup.check({"decode-0": -9}, restarted.append)
    assert restarted == ["decode-0"] and sup.restarts("decode-0") == 1
    clock.now = 2.0  # dies again at once: twice the wait
    sup.check({"decode-0": 1}, restarted.append)
    clock.now = 3.9
    sup.check({"decode-0": 1}, restarted.append)
    assert restarted == ["decode-0"]
    clock.now = 4.0
    sup.check({"decode-0": 1}, restarted.append)
    assert restarted == ["decode-0"] * 2
    clock.now = 5.0  # a third crash in a row, past the 2 fast restarts: the longest backoff
    assert sup.check({"decode-0": 1}, restarted.append)
    assert "retrying every 30 s" in capsys.readouterr().err
    clock.now = 34.9
    sup.check({"decode-0": 1}, restarted.append)
    assert restarted == ["decode-0"] * 2
    clock.now = 35.0  # never given up: a stage that was down for a while comes back
    sup.check({"decode-0": 1}, restarted.append)
    assert restarted == ["decode-0"] * 3
    clock.now = 36.0
    sup.check({"decode-0": 1}, restarted.append)
    clock.now = 66.0
    sup.check({"decode-0": 1}, restarted.append)
    assert restarted == ["decode-0"] * 4
    assert sup.restarts("decode-1") == 0


def test_with_restarts_off_a_dead_worker_ends_the_cluster(capsys) -> None:
    sup = Supervisor(RestartPolicy(max_restarts=0), Clock())
    sup.started("prefill-0")
    restarted: list[str] = []
    assert not sup.check({"prefill-0": 1}, restarted.append)
    assert restarted == [] and "restarts are off" in capsys.readouterr().err


def test_a_worker_that_ran_long_enough_is_forgiven() -> None:
    clock = Clock()
    sup = Supervisor(RestartPolicy(backoff_s=1.0, max_restarts=1, stable_s=10.0), clock)
    sup.started("p")
    restarted: list[str] = []
    for crash_at in (0.0, 20.0, 40.0):  # each after more than stable_s of uptime
        clock.now = crash_at
        sup.check({"p": -9}, restarted.append)
        clock.now = crash_at + 1.0
        sup.check({"p": -9}, restarted.append)
    assert restarted == ["p"] * 3


def test_a_failed_spawn_counts_as_a_crash() -> None:
    clock = Clock()
    sup = Supervisor(RestartPolicy(backoff_s=1.0, max_restarts=3), clock)
    sup.started("p")

    def fail(name: str) -> None:
        raise OSError("no such file")

    sup.check({"p": 1}, fail)
    clock.now = 1.0
    sup.check({"p": 1}, fail)  # fails: the next look starts a new backoff, twice as long
    ok: list[str] = []
    clock.now = 2.0
    sup.check({"p": 1}, ok.append)
    clock.now = 3.9
    sup.check({"p": 1}, ok.append)
    assert ok == []
    clock.now = 4.0
    sup.check({"p": 1}, ok.append)
    assert ok == ["p"] and sup.restarts("p") == 2
