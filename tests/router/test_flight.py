"""router/flight.py (and router.policy.PromptKeys): a flight's prompt is hashed into block keys
once per salt, however many choices read the keys (decode choice, a retry after a refusal, the
prefill choice, a retry after an unreachable prefill worker, the peer hint), and every reader
gets the keys `common.prefix_hash.block_keys` gives. Driven through a `Dispatcher` over a
`Registry` of workers whose messages go to a list, not a socket."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

import router.policy
from common.prefix_hash import block_keys, model_salt
from common.protocol import (
    PROTOCOL_VERSION,
    Generate,
    KVEvents,
    Prefill,
    Register,
    Reserve,
    ReserveReply,
)
from common.sampling_params import SamplingParams
from router.dispatch import Dispatcher
from router.flight import Flight
from router.kv_index import PrefixIndex
from router.policy import PromptKeys
from router.registry import Registry, Worker
from router.relay import EventBuffer

BS = 16
SALT = model_salt("default", "auto", BS)
PROMPT = [1000 + i for i in range(10 * BS + 3)]  # 10 full blocks and a part
KEYS = block_keys(PROMPT, BS, SALT)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bytes]]:
    """(block size, salt) of every prompt hashed through the router from now on."""
    calls: list[tuple[int, bytes]] = []

    def counting(tokens, block_size, salt, *args, **kwargs):
        calls.append((block_size, salt))
        return block_keys(tokens, block_size, salt, *args, **kwargs)

    monkeypatch.setattr(router.policy, "block_keys", counting)
    return calls


def register(registry: Registry, role: str, worker_id: str) -> Worker:
    registry.register(worker_id.encode(), Register(
        PROTOCOL_VERSION, role, worker_id, "default", BS, 1000, 4096, "auto", "h",
        f"tcp://127.0.0.1:{9000 + len(registry.workers)}", ["tcp"], SALT,
    ))  # fmt: skip
    worker = registry.get(worker_id)
    assert worker is not None
    return worker


class Cluster:
    """A dispatcher whose sends land in `sent`; the workers in `unreachable` refuse them, and a
    decode worker answers each Reserve with an accepted ReserveReply."""

    def __init__(self, routing: str, local_prefill_max_tokens: int) -> None:
        self.registry = Registry({"default"})
        self.index = PrefixIndex()
        self.sent: list[tuple[str, msgspec.Struct]] = []
        self.unreachable: set[str] = set()
        self.dispatcher = Dispatcher(
            self.registry, self.send, routing=routing, prefix_index=self.index,
            local_prefill_max_tokens=local_prefill_max_tokens,
        )  # fmt: skip

    def send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        if worker.worker_id in self.unreachable:
            return False
        self.sent.append((worker.worker_id, msg))
        if isinstance(msg, Reserve):
            reply = ReserveReply(msg.request_id, ok=True)
            asyncio.get_running_loop().call_soon(self.dispatcher.on_message, worker, reply)
        return True

    def dispatch(self, flight: Flight) -> None:
        asyncio.run(self.dispatcher.dispatch(flight))

    def messages(self, kind: type) -> list[tuple[str, msgspec.Struct]]:
        return [(w, m) for w, m in self.sent if isinstance(m, kind)]


def flight() -> Flight:
    return Flight("r", 0, PROMPT, SamplingParams(), EventBuffer())


def test_prompt_keys_hash_once_per_salt(hashed: list) -> None:
    keys = PromptKeys(PROMPT)
    assert keys.get(BS, SALT) == KEYS and keys.get(BS, SALT) is keys.get(BS, SALT)
    other = keys.get(BS, b"another salt")
    assert other == block_keys(PROMPT, BS, b"another salt") and other != KEYS
    assert keys.get(8, SALT) == block_keys(PROMPT, 8, SALT)
    assert hashed == [(BS, SALT), (BS, b"another salt"), (8, SALT)]
    assert PromptKeys(PROMPT[:BS - 1]).get(BS, SALT) == [] and len(keys) == len(PROMPT)


def test_a_colocated_flight_hashes_once_through_a_retry_and_the_peer_hint(hashed: list) -> None:
    """Prefix routing, a prompt the decode worker prefills: the decode choice (d0, which holds
    the prefix), its send failing, the choice again (d1), the peer hint naming d0: one hashing."""
    cluster = Cluster("prefix", local_prefill_max_tokens=4096)
    register(cluster.registry, "decode", "d0")
    register(cluster.registry, "decode", "d1")
    cluster.index.apply(KVEvents("d0", 0, KEYS[:6], [], reset=True))
    cluster.unreachable.add("d0")
    cluster.dispatch(flight())
    ((worker_id, generate),) = cluster.messages(Generate)
    assert worker_id == "d1" and generate.peer is not None
    assert (generate.peer.worker_id, generate.peer.num_blocks) == ("d0", 6)
    assert hashed == [(BS, SALT)]
    assert cluster.index.match("d1", KEYS) == len(KEYS)  # its keys filed as pending there


def test_a_disaggregated_flight_hashes_once_through_prefill_retries(hashed: list) -> None:
    """Prefix routing, a long prompt: Reserve on the decode worker, the prefill choice (p0,
    holding the prefix), p0 unreachable, the choice again (p1), the peer hint naming p0."""
    cluster = Cluster("prefix", local_prefill_max_tokens=8)
    register(cluster.registry, "decode", "d0")
    register(cluster.registry, "prefill", "p0")
    register(cluster.registry, "prefill", "p1")
    cluster.index.apply(KVEvents("p0", 0, KEYS[:4], [], reset=True))
    cluster.unreachable.add("p0")
    cluster.dispatch(flight())
    assert [w for w, _ in cluster.messages(Reserve)] == ["d0"]
    ((worker_id, prefill),) = cluster.messages(Prefill)
    assert worker_id == "p1" and prefill.peer is not None
    assert (prefill.peer.worker_id, prefill.peer.num_blocks) == ("p0", 4)
    assert hashed == [(BS, SALT)]
    assert cluster.index.match("p1", KEYS) == len(KEYS)


def test_least_loaded_routing_hashes_only_for_the_peer_hint(hashed: list) -> None:
    """No prefix routing: the one hashing is the peer hint's (the decode worker prefills)."""
    cluster = Cluster("least_loaded", local_prefill_max_tokens=4096)
    register(cluster.registry, "decode", "d0")
    register(cluster.registry, "decode", "d1")
    cluster.unreachable.add("d0")
    cluster.dispatch(flight())
    assert [w for w, _ in cluster.messages(Generate)] == ["d1"]
    assert hashed == [(BS, SALT)]
