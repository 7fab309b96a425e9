"""`pdserve router`: its flags and the command that runs the router until SIGINT / SIGTERM.

Owns turning `RouterConfig` fields into flags (each also read from PDSERVE_<NAME>) and the process
setup around `RouterServer`: logging, loading the tokenizer and the model's config (never
weights, and never torch: config.json is read as JSON), signals. Called by `common.cli` (the
`pdserve` dispatcher). Heavy imports happen inside `run_router` so that `pdserve --help` stays
fast.
"""

from __future__ import annotations

import argparse
import logging
import signal
from dataclasses import fields

from router.config import HELP, RouterConfig


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """One flag per RouterConfig field, each defaulting to $PDSERVE_<NAME> when set."""
    from common.config import add_dataclass_args

    add_dataclass_args(parser, RouterConfig, HELP)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(**{f.name: getattr(args, f.name) for f in fields(RouterConfig)})


def run_router(args: argparse.Namespace) -> int:
    """`pdserve router`: load the tokenizer, serve until SIGINT / SIGTERM."""
    from common.api.tokenizer import Tokenizer
    from common.model.model_files import locate_model
    from common.runtime.ports import check_port_free
    from router.memory import freeze_startup_heap, pin_malloc_thresholds
    from router.server import RouterServer

    config = config_from_args(args)
    # Before the tokenizer loads: a busy port is one line, at once.
    check_port_free(config.host, config.port, "--port")
    check_port_free(config.control_host, config.control_port, "--control-port")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s router %(levelname)s %(message)s"
    )
    if not pin_malloc_thresholds():
        logging.info("malloc thresholds left as they are (set by the environment, or no glibc)")
    files = locate_model(config.model)
    tokenizer = Tokenizer.from_source(files)
    model_max_len = int(files.read_json("config.json").get("max_position_embeddings") or 2048)
    server = RouterServer(config, tokenizer, model_max_len)
    import fastapi  # noqa: F401  (imported by serve(): loaded before the heap is frozen)
    import uvicorn  # noqa: F401

    logging.info("%d objects exempted from garbage collection", freeze_startup_heap())
    # uvicorn handles SIGINT / SIGTERM while serving and re-raises them afterwards: by then we
    # have shut down cleanly, so the re-raised signal must not kill the process.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    server.run()
    return 0
