"""`pdserve prefill`, `pdserve decode` and `pdserve up`: running the stages as processes.

Owns the stage commands' flags (each also read from a PDSERVE_* variable) and the local launcher
that starts a router plus N prefill and M decode workers, prints the URL once `/health` answers 200,
and stops every process on Ctrl-C / SIGTERM. Called by common.cli.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

log = logging.getLogger(__name__)

DEFAULT_ROUTER = "tcp://127.0.0.1:8001"


def _env(name: str, default: str) -> str:
    return os.environ.get("PDSERVE_" + name, default)


def _add_worker_args(parser: argparse.ArgumentParser) -> None:
    from common.config import add_engine_args

    parser.add_argument(
        "--router",
        default=_env("ROUTER", DEFAULT_ROUTER),
        help="the router's control address (env PDSERVE_ROUTER)",
    )
    parser.add_argument(
        "--worker-id",
        default=_env("WORKER_ID", ""),
        help="unique worker name (default: role-host-pid; env PDSERVE_WORKER_ID)",
    )
    add_engine_args(parser)


def _build_engine(args: argparse.Namespace):
    from common.api.tokenizer import Tokenizer
    from common.config import config_from_args
    from common.engine.engine import Engine
    from common.model.model_files import resolve_model
    from common.model.weights import iter_weights

    config = config_from_args(args)
    source = resolve_model(config.model)
    tokenizer = Tokenizer.from_source(source)
    return Engine(config, source.hf_config, iter_weights(source), tokenizer.eos_token_ids)


def cmd_prefill(args: argparse.Namespace) -> int:
    from common.runtime.worker import default_worker_id
    from prefill.worker import PrefillWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(message)s")
    engine = _build_engine(args)
    worker = PrefillWorker(
        engine,
        args.router,
        args.worker_id or default_worker_id("prefill"),
        kv_transport=args.kv_transport,
    )
    worker.stop_on_signals()
    worker.run()
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from common.runtime.worker import default_worker_id
    from decode.worker import DecodeWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(message)s")
    engine = _build_engine(args)
    worker = DecodeWorker(
        engine,
        args.router,
        args.worker_id or default_worker_id("decode"),
        kv_bind=f"tcp://{args.kv_host}:{args.kv_port or '*'}",
        kv_advertise_host=args.kv_advertise_host or None,
    )
    worker.stop_on_signals()
    worker.run()
    return 0


def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _stop_all(procs: list[subprocess.Popen]) -> None:
    # Everything stops together, router included: a second SIGTERM skips the workers' drain.
    for _ in range(2):
        for p in procs:
            if p.poll() is None:
                p.terminate()
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cmd_up(args: argparse.Namespace) -> int:
    """Start router + workers locally; block until a signal or a child dies."""
    if args.decode < 1 or args.prefill < 0:
        raise ValueError("--decode must be >= 1 and --prefill >= 0")
    control = f"tcp://127.0.0.1:{args.control_port}"
    cores = os.cpu_count() or 1
    # Workers share the machine: torch threads per worker so that together they fit the cores.
    threads = str(args.num_threads or max(1, cores // (args.prefill + args.decode)))
    engine_flags = ["--model", args.model, "--dtype", args.dtype, "--num-threads", threads]
    extra = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    engine_flags += extra
    exe = [sys.executable, "-m", "common.cli"]
    router_cmd = exe + [
        "router",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--control-host",
        "127.0.0.1",
        "--control-port",
        str(args.control_port),
        "--model",
        args.model,
    ]
    if args.prefill == 0:
        router_cmd.append("--colocated")
    if args.routing:
        router_cmd += ["--routing", args.routing]
    if args.local_prefill_max_tokens is not None:
        router_cmd += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    if args.api_key:
        router_cmd += ["--api-key", args.api_key]
    if args.served_model_name:
        router_cmd += ["--served-model-name", *args.served_model_name]
    if args.enforce_eager:
        engine_flags.append("--enforce-eager")
    decode_flags = list(engine_flags)  # speculation happens where tokens are decoded
    if args.speculative:
        decode_flags += ["--speculative", args.speculative]
    if args.num_speculative_tokens:
        decode_flags += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    commands = [router_cmd]
    commands += [exe + ["prefill", "--router", control, *engine_flags] for _ in range(args.prefill)]
    commands += [
        exe + ["decode", "--router", control, "--kv-host", "127.0.0.1", *decode_flags]
        for _ in range(args.decode)
    ]
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd))
        url = f"http://{args.host}:{args.port}"
        if not _wait_healthy(url, procs, args.startup_timeout_s):
            print("pdserve: error: the server did not become healthy", file=sys.stderr)
            return 1
        print(
            f"pdserve is ready at {url}/v1 (router + {args.prefill} prefill + "
            f"{args.decode} decode); Ctrl-C stops it",
            flush=True,
        )
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        return 0 if stopping else 1
    finally:
        _stop_all(procs)


def add_stage_parsers(commands) -> None:
    """Register the prefill, decode and up subcommands."""
    prefill = commands.add_parser("prefill", help="run a prefill worker")
    _add_worker_args(prefill)
    prefill.add_argument(
        "--kv-transport",
        default=_env("KV_TRANSPORT", "auto"),
        choices=["auto", "tcp", "shm", "cuda_ipc"],
        help="KV transport to decode workers (auto: the router's choice)",
    )
    prefill.set_defaults(func=cmd_prefill)

    decode = commands.add_parser("decode", help="run a decode worker")
    _add_worker_args(decode)
    decode.add_argument(
        "--kv-host",
        default=_env("KV_HOST", "127.0.0.1"),
        help="interface the KV receiver binds (env PDSERVE_KV_HOST)",
    )
    decode.add_argument(
        "--kv-port",
        type=int,
        default=int(_env("KV_PORT", "0")),
        help="KV receiver port, 0 = any free port (env PDSERVE_KV_PORT)",
    )
    decode.add_argument(
        "--kv-advertise-host",
        default=_env("KV_ADVERTISE_HOST", ""),
        help="host prefill workers use to reach this worker's KV port "
        "(default: the bound address; env PDSERVE_KV_ADVERTISE_HOST)",
    )
    decode.set_defaults(func=cmd_decode)

    up = commands.add_parser("up", help="run router + prefill + decode workers locally")
    up.add_argument("--model", default=_env("MODEL", "default"))
    up.add_argument("--dtype", default=_env("DTYPE", "auto"))
    up.add_argument(
        "--prefill",
        type=int,
        default=int(_env("PREFILL", "1")),
        help="prefill workers (0 = colocated: decode workers prefill themselves)",
    )
    up.add_argument("--decode", type=int, default=int(_env("DECODE", "1")))
    up.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    up.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    up.add_argument("--control-port", type=int, default=int(_env("CONTROL_PORT", "8001")))
    up.add_argument(
        "--num-threads",
        type=int,
        default=int(_env("NUM_THREADS", "0")),
        help="torch threads per worker (default: cores / workers)",
    )
    up.add_argument(
        "--routing",
        choices=("prefix", "round_robin", "least_loaded"),
        default=None,
        help="the router's prefill worker choice (default: the router's, prefix; env "
        "PDSERVE_ROUTING). Other router flags: their PDSERVE_* variables",
    )
    up.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=None,
        help="prompts up to this many tokens prefill on the decode worker (router default 256)",
    )
    up.add_argument(
        "--speculative",
        choices=("none", "ngram", "draft"),
        default=None,
        help="speculative decoding on the decode workers (default: theirs, none; draft also "
        "needs --draft-model or --draft-layers after --)",
    )
    up.add_argument("--num-speculative-tokens", type=int, default=None)
    up.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on any worker")
    up.add_argument("--api-key", default=_env("API_KEY", ""))
    up.add_argument("--served-model-name", nargs="+", default=None)
    up.add_argument("--startup-timeout-s", type=float, default=600.0)
    up.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        help="further engine flags passed to every worker (after --)",
    )
    up.set_defaults(func=cmd_up)
