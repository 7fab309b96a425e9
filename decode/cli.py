"""`pdserve decode`: the decode worker's flags and the command that runs one until stopped.

Owns the KV receiver's flags (`--kv-host`, `--kv-port`, `--kv-advertise-host`; the worker flags
shared with prefill come from `common.runtime.worker_cli`). Called by `common.cli` (the `pdserve`
dispatcher); heavy imports happen inside `cmd_decode`.
"""

from __future__ import annotations

import argparse
import logging

from common.runtime.worker_cli import add_worker_args, env


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser)
    parser.add_argument(
        "--kv-host",
        default=env("KV_HOST", "127.0.0.1"),
        help="interface the KV receiver binds (env PDSERVE_KV_HOST)",
    )
    parser.add_argument(
        "--kv-port",
        type=int,
        default=int(env("KV_PORT", "0")),
        help="KV receiver port, 0 = any free port (env PDSERVE_KV_PORT)",
    )
    parser.add_argument(
        "--kv-advertise-host",
        default=env("KV_ADVERTISE_HOST", ""),
        help="host prefill workers use to reach this worker's KV port "
        "(default: the bound address; env PDSERVE_KV_ADVERTISE_HOST)",
    )


def cmd_decode(args: argparse.Namespace) -> int:
    """Load the engine, bind the KV receiver, register, decode until SIGTERM (drains first)."""
    from common.runtime.auth import check_bind, load_keys
    from common.runtime.worker import default_worker_id
    from common.runtime.worker_cli import build_engine, serve
    from decode.worker import DecodeWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(message)s")
    keys = load_keys(args.cluster_secret_file)
    check_bind(args.kv_host, keys, "the KV receiver")  # before the minutes of loading weights
    engine = build_engine(args)
    worker = DecodeWorker(
        engine,
        args.router,
        args.worker_id or default_worker_id("decode"),
        kv_bind=f"tcp://{args.kv_host}:{args.kv_port or '*'}",
        kv_advertise_host=args.kv_advertise_host or None,
        keys=keys,
    )
    return serve(worker, args)
