"""`pdserve router`: the HTTP server and the control socket, in one asyncio event loop.

Owns the router's flags (`RouterConfig`, `add_router_args`; each flag also reads PDSERVE_<NAME>),
the ZeroMQ ROUTER socket workers connect to (messages in -> registry and dispatcher; commands out),
the periodic liveness check, and running the FastAPI app under uvicorn. The router loads only the
tokenizer and the model's config, never weights. Called by `common.cli` (`run_router`); tests
start a `RouterServer` in a thread. Heavy imports (uvicorn, zmq, the tokenizer) happen inside the
functions so that `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from common.protocol import HEARTBEAT_TIMEOUT_S

if TYPE_CHECKING:
    import msgspec
    import uvicorn
    import zmq.asyncio

    from common.api.tokenizer import Tokenizer
    from router.app import RouterState
    from router.registry import Worker

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    """Everything `pdserve router` takes; port 0 = any free port (tests)."""

    host: str = "127.0.0.1"
    port: int = 8000
    control_host: str = "127.0.0.1"
    control_port: int = 8001
    model: str = "default"
    served_model_name: list[str] = field(default_factory=list)
    api_key: str = ""
    routing: str = "prefix"
    prefix_load_weight: float = 0.5
    balance_abs_tokens: int = 4096
    balance_rel: float = 2.0
    decode_prefix_slack: int = 4
    local_prefill_max_tokens: int = 256
    colocated: bool = False
    request_timeout_s: float = 600.0
    queue_timeout_s: float = 10.0
    reserve_timeout_s: float = 5.0
    prefill_deadline_s: float = 120.0
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    max_model_len: int = 0
    block_size: int = 0
    log_level: str = "info"


_HELP = {
    "host": "HTTP interface to bind (loopback by default)",
    "port": "HTTP port",
    "control_host": "interface of the control socket workers connect to",
    "control_port": "control socket port",
    "model": "the model workers serve: 'default', a .gguf file or an HF directory (tokenizer only)",
    "served_model_name": "model names the API lists and accepts (default: --model as given)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*",
    "routing": "prefill worker choice: prefix (cached prefix vs load) | round_robin | least_loaded",
    "prefix_load_weight": "prefix routing: score = cached prompt tokens - this x queued prefill "
    "tokens",
    "balance_abs_tokens": "prefix routing: load counts as imbalanced when the busiest worker has "
    "this many more queued tokens than the idlest ...",
    "balance_rel": "... and more than this times its load; then only lightly loaded workers "
    "are candidates",
    "decode_prefix_slack": "prefix routing of prompts prefilled on a decode worker (short or "
    "colocated): the holder of the longest prefix wins while it runs at most this many more "
    "sequences than the least loaded",
    "local_prefill_max_tokens": "prompts up to this many tokens are prefilled on the decode "
    "worker (0 = always on a prefill worker)",
    "colocated": "serve with decode workers only (/health needs no prefill worker)",
    "request_timeout_s": "longest a request may run",
    "queue_timeout_s": "longest a request waits for a decode worker before a 503",
    "reserve_timeout_s": "longest to wait for a decode worker's reservation reply",
    "prefill_deadline_s": "time a prefill worker has to deliver a prompt's KV",
    "heartbeat_timeout_s": "a worker silent this long is dead",
    "max_model_len": "longest prompt + output (0 = the smallest any live worker allows)",
    "block_size": "KV block size workers must use (0 = whatever the first worker uses)",
    "log_level": "debug | info | warning | error",
}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """One flag per RouterConfig field, each defaulting to $PDSERVE_<NAME> when set."""
    from common.config import add_dataclass_args

    add_dataclass_args(parser, RouterConfig, _HELP)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(**{f.name: getattr(args, f.name) for f in fields(RouterConfig)})


def model_names(model: str) -> set[str]:
    """What a worker's Register.model may say for `--model`: as given, or its resolved path."""
    names = {model}
    if model != "default":
        names.add(os.path.realpath(os.path.expanduser(model)))
    return names


