"""`pdserve prefill`: the prefill worker's flags and the command that runs one until stopped.

Owns `--kv-transport` (the worker flags shared with decode come from `common.runtime.worker_cli`).
Called by `common.cli` (the `pdserve` dispatcher); heavy imports happen inside `cmd_prefill`.
"""

from __future__ import annotations

import argparse
import logging

from common.runtime.worker_cli import add_worker_args, env


def add_prefill_args(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser)
    parser.add_argument(
        "--kv-transport",
        default=env("KV_TRANSPORT", "auto"),
        choices=["auto", "tcp", "shm", "cuda_ipc"],
        help="KV transport to decode workers (auto: the router's choice)",
    )


def cmd_prefill(args: argparse.Namespace) -> int:
    """Load the engine, register with the router, serve prefills until SIGTERM (drains first)."""
    from common.runtime.auth import check_bind, load_keys
    from common.runtime.worker import default_worker_id
    from common.runtime.worker_cli import build_engine, serve
    from prefill.worker import PrefillWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(message)s")
    keys = load_keys(args.cluster_secret_file)
    check_bind(args.kv_host, keys, "the KV receiver")  # before the minutes of loading weights
    engine = build_engine(args)
    worker = PrefillWorker(
        engine,
        args.router,
        args.worker_id or default_worker_id("prefill"),
        kv_transport=args.kv_transport,
        keys=keys,
        kv_bind=f"tcp://{args.kv_host}:{args.kv_port or '*'}",
        kv_advertise_host=args.kv_advertise_host or None,
    )
    return serve(worker, args)
