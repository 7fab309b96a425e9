"""The wire messages about KV as a cluster resource: prefix-cache events and peer fetches.

Part of the protocol (`common.protocol`, which re-exports every name here, counts them in its
`PROTOCOL_VERSION` and decodes them in its message unions): read that file first. This one holds
what a worker tells the routers about the prefix blocks it holds (`KVEvents`, answered by
`KVResync` when one went missing), and how a worker pulls a prefix from a peer (`PeerHint` in a
dispatch, `KVFetch` on the peer's kv socket, answered by a `KVHeader` as any transfer), with the
field bounds those messages and `common.protocol`'s share.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# Bounds on what workers send, enforced while decoding (the router never builds a huge object).
Name = Annotated[str, Meta(max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
KVAddress = Annotated[str, Meta(max_length=1024)]
BlockKey = Annotated[bytes, Meta(max_length=64)]  # a prefix block key (common.prefix_hash)
# Blocks one peer fetch may ask for, and their tokens (blocks of up to 256 tokens): the KVFetch
# then stays under the kv socket's header limit (16-byte keys, at most 5 bytes a token id).
MAX_FETCH_BLOCKS = 4096
MAX_FETCH_TOKENS = 2**17


class KVEvents(msgspec.Struct, tag="kv_events", forbid_unknown_fields=True):
    """Worker -> router: prefix block keys that became reusable (`stored`) or were evicted, in
    one `tier` of the worker: its KV cache ("device"), or the tier its evicted blocks fall to
    (common.engine.kv_tier): host RAM ("cpu") or local disk ("disk"). A key may be in several.

    `seq` counts a worker's KVEvents from 0 without gaps (all tiers together): a gap means a
    message was lost and the router asks for `KVResync`. With `reset` the message starts a full
    snapshot of its tier: `stored` replaces what the router knew of that tier; a snapshot of many
    keys goes on in messages without `reset` (the router bounds a message's size by the worker's
    block count), and a resync sends one for every tier the worker has, even an empty one. The
    two lists are disjoint (the net effect since the previous message), so their order of
    application does not matter.
    """

    worker_id: Name
    seq: int
    stored: list[BlockKey]
    evicted: list[BlockKey]
    reset: bool = False
    tier: Literal["device", "cpu", "disk"] = "device"


class KVResync(msgspec.Struct, tag="kv_resync", forbid_unknown_fields=True):
    """Router -> worker: send a full `KVEvents` snapshot (reset=True) next."""

    reason: str = ""


class PeerHint(msgspec.Struct, forbid_unknown_fields=True):
    """Inside a `Prefill` (or a `Generate`): a live peer holds the prompt's leading `num_blocks`
    blocks (in its cache or its KV tier, by the router's index) that the chosen worker lacks. The
    worker may pull them from the peer's `kv_address` (`KVFetch`) instead of computing them, when
    its measured rates say that is cheaper; no answer within `timeout_s` means it computes them."""

    worker_id: Name
    kv_address: KVAddress
    num_blocks: Annotated[int, Meta(ge=1, le=MAX_FETCH_BLOCKS)]
    transport: Literal["tcp", "shm"]  # shm: the two workers run on one host
    timeout_s: Annotated[float, Meta(gt=0, le=600)]


class KVFetch(msgspec.Struct, tag="kv_fetch", forbid_unknown_fields=True):
    """Worker -> peer worker's kv socket: push me the leading run of these blocks you hold.

    `keys[i]` is the prefix key (common.prefix_hash) of block `start_block + i` of a prompt and
    `token_ids` those blocks' tokens (compared before a block is sent, as the block pool does).
    The peer answers with a `KVHeader` (request_id = `fetch_id`, `start_block`, the number of
    leading blocks it found, 0 if none) pushed to `reply_address` over `transport`, or not at
    all when it is gone: the asker stops waiting after its own timeout.
    """

    fetch_id: Name
    start_block: Count
    keys: Annotated[list[BlockKey], Meta(max_length=MAX_FETCH_BLOCKS)]
    token_ids: Annotated[list[int], Meta(max_length=MAX_FETCH_TOKENS)]
    reply_address: KVAddress
    transport: Literal["tcp", "shm"]
    deadline_s: Annotated[float, Meta(gt=0, le=600)]  # seconds from receipt: later is no use
