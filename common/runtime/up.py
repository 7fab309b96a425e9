"""`pdserve up`: a router plus N prefill and M decode workers on this machine, in one command.

Owns the `up` flags (each also read from a PDSERVE_* variable) and turning them into the router's
and the workers' flags; the processes themselves are started, watched and stopped by
`common.runtime.launcher.LocalCluster`, with a cluster secret it generates and hands to its
children in the environment (`common.runtime.auth`), supervised: a worker that dies is restarted
(with backoff; after `--max-worker-restarts` in a row, every 30 s) while the others keep serving.
Checks its ports before starting anything (`common.runtime.ports`; the control port is any free
one unless given), prints the URL once the cluster serves (and, with prefill workers, which
prompts stay on the decode workers), and stops every process on Ctrl-C / SIGTERM or when the
router dies.
Called by `common.cli`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from common.runtime.auth import SECRET_ENV, SECRET_FILE_ENV
from common.runtime.cores import usable_cores
from common.runtime.launcher import LocalCluster, WorkerSpec
from common.runtime.ports import check_port_free
from common.runtime.supervise import RestartPolicy
from common.runtime.worker_cli import env


class _Interrupted(Exception):
    """A signal arrived while the cluster was still starting."""


def cluster_from_args(
    args: argparse.Namespace, log_dir: Path | None = None, name: str = ""
) -> LocalCluster:
    """The cluster `up` runs for these flags (not started); `log_dir` / `name`: see LocalCluster
    (the serving benchmark runs up's clusters with logs in files)."""
    if args.decode < 1 or args.prefill < 0:
        raise ValueError("--decode must be >= 1 and --prefill >= 0")
    # Workers share the machine: torch threads per worker so that together they fit the cores.
    cores = usable_cores()
    threads = str(args.num_threads or worker_threads(cores, args.prefill + args.decode))
    engine_flags = ["--dtype", args.dtype, "--num-threads", threads]
    extra = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    engine_flags += extra
    router_flags: list[str] = []
    if args.routing:
        router_flags += ["--routing", args.routing]
    if args.local_prefill_max_tokens is not None:
        router_flags += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    if args.kv_peer_fetch:
        router_flags += ["--kv-peer-fetch", args.kv_peer_fetch]
    if args.api_key:
        router_flags += ["--api-key", args.api_key]
    if args.served_model_name:
        router_flags += ["--served-model-name", *args.served_model_name]
    if args.tool_call_parser:
        router_flags += ["--tool-call-parser", args.tool_call_parser]
    if args.enforce_eager:
        engine_flags.append("--enforce-eager")
    decode_flags = ["--kv-host", "127.0.0.1", *engine_flags]
    # Speculation happens where tokens are decoded.
    if args.speculative:
        decode_flags += ["--speculative", args.speculative]
    if args.num_speculative_tokens:
        decode_flags += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    # A cluster secret for this run (unless one is set already, which the children inherit): only
    # processes that know it can join the cluster (CURVE on the control socket).
    env = {}
    if not os.environ.get(SECRET_ENV) and not os.environ.get(SECRET_FILE_ENV):
        env[SECRET_ENV] = secrets.token_hex(32)
    workers = [WorkerSpec("prefill", flags=engine_flags) for _ in range(args.prefill)]
    workers += [WorkerSpec("decode", flags=decode_flags) for _ in range(args.decode)]
    return LocalCluster(
        args.model,
        workers,
        router_flags=router_flags,
        host=args.host,
        port=args.port,
        control_port=args.control_port,
        log_dir=log_dir,
        name=name,
        env=env,
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=args.max_worker_restarts),
        # only where there is something to lend: several workers, more than one core
        lend_cores=cores if args.lend_cores == "on" and cores > 1 else 0,
    )


