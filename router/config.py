"""The router's settings: `RouterConfig` (one field per `pdserve router` flag) and their help.

Owns the defaults and the words users read in `--help`; `router.cli` turns the fields into flags
(each also read from PDSERVE_<NAME>), `router.server.RouterServer` takes a `RouterConfig`. Tests
build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import HEARTBEAT_TIMEOUT_S
from router.relay import MAX_BUFFERED_TOKENS, MAX_REQUEST_BUFFERED_TOKENS


@dataclass
class RouterConfig:
    """Everything `pdserve router` takes; port 0 = any free port (tests, launchers)."""

    host: str = "127.0.0.1"
    port: int = 8000
    control_host: str = "127.0.0.1"
    control_port: int = 8001
    model: str = "default"
    served_model_name: list[str] = field(default_factory=list)
    api_key: str = ""
    metrics_without_key: bool = False
    routing: str = "prefix"
    prefix_load_weight: float = 0.5
    balance_abs_tokens: int = 4096
    balance_rel: float = 2.0
    decode_prefix_slack: int = 4
    kv_peer_fetch: str = "on"
    local_prefill_max_tokens: int = 256
    colocated: bool = False
    request_timeout_s: float = 600.0
    queue_timeout_s: float = 10.0
    max_queue_wait_s: float = 120.0
    max_waiting_requests: int = 0
    max_buffered_tokens: int = MAX_BUFFERED_TOKENS
    max_request_buffered_tokens: int = MAX_REQUEST_BUFFERED_TOKENS
    max_loop_lag_s: float = 0.5
    gc_interval_s: float = 0.02
    max_body_bytes: int = 32 * 2**20
    reserve_timeout_s: float = 5.0
    prefill_deadline_s: float = 120.0
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    worker_stall_timeout_s: float = 30.0
    drain_timeout_s: float = 2.0
    max_model_len: int = 0
    block_size: int = 0
    log_level: str = "info"
    ready_file: str = ""
    cluster_secret_file: str = ""
    tool_call_parser: str = ""
    event_loop: str = "auto"


HELP = {
    "host": "HTTP interface to bind (loopback by default)",
    "port": "HTTP port (0 = any free port; see --ready-file)",
    "control_host": "interface of the control socket workers connect to",
    "control_port": "control socket port (0 = any free port; see --ready-file)",
    "model": "the model workers serve: 'default', a .gguf file or an HF directory (tokenizer only)",
    "served_model_name": "model names the API lists and accepts (default: --model as given)",
    "api_key": "require 'Authorization: Bearer KEY' on every endpoint but /health (and /metrics "
    "with --metrics-without-key)",
    "metrics_without_key": "with --api-key, still serve /metrics without it (for scrapers)",
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
    "kv_peer_fetch": "on | off: when a prefill worker lacks a prefix another live worker holds "
    "(in its cache or its KV tier), tell it where, so that it pulls the blocks over kvtransfer "
    "when its measured rates say that beats computing them",
    "local_prefill_max_tokens": "prompts up to this many tokens are prefilled on the decode "
    "worker (0 = always on a prefill worker)",
    "colocated": "serve with decode workers only (/health needs no prefill worker)",
    "request_timeout_s": "longest a request may run",
    "queue_timeout_s": "longest a request waits for a decode worker before a 503, unless ...",
    "max_queue_wait_s": "... decode workers are busy with requests whose end frees room (a long "
    "prompt found no free KV blocks): then it waits up to this long",
    "max_waiting_requests": "requests that may wait in the router (tokenizing or queued for a "
    "decode worker) before new ones get a 429 with Retry-After (0 = no limit)",
    "max_buffered_tokens": "tokens the router may hold for clients that have not read them yet "
    "(slow readers); beyond it new requests get a 429 until half of it has drained",
    "max_request_buffered_tokens": "tokens one request may have waiting for its client; beyond it "
    "the request is aborted with an error (a stream whose client stopped reading)",
    "max_loop_lag_s": "when the router's event loop runs this late (smoothed over about a "
    "second: the router is short of CPU), new requests get a 429 until the lag halves (0 = never)",
    "gc_interval_s": "run the garbage collector on a clock: its youngest generation this often "
    "(up to 0.2 s apart while the router makes next to no garbage), "
    "the middle one every 0.2 s, a full collection each minute or after 64 MiB of growth "
    "(short pauses where CPython's own allocation counts, under steady request churn, walk tens "
    "of thousands of in-flight objects at once; 0 = CPython's own collections)",
    "max_body_bytes": "largest request body; a larger one gets a 413",
    "reserve_timeout_s": "longest to wait for a decode worker's reservation reply",
    "prefill_deadline_s": "time a prefill worker has to deliver a prompt's KV",
    "heartbeat_timeout_s": "a worker silent this long is dead",
    "worker_stall_timeout_s": "a worker whose main loop made no progress this long while it had "
    "work is dead (its heartbeats count the loop's turns; 0 = never)",
    "drain_timeout_s": "on SIGTERM the router stops taking connections and lets the streams it "
    "relays finish for up to this long (a rolling update of several routers: 20 or so); the "
    "workers abort what is left when it closes",
    "max_model_len": "longest prompt + output (0 = the smallest any live worker allows)",
    "block_size": "KV block size workers must use (0 = whatever the first worker uses)",
    "log_level": "debug | info | warning | error",
    "cluster_secret_file": "file holding the cluster secret: workers must know it to join (ZeroMQ "
    "CURVE on the control socket; else $PDSERVE_CLUSTER_SECRET). Without one the control socket "
    "may bind loopback only",
    "tool_call_parser": "the tool-call format: hermes (the chat template renders the tools, and "
    "tool_choice 'auto' answers are read as <tool_call> JSON, as Hermes, Qwen2 and Qwen3 templates "
    "ask for) or generic (the default, and hermes' fallback where the template cannot render "
    "tools: tools in the system prompt, every answer grammar-constrained to text or calls)",
    "event_loop": "auto | uvloop | asyncio: the router's event loop (auto: uvloop where it is "
    "installed; its sockets and callbacks cost each HTTP request about a third less than "
    "asyncio's)",
    "ready_file": 'once serving, write the bound addresses here as JSON ({"http_port", '
    '"control_address", "local_prefill_max_tokens"}), so a launcher that passed port 0 learns '
    "the ports the OS gave",
}
