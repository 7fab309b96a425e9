"""Every message that crosses a process boundary, in one place (read this file to learn the system).

Encoding is msgpack through msgspec: each message is a tagged Struct, so decoding validates types
and rejects anything unknown; nothing is ever unpickled. KV tensor data never goes through these
structs: it travels as separate raw frames (or shared memory) described by `KVHeader`. The
messages about KV as a cluster resource (`KVEvents`, `KVResync`, `PeerHint`, `KVFetch`) are
declared in `common.protocol_kv` and re-exported here: import them from either.

Sockets (all ZeroMQ):
- control: the router binds a ROUTER socket; every worker connects a DEALER (identity = worker id)
  and sends `Register`, then `Heartbeat` every `HEARTBEAT_INTERVAL_S` (from a second DEALER whose
  identity the `Register` names: the router takes a worker's messages from those two connections
  only). Router -> worker: `Reserve`,
  `Prefill`, `Generate`, `Abort`. Worker -> router: `RegisterAck` replies, `ReserveReply`,
  `TokenBatch` (a decode step's `TokenOutput`s for this router, one frame; a lone `TokenOutput`
  is still accepted), `RequestFailed`, `KVEvents` (prefix-cache changes; the router may answer
  `KVResync`). For leak checks the router may send `BlockBooksQuery`; the worker answers
  `BlockBooksReply` (where each of its KV blocks is).
- kv: each worker binds a ROUTER socket at its `kv_address`; prefill workers connect DEALERs
  and send `KVHeader` (+ one raw payload frame for tcp); the decode worker answers `KVAck`.
  Peer fetch: a worker the router's `PeerHint` names a peer to sends that peer `KVFetch` (block
  keys and their tokens) on the peer's kv socket; the peer pushes the run of them it holds back
  to the asker's `kv_address` as a `KVHeader` (request id = the fetch id; 0 blocks when it holds
  none), answered by `KVAck` as any transfer.

Path of one disaggregated request: router -> decode `Reserve` -> `ReserveReply` -> router -> prefill
`Prefill` -> prefill computes, sends `KVHeader` + KV to decode -> decode `KVAck` -> decode streams
`TokenBatch`es (one per step) to the router. Colocated / short prompts: router -> decode
`Generate` -> `TokenBatch`es.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from common.protocol_kv import (  # re-exported: importers of the KV messages may use either module
    MAX_FETCH_BLOCKS,  # noqa: F401
    MAX_FETCH_TOKENS,  # noqa: F401
    BlockKey,  # noqa: F401
    Count,
    KVAddress,
    KVEvents,
    KVFetch,
    KVResync,
    Name,
    PeerHint,
)
from common.sampling_params import MAX_PROMPT_LOGPROB_TOKENS, MAX_TOP_LOGPROBS, SamplingParams

# 6: TokenBatch (a v5 router cannot read v6 tokens); 7: KVAck.recompute, Generate's output tokens;
# 8: SamplingParams.logit_bias (a v7 worker would drop it silently); 9: 8-bit KV (dtype int8 or
# float8_e4m3fn in Register and KVHeader, the payload carries the scales after the blocks);
# 10: KVHeader.block_checksums (a CRC-32 per block, so a damaged block is found as that block)
# replace its whole-payload checksum (a v9 peer would refuse the field, or send none);
# 11: KVEvents.tier (which tier of a worker holds the keys: a v10 router would refuse the field);
# 12: peer fetch: Prefill.peer and Generate.peer (a `PeerHint`), `KVFetch` on the kv socket,
# and prefill workers bind a kv socket too (a v11 worker would refuse the field and never answer
# a fetch)
PROTOCOL_VERSION = 12
MAX_CONTROL_MESSAGE_BYTES = 64 * 2**20  # a 128k-token prompt of int ids fits with room to spare
# Messages that are small by nature have a smaller limit, checked from the tag before decoding: a
# 40 MiB heartbeat would otherwise stall the router's event loop while it is decoded.
MAX_BYTES_BY_TAG = {
    "register": 64 * 2**10,
    "register_ack": 64 * 2**10,
    "heartbeat": 256 * 2**10,
    "reserve_reply": 64 * 2**10,
    "abort": 64 * 2**10,
    "failed": 2**20,
    "kv_resync": 64 * 2**10,
    "block_books_query": 64 * 2**10,
    "block_books": 4 * 2**20,
}
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0  # a worker silent this long is dead (its requests fail within 5 s)

Role = Literal["prefill", "decode"]
# Prompt logprobs (common.engine.prompt_logprobs): per prompt token after the first, its logprob,
# its rank and up to MAX_TOP_LOGPROBS best (token id, logprob): at most 402 bytes of msgpack a
# token (9 per number), so 51 MiB for the longest prompt that may ask for them, under
# MAX_CONTROL_MESSAGE_BYTES.
PROMPT_LOGPROB_BYTES = 1 + 9 + 9 + 3 + MAX_TOP_LOGPROBS * (1 + 9 + 9)
# Blocks one KV transfer may carry: a 128k-token prompt in blocks of 1 token, with room to spare.
MAX_KV_BLOCKS = 2**18
# A KV header is a few hundred bytes, its block checksums (at most 5 bytes each), plus the prompt's
# logprobs when the request asked for them.
MAX_KV_HEADER_BYTES = 2**20 + 5 * MAX_KV_BLOCKS + PROMPT_LOGPROB_BYTES * MAX_PROMPT_LOGPROB_TOKENS
Crc32 = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
PromptLogprobs = Annotated[
    list[tuple[float, int, Annotated[list[tuple[int, float]], Meta(max_length=MAX_TOP_LOGPROBS)]]],
    Meta(max_length=MAX_PROMPT_LOGPROB_TOKENS),
]


class Register(msgspec.Struct, tag="register", forbid_unknown_fields=True):
    """A worker announces itself; sent again after any reconnect."""

    version: int
    role: Role
    worker_id: Name
    model: Annotated[str, Meta(max_length=4096)]
    block_size: Count
    num_blocks: Count
    max_model_len: Count
    dtype: Name  # of its KV cache: float32 | bfloat16 | float16 | int8 | float8_e4m3fn
    host: Name  # hostname, to pick same-host transports
    kv_address: KVAddress = ""  # where peers push KV and send fetches
    transports: Annotated[list[Name], Meta(max_length=16)] = []  # kv transports it can use
    # the salt of its prefix block keys (common.prefix_hash), for the index
    kv_salt: Annotated[bytes, Meta(max_length=256)] = b""
    # The KV cache layout a transfer depends on (with block_size and dtype): the router refuses a
    # worker whose layout differs from the other role's workers'.
    num_layers: Count = 0
    num_kv_heads: Count = 0
    head_dim: Count = 0
    # The ZeroMQ identity of its heartbeat socket (random): heartbeats from any other connection,
    # for this worker id, are ignored.
    heartbeat_identity: Annotated[bytes, Meta(max_length=512)] = b""


class RegisterAck(msgspec.Struct, tag="register_ack", forbid_unknown_fields=True):
    """Answer to `Register`; also sent, refused with REREGISTER_REASON, to an unknown worker."""

    accepted: bool
    reason: str = ""


REREGISTER_REASON = "unknown worker: register again"


class HistogramSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    """A cumulative histogram a worker keeps (e.g. KV transfer seconds), for the router's /metrics.

    `counts[i]` observations fell at or below `buckets[i]` and above the bucket before; the last
    entry of `counts` (one more than `buckets`) is the +Inf bucket.
    """

    buckets: Annotated[list[float], Meta(max_length=256)]
    counts: Annotated[list[int], Meta(max_length=257)]
    sum: float
    count: int


class Heartbeat(msgspec.Struct, tag="heartbeat", forbid_unknown_fields=True):
    worker_id: Name
    num_running: Count
    num_waiting: Count
    num_free_blocks: Count
    num_blocks: Count
    queued_prefill_tokens: Count = 0
    # cumulative stats for /metrics (preemptions, cache hits, ...)
    counters: Annotated[dict[Name, float], Meta(max_length=256)] = {}
    draining: bool = False  # finishing in-flight work before exiting: send it nothing new
    kv_events_seq: int = -1  # the last KVEvents seq sent (-1: none yet), to notice a lost tail
    # cumulative histograms for /metrics
    histograms: Annotated[dict[Name, HistogramSnapshot], Meta(max_length=64)] = {}
    # The worker's progress so far (-1: not counted): turns of its main loop plus decoder layers
    # run. The loop turns every few milliseconds even when idle and the layers count inside a long
    # step, so a count that stands still while the worker has work means a stuck loop (the
    # heartbeat comes from a thread of its own and goes on regardless).
    loop_count: int = -1


class Reserve(msgspec.Struct, tag="reserve", forbid_unknown_fields=True):
    """Router -> decode: hold blocks for this prompt before its prefill starts."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Seconds from receipt the reservation waits for its KV: the router's prefill deadline plus
    # its reservation wait (0: the worker's default).
    deadline_s: float = 0.0


