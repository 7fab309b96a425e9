"""common/runtime/up.py without processes: `pdserve up --help` (every option explained, the engine
flags listed from their own parser), the default ports, and the startup banner's line on which
prompts reach the prefill workers. Running `up`: tests/e2e/test_up.py."""

from __future__ import annotations

import argparse
import os

import pytest

from common.cli import build_parser
from common.config import add_engine_args
from common.runtime.up import local_prefill_note


def _up_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["up"]


def test_every_up_option_has_help() -> None:
    up = _up_parser()
    missing = [a.option_strings or [a.dest] for a in up._actions if not a.help]
    assert not missing, f"no help text: {missing}"


def test_up_help_lists_every_engine_flag() -> None:
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    flags = [s for a in engine._actions for s in a.option_strings]
    assert len(flags) > 10
    text = _up_parser().format_help()
    epilog = text[text.index("engine flags") :]
    for flag in flags:
        assert flag in epilog, flag


def test_up_picks_its_control_port_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_CONTROL_PORT", raising=False)
    assert build_parser().parse_args(["up"]).control_port == 0  # two clusters never collide
    assert build_parser().parse_args(["up", "--control-port", "9001"]).control_port == 9001
    assert build_parser().parse_args(["up"]).port == 8000  # the API stays where users look


def test_banner_says_which_prompts_reach_the_prefill_workers() -> None:
    note = local_prefill_note(256)
    assert "at most 256 tokens (--local-prefill-max-tokens)" in note
    assert "decode workers" in note and "--local-prefill-max-tokens N" in note
    assert "every prompt" in local_prefill_note(0)


def test_workers_threads_fit_the_usable_cores(capsys: pytest.CaptureFixture[str]) -> None:
    from common.runtime.up import usable_cores, worker_threads

    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
    assert worker_threads(2, 2) == 1 and worker_threads(16, 2) == 8 and worker_threads(16, 3) == 5
    assert capsys.readouterr().err == ""  # they fit: nothing to say
    assert worker_threads(2, 4) == 1
    assert "4 workers on 2 usable cores" in capsys.readouterr().err
