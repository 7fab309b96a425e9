"""`pdserve prefill` / `decode` / `run-batch` / `up`: the KV flags of issue 24 reach every engine
entry point (`prefill/cli.py`, `decode/cli.py`, through `common.config.add_engine_args`), and
the engine a worker builds from them logs its token capacity at start."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from common.cli import build_parser
from common.config import config_from_args
from common.runtime.up import add_up_args
from tests.common.engine.test_engine import make_engine

KV8 = ["int8"] + (["fp8"] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.mark.parametrize("command", ["prefill", "decode", "run-batch"])
@pytest.mark.parametrize("kv_dtype", KV8)
def test_every_engine_entry_point_takes_the_kv_flags(tmp_path, command, kv_dtype) -> None:
    argv = [command, "--kv-cache-dtype", kv_dtype, "--kv-offload-memory", "64MiB",
            "--kv-offload-dir", str(tmp_path), "--kv-offload-disk", "1GiB"]  # fmt: skip
    if command == "run-batch":
        argv += ["-i", "in.jsonl", "-o", "out.jsonl"]
    config = config_from_args(build_parser().parse_args(argv))
    config.validate()
    assert config.kv_cache_dtype == kv_dtype
    assert (config.kv_offload_memory, config.kv_offload_dir, config.kv_offload_disk) == (
        "64MiB", str(tmp_path), "1GiB"
    )  # fmt: skip
    bad = build_parser().parse_args([argv[0], "--kv-cache-dtype", "int4", *argv[3:]])
    with pytest.raises(ValueError, match="--kv-cache-dtype must be"):
        config_from_args(bad).validate()


def test_up_passes_the_kv_flags_to_its_workers() -> None:
    args = build_parser().parse_args(["up", "--kv-peer-fetch", "off", "--", "--kv-cache-dtype",
                                      "int8", "--kv-offload-memory", "1GiB"])  # fmt: skip
    assert args.kv_peer_fetch == "off"
    up = argparse.ArgumentParser()
    add_up_args(up)
    up_help = up.format_help()  # its epilog lists the engine flags it passes on
    for flag in ("--kv-cache-dtype", "--kv-offload-memory", "--kv-offload-dir", "--kv-peer-fetch"):
        assert flag in up_help


@pytest.mark.parametrize("kv_dtype", ["auto", *KV8])
def test_the_startup_log_states_the_token_capacity(tiny_llama, caplog, kv_dtype) -> None:
    with caplog.at_level(logging.INFO, logger="common.model.model_runner"):
        runner = make_engine(tiny_llama[0], kv_cache_dtype=kv_dtype).runner
    tokens = runner.num_blocks * runner.block_size
    (line,) = [r.getMessage() for r in caplog.records if "tokens of KV cache" in r.getMessage()]
    assert f"{tokens} tokens of KV cache, {runner.kv_bytes_per_token} bytes per token" in line
    # make_engine's 8 MiB in whole blocks, at the dtype's bytes per token (scales included)
    assert tokens == 8 * 2**20 // (runner.kv_bytes_per_token * runner.block_size) * 8