def worker_threads(cores: int, workers: int) -> int:
    """Torch threads per worker so that the workers' threads together never exceed the cores:
    cores // workers, at least 1 (more workers than cores share cores; `up` says so)."""
    if workers > cores:
        print(
            f"pdserve: note: {workers} workers on {cores} usable cores: one thread each, and "
            "they take turns on the cores (fewer workers, or more cores, would not)",
            file=sys.stderr,
        )
    return max(1, cores // max(1, workers))


def cmd_up(args: argparse.Namespace) -> int:
    """Start router + workers locally; block until a signal or the router dies (dead workers are
    restarted meanwhile)."""
    # Busy ports are one line now, not a traceback after the models have loaded.
    check_port_free(args.host, args.port, "--port")
    check_port_free("127.0.0.1", args.control_port, "--control-port")
    cluster = cluster_from_args(args)
    starting, stopping = True, False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        if starting:
            raise _Interrupted

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            cluster.start(args.startup_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            print(f"pdserve: error: the server did not become healthy: {e}", file=sys.stderr)
            return 1
        starting = False
        print(
            f"pdserve is ready at {cluster.url}/v1 (router + {args.prefill} prefill + "
            f"{args.decode} decode); Ctrl-C stops it",
            flush=True,
        )
        if args.prefill > 0:
            note = local_prefill_note(cluster.router_info.get("local_prefill_max_tokens"))
            print(note, flush=True)
        while not stopping and cluster.poll():
            time.sleep(0.2)
        if not stopping and "router" in cluster.dead():
            print("pdserve: error: the router exited; stopping the cluster", file=sys.stderr)
        return 0 if stopping else 1
    except _Interrupted:
        return 0
    finally:
        starting = False
        cluster.stop()


def local_prefill_note(max_tokens: int | None) -> str:
    """What the startup banner says about which prompts reach the prefill workers."""
    if max_tokens is None:  # a router that does not say
        return "short prompts (--local-prefill-max-tokens) are prefilled on the decode workers"
    if max_tokens == 0:
        return "every prompt is prefilled on a prefill worker (--local-prefill-max-tokens 0)"
    return (
        f"prompts of at most {max_tokens} tokens (--local-prefill-max-tokens) are prefilled on "
        f"the decode workers, longer ones on the prefill workers; `pdserve up "
        f"--local-prefill-max-tokens N` changes it (0: every prompt goes to a prefill worker)"
    )


def engine_flags_epilog() -> str:
    """`up --help`'s list of the engine flags it passes on after `--`, from the workers' own
    parser (common.config.add_engine_args), so the list cannot drift from the flags."""
    from common.config import add_engine_args

    engine = argparse.ArgumentParser(add_help=False, usage=argparse.SUPPRESS)
    add_engine_args(engine)
    flags = engine.format_help().split("\n", 1)[1]  # below its "options:" heading
    return (
        "engine flags, passed to every worker after `--` (e.g. `pdserve up --prefill 1 -- "
        "--max-num-seqs 64`):\n" + flags
    )


def add_up_args(up: argparse.ArgumentParser) -> None:
    up.formatter_class = argparse.RawDescriptionHelpFormatter
    up.epilog = engine_flags_epilog()
    up.add_argument(
        "--model",
        default=env("MODEL", "default"),
        help="'default' (SmolLM2-135M-Instruct), a .gguf file or an HF model directory (env "
        "PDSERVE_MODEL)",
    )
    up.add_argument(
        "--dtype",
        default=env("DTYPE", "auto"),
        help="auto | float32 | bfloat16 | float16 on every worker; auto = bfloat16 where "
        "supported (env PDSERVE_DTYPE)",
    )
    up.add_argument(
        "--prefill",
        type=int,
        default=int(env("PREFILL", "1")),
        help="prefill workers (0 = colocated: decode workers prefill themselves)",
    )
    up.add_argument(
        "--decode", type=int, default=int(env("DECODE", "1")), help="decode workers (>= 1)"
    )
    up.add_argument(
        "--host",
        default=env("HOST", "127.0.0.1"),
        help="interface the HTTP API binds (0.0.0.0: every interface; env PDSERVE_HOST)",
    )
    up.add_argument(
        "--port", type=int, default=int(env("PORT", "8000")), help="HTTP port (0 = any free)"
    )
    up.add_argument(
        "--control-port",
        type=int,
        default=int(env("CONTROL_PORT", "0")),
        help="the router's control port on loopback, where workers register (default 0: any "
        "free port, so clusters on one machine do not collide; the workers learn it)",
    )
    up.add_argument(
        "--num-threads",
        type=int,
        default=int(env("NUM_THREADS", "0")),
        help="torch threads per worker (default: cores / workers)",
    )
    up.add_argument(
        "--lend-cores",
        choices=("on", "off"),
        default=env("LEND_CORES", "on"),
        help="a CPU worker with nothing to compute lends its cores to the others for their "
        "steps (a busy one gets them back within a step); off: each keeps its own threads "
        "(env PDSERVE_LEND_CORES)",
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
        "--kv-peer-fetch",
        choices=("on", "off"),
        default=None,
        help="a prefill worker lacking a prefix another worker holds pulls its KV blocks from "
        "there when that measures cheaper than computing them (router default on)",
    )
    up.add_argument(
        "--speculative",
        choices=("none", "ngram", "draft"),
        default=None,
        help="speculative decoding on the decode workers (default: theirs, none; draft also "
        "needs --draft-model or --draft-layers after --)",
    )
    up.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="tokens drafted per step with --speculative (default: the decode workers')",
    )
    up.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on any worker")
    up.add_argument(
        "--api-key",
        default=env("API_KEY", ""),
        help="require 'Authorization: Bearer KEY' on the API (env PDSERVE_API_KEY)",
    )
    up.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names the API lists and accepts (default: --model as given)",
    )
    up.add_argument(
        "--tool-call-parser",
        default=env("TOOL_CALL_PARSER", ""),
        help="the router's --tool-call-parser: generic (the default: tools for any model) or "
        "hermes (for chat templates that render tools)",
    )
    up.add_argument(
        "--startup-timeout-s",
        type=float,
        default=600.0,
        help="give up (exit 1) when the cluster does not serve within this many seconds",
    )
    up.add_argument(
        "--max-worker-restarts",
        type=int,
        default=int(env("MAX_WORKER_RESTARTS", "5")),
        help="fast restarts in a row (backoff 1 s doubling) of a worker that keeps dying; after "
        "them it is retried every 30 s. 0: no restarts, and `up` exits with status 1 when a "
        "worker dies, for an outer supervisor (systemd, Kubernetes) to act",
    )
    up.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        help="-- then engine flags passed to every worker (listed below)",
    )