class ReserveReply(msgspec.Struct, tag="reserve_reply", forbid_unknown_fields=True):
    request_id: str
    ok: bool
    num_cached_tokens: int = 0  # leading prompt tokens the decode worker already holds
    reason: str = ""


class Prefill(msgspec.Struct, tag="prefill", forbid_unknown_fields=True):
    """Router -> prefill: compute this prompt and push its KV to the named decode worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_worker_id: str
    decode_kv_address: str
    num_decode_cached_tokens: int
    transport: str  # tcp | shm | cuda_ipc
    deadline_s: float  # seconds from receipt to finish the transfer
    peer: PeerHint | None = None  # where a prefix this worker lacks may be fetched from


class Generate(msgspec.Struct, tag="generate", forbid_unknown_fields=True):
    """Router -> decode: prefill locally and decode (colocated mode, short prompts). A migrated
    request (its decode worker died) carries the tokens it already produced at the end of
    `prompt_token_ids`: the last `num_output_tokens` of them are output, not prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_output_tokens: Count = 0
    peer: PeerHint | None = None  # where a prefix this worker lacks may be fetched from


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    request_id: str


class TokenOutput(msgspec.Struct, tag="tokens", forbid_unknown_fields=True):
    """Decode -> router: new tokens of one request (one or more steps' worth)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # with the first token of a request whose params ask for prompt_logprobs
    prompt_logprobs: PromptLogprobs | None = None


# Requests one decode step may report in one `TokenBatch` (a step runs far fewer sequences);
# the frame's byte limit (MAX_CONTROL_MESSAGE_BYTES) bounds the rest while decoding.
MAX_TOKEN_BATCH_OUTPUTS = 65536


class TokenBatch(msgspec.Struct, tag="token_batch", forbid_unknown_fields=True):
    """Decode -> router: one step's `TokenOutput`s of the requests this router sent, one frame.

    The router decodes it once and hands each request its tokens without a wake-up per token;
    outputs of one request keep their order within and across batches.
    """

    outputs: Annotated[list[TokenOutput], Meta(max_length=MAX_TOKEN_BATCH_OUTPUTS)]


class RequestFailed(msgspec.Struct, tag="failed", forbid_unknown_fields=True):
    """Any worker -> router: this request cannot complete (its blocks are already released)."""

    request_id: str
    stage: str  # reserve | prefill | transfer | decode
    reason: str


class BlockBooksQuery(msgspec.Struct, tag="block_books_query", forbid_unknown_fields=True):
    """Router -> worker: audit your KV blocks now (between steps) and answer `BlockBooksReply`."""

    query_id: int


class BlockBooksReply(msgspec.Struct, tag="block_books", forbid_unknown_fields=True):
    """Worker -> router: its engine's block books (common.engine.block_manager.BlockBooks).

    free + cached + running + reserved + held == total when they balance; `errors` names each
    block or sequence out of place (a leak, a block in two places).
    """

    worker_id: str
    query_id: int
    total: int
    free: int
    cached: int
    running: int
    reserved: int
    held: int
    errors: list[str] = []


class KVHeader(msgspec.Struct, tag="kv", forbid_unknown_fields=True):
    """Prefill -> decode: the KV of blocks [start_block, start_block + num_blocks) of a prompt.

    Payload layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] in
    `dtype`, C order; for an 8-bit `dtype` (int8, float8_e4m3fn) followed by its float32 scales
    [num_layers, 2, num_blocks, block_size, num_kv_heads]. `nbytes` long in all.
    `block_checksums[i]` = zlib.crc32 of block i's bytes in payload order: its K and V of every
    layer ([0, 0, i], [0, 1, i], [1, 0, i], ...), then its scales the same way (8-bit); one per
    block (tcp, shm). cuda_ipc sends none: its bytes never leave the GPUs.
    """

    request_id: str
    start_block: int
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    nbytes: int
    transport: str
    first_token_id: int  # sampled by the prefill worker
    first_logprob: float | None = None
    # bounded: the header's size limit leaves room for prompt logprobs, not for these
    first_top_logprobs: (
        Annotated[list[tuple[int, float]], Meta(max_length=MAX_TOP_LOGPROBS)] | None
    ) = None
    # seeded requests: the sampler's RNG state after the first token, so decode continues its stream
    generator_state: bytes = b""
    shm_name: str = ""  # shm transport: the segment holding the payload
    ipc_handle: bytes = b""  # cuda_ipc transport: the exporter's handle
    # the prompt's logprobs, computed here, when the request's params ask for prompt_logprobs
    prompt_logprobs: PromptLogprobs | None = None
    block_checksums: Annotated[list[Crc32], Meta(max_length=MAX_KV_BLOCKS)] = []


class KVAck(msgspec.Struct, tag="kv_ack", forbid_unknown_fields=True):
    """Decode -> prefill: the transfer is over; either way the sender may release its blocks."""

    request_id: str
    ok: bool
    reason: str = ""
    # The KV arrived damaged (checksum, truncation) and the receiver computes it itself instead:
    # the request goes on there, so the sender reports no failure to the router.
    recompute: bool = False


ControlMessage = (
    Register
    | RegisterAck
    | Heartbeat
    | Reserve
    | ReserveReply
    | Prefill
    | Generate
    | Abort
    | TokenOutput
    | TokenBatch
    | RequestFailed
    | KVEvents
    | KVResync
    | BlockBooksQuery
    | BlockBooksReply
)
KVMessage = KVHeader | KVAck | KVFetch

_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_kv_decoder = msgspec.msgpack.Decoder(KVMessage)


class ProtocolError(ValueError):
    """A frame that is too large, malformed, or not a known message."""


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def message_tag(frame: bytes) -> str:
    """The tag of an encoded message, read from its first bytes without decoding the rest ('' if
    the frame does not start like a tagged message). msgspec writes the tag field first."""
    view = memoryview(frame)
    if len(view) < 8:
        return ""
    first = view[0]
    if 0x80 <= first <= 0x8F:  # fixmap
        i = 1
    elif first == 0xDE:  # map16
        i = 3
    elif first == 0xDF:  # map32
        i = 5
    else:
        return ""
    if bytes(view[i : i + 5]) != b"\xa4type":
        return ""
    i += 5
    head = view[i] if i < len(view) else 0
    if 0xA0 <= head <= 0xBF:  # fixstr
        n, i = head & 0x1F, i + 1
    elif head == 0xD9 and i + 1 < len(view):  # str8
        n, i = view[i + 1], i + 2
    else:
        return ""
    return bytes(view[i : i + n]).decode("ascii", errors="replace")


def decode_control(frame: bytes, max_bytes: int = MAX_CONTROL_MESSAGE_BYTES) -> ControlMessage:
    """Decode one control frame; ProtocolError for anything oversized or invalid. A message whose
    tag has a limit of its own (`MAX_BYTES_BY_TAG`) is held to it; `max_bytes` caps every one."""
    limit = min(max_bytes, MAX_CONTROL_MESSAGE_BYTES)
    if len(frame) > limit:
        raise ProtocolError(f"control message of {len(frame)} bytes exceeds the limit")
    tag_limit = MAX_BYTES_BY_TAG.get(message_tag(frame))
    if tag_limit is not None and len(frame) > tag_limit:
        raise ProtocolError(
            f"{message_tag(frame)} message of {len(frame)} bytes exceeds its limit ({tag_limit})"
        )
    try:
        return _control_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad control message: {exc}") from exc


def decode_kv(frame: bytes) -> KVMessage:
    """Decode one kv-socket header frame (the payload frame is raw bytes, never decoded here)."""
    if len(frame) > MAX_KV_HEADER_BYTES:
        raise ProtocolError(f"kv header of {len(frame)} bytes exceeds the limit")
    try:
        return _kv_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad kv message: {exc}") from exc
