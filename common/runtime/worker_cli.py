"""What `pdserve prefill` and `pdserve decode` share: worker flags, building and seeding the engine.

Owns `--router`, `--worker-id`, `--cluster-secret-file`, the KV receiver's flags (`--kv-host`,
`--kv-port`, `--kv-advertise-host`: every worker receives KV, a decode worker its prompts', any
worker the blocks it fetches from peers) and the health endpoint's flags
(`--health-port`, `--health-host`, `--health-stall-timeout-s`; each also read from a PDSERVE_*
variable; the engine flags come from `common.config.add_engine_args`), turning the parsed flags
into a loaded, warmed-up `Engine` (`--warm-up`; on the CPU, glibc's thresholds set to keep
what a step frees: common.runtime.malloc), seeding the process's random generators from
`--seed`, and running the worker beside its health endpoint (`serve`). Called by `prefill.cli`
and `decode.cli`; heavy imports happen inside the functions so that `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from typing import TYPE_CHECKING

from common.runtime import omp_spin
from common.runtime.malloc import keep_step_buffers

if TYPE_CHECKING:
    from common.config import EngineConfig
    from common.engine.engine import Engine
    from common.runtime.worker import WorkerBase

log = logging.getLogger(__name__)

DEFAULT_ROUTER = "tcp://127.0.0.1:8001"


def env(name: str, default: str) -> str:
    """$PDSERVE_<name>, or the default: what a flag uses as its default."""
    return os.environ.get("PDSERVE_" + name, default)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The flags every worker takes: where the router is, its own name, the engine's flags."""
    from common.config import add_engine_args

    parser.add_argument(
        "--router",
        default=env("ROUTER", DEFAULT_ROUTER),
        help="the router's control address (env PDSERVE_ROUTER)",
    )
    parser.add_argument(
        "--worker-id",
        default=env("WORKER_ID", ""),
        help="unique worker name (default: role-host-pid; env PDSERVE_WORKER_ID)",
    )
    parser.add_argument(
        "--cluster-secret-file",
        default="",
        help="file holding the cluster secret the router was given: the control connection then "
        "uses CURVE (env PDSERVE_CLUSTER_SECRET_FILE, or the secret itself in "
        "PDSERVE_CLUSTER_SECRET; `pdserve up` sets that for its workers)",
    )
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
        help="host other workers use to reach this worker's KV port "
        "(default: the bound address; env PDSERVE_KV_ADVERTISE_HOST)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=int(env("HEALTH_PORT", "0")),
        help="serve /healthz (main loop alive) and /readyz (registered, not draining) over HTTP "
        "on this port, for Kubernetes probes; 0 = off (env PDSERVE_HEALTH_PORT)",
    )
    parser.add_argument(
        "--health-host",
        default=env("HEALTH_HOST", "127.0.0.1"),
        help="interface of the health endpoint; loopback by default, the Kubernetes manifests "
        "set 0.0.0.0 so the kubelet reaches it (env PDSERVE_HEALTH_HOST)",
    )
    parser.add_argument(
        "--health-stall-timeout-s",
        type=float,
        default=float(env("HEALTH_STALL_TIMEOUT_S", "60")),
        help="/healthz fails once the main loop made no progress this long "
        "(env PDSERVE_HEALTH_STALL_TIMEOUT_S)",
    )
    add_engine_args(parser)


def serve(worker: WorkerBase, args: argparse.Namespace) -> int:
    """Run a worker until it stops (SIGTERM drains first), its health endpoint beside it when
    --health-port asks for one; the exit status of `pdserve prefill` / `pdserve decode`."""
    from common.runtime.health import start_health_server

    worker.stop_on_signals()
    health = start_health_server(  # probes see registration, then the loop turning
        worker, args.health_host, args.health_port, args.health_stall_timeout_s
    )
    try:
        worker.run()
    finally:
        if health is not None:
            health.stop()
    return 0


def seed_generators(seed: int) -> None:
    """Seed the generators unseeded requests draw from: torch's default ones (CPU and every CUDA
    device; the sampler's batched noise), Python's `random` and numpy's global one. A request with
    its own `seed` draws from a generator of its own and is unaffected."""
    import numpy as np
    import torch

    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


def load_engine(config: EngineConfig) -> Engine:
    """The engine for `config`: its model's weights, config and tokenizer's EOS tokens."""
    from common.api.tokenizer import Tokenizer
    from common.engine.engine import Engine
    from common.model.model_files import resolve_model
    from common.model.weights import iter_weights

    source = resolve_model(config.model)
    tokenizer = Tokenizer.from_source(source)
    return Engine(config, source.hf_config, iter_weights(source), tokenizer.eos_token_ids)


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the flags describe, with the generators seeded from `--seed` once it is loaded
    (loading may draw from them, e.g. to initialise layers that the weights then overwrite)."""
    from common.config import config_from_args

    config = config_from_args(args)
    if spin := omp_spin.describe():
        log.info("%s", spin)
    engine = load_engine(config)
    if engine.runner.device.type == "cpu":
        keep_step_buffers()  # before the warm-up's steps
        build_cpu_kernels()
    if config.warm_up:
        log.info("warm-up: %.2f s", engine.warm_up())
    seed_generators(config.seed)  # after the warm-up: what it drew does not count
    return engine


def build_cpu_kernels() -> None:
    """Build the CPU path's C kernels (or load them from the cache) before the worker registers.
    Built on first use instead, a fresh cache's first request waits through the compiles (over
    30 s on a busy 2-core machine) and the router takes the silent worker for a stalled one."""
    from common.kernels import cpu_attention, cpu_layer, cpu_ops, cpu_qgemm, cpu_quant

    for available in (
        cpu_ops.available,
        cpu_attention.available,
        cpu_layer.available,
        cpu_quant.c_available,
        cpu_qgemm.available,
    ):
        available()  # False (the torch path runs) when there is no compiler: logged there
