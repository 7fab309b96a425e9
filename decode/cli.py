"""`pdserve decode`: the decode worker's flags and the command that runs one until stopped.

The worker flags, the KV receiver's (`--kv-host`, `--kv-port`, `--kv-advertise-host`) included,
come from `common.runtime.worker_cli`. Called by `common.cli` (the `pdserve` dispatcher); heavy
imports happen inside `cmd_decode`.
"""

from __future__ import annotations

import argparse
import logging

from common.runtime.worker_cli import add_worker_args


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser)


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
