"""The router process's wiring: registry, dispatcher, control plane and HTTP app on one event loop.

Owns building the router's parts from a `RouterConfig` (validating the routing knobs), running the
FastAPI app under uvicorn beside the control plane's receive and liveness loops, announcing the
bound ports (log line, `--ready-file`, `on_ready`), and shutting everything down. `router.cli`
(`pdserve router`) runs it in the main thread; tests start a `RouterServer` in a thread. Both
`run` it on uvloop's event loop where it is installed (`--event-loop`). Heavy
imports (uvicorn, zmq) happen inside the methods so that `pdserve --help` stays fast.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.config import RouterConfig

if TYPE_CHECKING:
    import uvicorn

    from common.api.tokenizer import Tokenizer
    from router.app import RouterState

__all__ = ["RouterConfig", "RouterServer", "model_names"]

log = logging.getLogger(__name__)


def model_names(model: str) -> set[str]:
    """What a worker's Register.model may say for `--model`: as given, or its resolved path."""
    names = {model}
    if model != "default":
        names.add(os.path.realpath(os.path.expanduser(model)))
    return names


def _validate(config: RouterConfig) -> None:
    from router.memory import MIDDLE_EVERY_S
    from router.policy import ROUTING_POLICIES

    if config.routing not in ROUTING_POLICIES:
        raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
    if config.worker_stall_timeout_s < 0:
        raise ValueError("--worker-stall-timeout-s must be >= 0")
    if config.kv_peer_fetch not in ("on", "off"):
        raise ValueError("--kv-peer-fetch must be on or off")
    if config.local_prefill_max_tokens < 0:
        raise ValueError("--local-prefill-max-tokens must be >= 0")
    from common.api.tools import TOOL_CALL_PARSERS

    if config.tool_call_parser and config.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
    if config.event_loop not in EVENT_LOOPS:
        raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}")
    if config.event_loop == "uvloop" and not _has_uvloop():
        raise ValueError("--event-loop uvloop: uvloop is not installed")
    if config.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be >= 1")
    if not 0 <= config.gc_interval_s <= MIDDLE_EVERY_S:
        raise ValueError(f"--gc-interval-s must be in [0, {MIDDLE_EVERY_S}] (0: CPython's own)")
    if config.max_buffered_tokens < 1 or config.max_request_buffered_tokens < 1:
        raise ValueError("--max-buffered-tokens and --max-request-buffered-tokens must be >= 1")
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


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run_loop(main: Coroutine[Any, Any, None], event_loop: str = "auto") -> None:
    """Run `main` to its end on a new event loop: uvloop's (for "auto" where it is installed,
    and for "uvloop"), else asyncio's."""
    if event_loop != "asyncio" and _has_uvloop():
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


class RouterServer:
    """The router's HTTP app and control socket; `serve` runs both until `stop`."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_max_len: int) -> None:
        from common.runtime.auth import check_bind, load_keys
        from router.admission import Admission, LoopLag
        from router.app import RouterState
        from router.control import ControlPlane
        from router.dispatch import Dispatcher
        from router.kv_index import PrefixIndex
        from router.metrics import RouterMetrics
        from router.policy import PrefixParams
        from router.registry import Registry
        from router.relay import RelayBudget

        _validate(config)
        self.config = config
        # Who may join: the cluster secret's CURVE keys; without them, loopback only.
        self.keys = load_keys(config.cluster_secret_file)
        check_bind(config.control_host, self.keys, "the control socket")
        self.registry = Registry(
            model_names(config.model),
            block_size=config.block_size or None,
            timeout_s=config.heartbeat_timeout_s,
            stall_timeout_s=config.worker_stall_timeout_s,
        )
        self.prefix_index = PrefixIndex()
        self.control = ControlPlane(self.registry, self.prefix_index)
        self.dispatcher = Dispatcher(
            self.registry,
            self.control.send,
            routing=config.routing,
            local_prefill_max_tokens=config.local_prefill_max_tokens,
            queue_timeout_s=config.queue_timeout_s,
            max_queue_wait_s=config.max_queue_wait_s,
            reserve_timeout_s=config.reserve_timeout_s,
            prefill_deadline_s=config.prefill_deadline_s,
            prefix_index=self.prefix_index,
            prefix_params=PrefixParams(
                config.prefix_load_weight,
                config.balance_abs_tokens,
                config.balance_rel,
                config.decode_prefix_slack,
            ),
            peer_fetch=config.kv_peer_fetch == "on",
        )
        self.control.dispatcher = self.dispatcher
        self.state: RouterState = RouterState(
            tokenizer=tokenizer,
            registry=self.registry,
            dispatcher=self.dispatcher,
            metrics=RouterMetrics(),
            served_model_names=config.served_model_name or [config.model],
            model_max_len=model_max_len,
            max_model_len=config.max_model_len or None,
            api_key=config.api_key,
            metrics_without_key=config.metrics_without_key,
            colocated=config.colocated,
            request_timeout_s=config.request_timeout_s,
            created=int(time.time()),
            max_body_bytes=config.max_body_bytes,
            admission=Admission(
                config.max_waiting_requests,
                RelayBudget(config.max_buffered_tokens, config.max_request_buffered_tokens),
                LoopLag(config.max_loop_lag_s),
            ),
            tool_call_parser=config.tool_call_parser,
        )
        self.http: uvicorn.Server | None = None
        self.http_port = 0  # the bound ports, once serving
        self.control_address = ""

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Bind both sockets, serve until `stop` (or a signal, in the main thread), clean up."""
        import uvicorn
        import zmq

        from common.runtime.ports import PortInUse
        from router.app import create_app
        from router.memory import CollectionPacer
        from router.sse import expose_http_cycle

        cfg = self.config
        try:
            self.control_address = self.control.bind(cfg.control_host, cfg.control_port, self.keys)
        except zmq.ZMQError as e:  # taken since `pdserve router` checked it: still one line
            if e.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(cfg.control_host, cfg.control_port, "--control-port") from None
        self.http = uvicorn.Server(
            uvicorn.Config(
                expose_http_cycle(create_app(self.state)),  # streams write without a wake-up
                host=cfg.host,
                port=cfg.port,
                log_level=cfg.log_level,
                access_log=cfg.log_level == "debug",
                lifespan="off",
                timeout_graceful_shutdown=cfg.drain_timeout_s,
            )
        )
        tasks = [
            asyncio.ensure_future(self.control.receive_loop()),
            asyncio.ensure_future(self.control.liveness_loop(cfg.heartbeat_timeout_s)),
            asyncio.ensure_future(self._announce(on_ready)),
            asyncio.ensure_future(self.state.admission.loop_lag.run()),
        ]
        if cfg.gc_interval_s:
            tasks.append(asyncio.ensure_future(CollectionPacer(cfg.gc_interval_s).run()))
        try:
            await self.http.serve()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.control.close()
            self.state.executor.shutdown(wait=False, cancel_futures=True)

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """`serve` on an event loop of its own (`--event-loop`), until it returns."""
        run_loop(self.serve(on_ready), self.config.event_loop)

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
        if self.config.ready_file:
            write_ready_file(
                self.config.ready_file,
                self.http_port,
                self.control_address,
                local_prefill_max_tokens=self.config.local_prefill_max_tokens,
            )
        if on_ready is not None:
            on_ready()


def write_ready_file(path: str, http_port: int, control_address: str, **settings: object) -> None:
    """The bound addresses (and `settings` a launcher shows, such as local_prefill_max_tokens) as
    JSON, written whole (rename) so a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"http_port": http_port, "control_address": control_address, **settings}, f)
    os.replace(tmp, path)