class RouterServer:
    """The router's HTTP app and control socket; `serve` runs both until `stop`."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_max_len: int) -> None:
        from router.app import RouterState
        from router.dispatch import Dispatcher
        from router.kv_index import PrefixIndex
        from router.metrics import RouterMetrics
        from router.policy import ROUTING_POLICIES, PrefixParams
        from router.registry import Registry

        if config.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        if config.local_prefill_max_tokens < 0:
            raise ValueError("--local-prefill-max-tokens must be >= 0")
        if (
            config.prefix_load_weight < 0
            or config.balance_abs_tokens < 0
            or config.balance_rel < 1
            or config.decode_prefix_slack < 0
        ):
            raise ValueError(
                "--prefix-load-weight, --balance-abs-tokens and --decode-prefix-slack must be "
                ">= 0, --balance-rel >= 1"
            )
        self.config = config
        self.registry = Registry(
            model_names(config.model),
            block_size=config.block_size or None,
            timeout_s=config.heartbeat_timeout_s,
        )
        self.dispatcher = Dispatcher(
            self.registry,
            self._send,
            routing=config.routing,
            local_prefill_max_tokens=config.local_prefill_max_tokens,
            queue_timeout_s=config.queue_timeout_s,
            reserve_timeout_s=config.reserve_timeout_s,
            prefill_deadline_s=config.prefill_deadline_s,
            prefix_index=PrefixIndex(),
            prefix_params=PrefixParams(
                config.prefix_load_weight,
                config.balance_abs_tokens,
                config.balance_rel,
                config.decode_prefix_slack,
            ),
        )
        self.prefix_index = self.dispatcher.prefix_index
        self.state: RouterState = RouterState(
            tokenizer=tokenizer,
            registry=self.registry,
            dispatcher=self.dispatcher,
            metrics=RouterMetrics(),
            served_model_names=config.served_model_name or [config.model],
            model_max_len=model_max_len,
            max_model_len=config.max_model_len or None,
            api_key=config.api_key,
            colocated=config.colocated,
            request_timeout_s=config.request_timeout_s,
            created=int(time.time()),
        )
        self.sock: zmq.asyncio.Socket | None = None
        self.http: uvicorn.Server | None = None
        self.http_port = 0  # the bound ports, once serving
        self.control_address = ""
        self._warned: set[str] = set()

    # ---- running --------------------------------------------------------------------------------

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Bind both sockets, serve until `stop` (or a signal, in the main thread), clean up."""
        import uvicorn
        import zmq
        import zmq.asyncio

        from common.protocol import MAX_CONTROL_MESSAGE_BYTES
        from router.app import create_app

        cfg = self.config
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails, not drops
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its identity back
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        port = cfg.control_port or "*"
        sock.bind(f"tcp://{cfg.control_host}:{port}")
        self.sock = sock
        self.control_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.http = uvicorn.Server(
            uvicorn.Config(
                create_app(self.state),
                host=cfg.host,
                port=cfg.port,
                log_level=cfg.log_level,
                access_log=cfg.log_level == "debug",
                lifespan="off",
                timeout_graceful_shutdown=2,
            )
        )
        tasks = [
            asyncio.ensure_future(self._control_loop()),
            asyncio.ensure_future(self._liveness_loop()),
            asyncio.ensure_future(self._announce(on_ready)),
        ]
        try:
            await self.http.serve()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sock.close()
            context.term()

    def stop(self) -> None:
        """Ask `serve` to return (callable from another thread)."""
        if self.http is not None:
            self.http.should_exit = True

    async def _announce(self, on_ready: Callable[[], None] | None) -> None:
        assert self.http is not None
        while not self.http.started:
            await asyncio.sleep(0.02)
        self.http_port = self.http.servers[0].sockets[0].getsockname()[1]
        log.info(
            "router: HTTP on http://%s:%d, control socket %s",
            self.config.host,
            self.http_port,
            self.control_address,
        )
        if on_ready is not None:
            on_ready()

    async def _liveness_loop(self) -> None:
        period_s = min(0.2, self.config.heartbeat_timeout_s / 10)
        while True:
            await asyncio.sleep(period_s)
            for worker in self.registry.expire():
                self.prefix_index.remove(worker.worker_id)
                try:
                    self.dispatcher.on_worker_dead(worker)
                except Exception:  # the next worker's requests must still be failed over
                    log.exception("failing over %s's requests failed", worker.worker_id)

    async def _control_loop(self) -> None:
        from common.protocol import ProtocolError, decode_control

        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropping a control message of %d frames", len(frames))
                continue
            identity, frame = frames
            try:
                msg = decode_control(frame)
            except ProtocolError as e:
                log.warning("dropping a bad control frame: %s", e)
                continue
            try:
                self.on_control_message(identity, msg)
            except Exception:  # one bad message must not stop the control loop
                log.exception("handling %s failed", type(msg).__name__)

    def on_control_message(self, identity: bytes, msg: msgspec.Struct) -> None:
        from common.protocol import (
            REREGISTER_REASON,
            Heartbeat,
            KVEvents,
            KVResync,
            Register,
            RegisterAck,
        )

        if isinstance(msg, Register):
            ack = self.registry.register(identity, msg)
            if ack.accepted:
                # A worker sends a full KV snapshot after every Register (maybe as a new process
                # whose seq starts again at 0): start its index afresh.
                self.prefix_index.remove(msg.worker_id)
            self._send_to(identity, ack)
            return
        if isinstance(msg, Heartbeat):  # heartbeats may come from a socket of their own
            worker = self.registry.on_heartbeat(msg)
            worker_id = msg.worker_id
            if worker is not None and self.prefix_index.on_heartbeat(worker_id, msg.kv_events_seq):
                self._send(worker, KVResync("a KV events message was lost"))
        else:
            worker_id = identity.decode(errors="replace")
            worker = self.registry.touch(worker_id)
            if worker is not None and isinstance(msg, KVEvents):
                if msg.worker_id == worker_id and self.prefix_index.apply(msg):
                    self._send(worker, KVResync(f"KV events gap before seq {msg.seq}"))
            elif worker is not None:
                self.dispatcher.on_message(worker, msg)
        if worker is None:
            # A worker we do not know (router restarted, or it was declared dead): ask it to
            # register again; the reply goes to whichever socket this came from.
            self._send_to(identity, RegisterAck(accepted=False, reason=REREGISTER_REASON))
            if worker_id not in self._warned:
                self._warned.add(worker_id)
                log.warning(
                    "%s from unregistered worker %r: asked it to register",
                    type(msg).__name__,
                    worker_id,
                )

    # ---- sending --------------------------------------------------------------------------------

    def _send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        return self._send_to(worker.identity, msg)

    def _send_to(self, identity: bytes, msg: msgspec.Struct) -> bool:
        import zmq

        from common.protocol import encode

        assert self.sock is not None
        # DONTWAIT: the future is already resolved (sent, or failed) when this returns.
        future = self.sock.send_multipart([identity, encode(msg)], flags=zmq.DONTWAIT)
        error = future.exception() if future.done() else None
        if error is not None:
            name = identity.decode(errors="replace")
            log.warning("could not send %s to %r: %s", type(msg).__name__, name, error)
            return False
        return True


def run_router(args: argparse.Namespace) -> int:
    """`pdserve router`: load the tokenizer, serve until SIGINT / SIGTERM."""
    from common.api.tokenizer import Tokenizer
    from common.model.model_files import resolve_model

    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s router %(levelname)s %(message)s"
    )
    source = resolve_model(config.model)
    tokenizer = Tokenizer.from_source(source)
    model_max_len = int(getattr(source.hf_config, "max_position_embeddings", 0) or 2048)
    server = RouterServer(config, tokenizer, model_max_len)
    # uvicorn handles SIGINT / SIGTERM while serving and re-raises them afterwards: by then we
    # have shut down cleanly, so the re-raised signal must not kill the process.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    asyncio.run(server.serve())
    return 0
