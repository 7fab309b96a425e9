"""Peer fetch between two real prefill workers in one process (`kvtransfer.peer_fetch`).

The test plays the router (a ROUTER socket both workers' control connections reach) and the decode
worker (a KVReceiver into a zeroed cache). Worker `a` computes a prompt; worker `b` is then sent the
same prompt with a `PeerHint` naming `a`, pulls the prefix over real tcp or shm instead of
computing it, and must produce what computing gives (the first token, then greedy decoding from
the fetched blocks equal to HF transformers'). A peer that never answers, or holds nothing, means
`b` computes the prompt itself. Every engine's books balance, with every block free, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import zmq

from common.prefix_hash import block_keys
from common.protocol import KVHeader, PeerHint, Prefill
from kvtransfer import KVReceiver
from prefill.worker import PrefillWorker
from tests.common.engine.test_engine import GREEDY, hf_greedy, make_engine, prompts
from tests.kvtransfer import mapped_segments

BLOCK_SIZE = 8  # make_engine's
PROMPT = prompts(1, seed=11, lengths=(61,))[0]  # 7 full blocks and a part


class Pair:
    """Two prefill workers, a router socket and a decode-side receiver."""

    def __init__(self, hf_model, **engine_overrides) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.a = PrefillWorker(make_engine(hf_model, **engine_overrides), address, "a", self.ctx)
        self.b = PrefillWorker(make_engine(hf_model, **engine_overrides), address, "b", self.ctx)
        runner = self.a.engine.runner
        scales = None if runner.kv_scales is None else torch.zeros_like(runner.kv_scales)
        self.decode = KVReceiver(torch.zeros_like(runner.kv_cache), context=self.ctx,
                                 kv_scales=scales)  # fmt: skip
        self.headers: list[KVHeader] = []

    def prefill(self, worker: PrefillWorker, rid: str, peer: PeerHint | None = None) -> None:
        message = Prefill(
            request_id=rid,
            prompt_token_ids=PROMPT,
            params=GREEDY,
            decode_worker_id="decode",
            decode_kv_address=self.decode.address,
            num_decode_cached_tokens=0,
            transport="tcp",
            deadline_s=30.0,
            peer=peer,
        )
        # As the worker's loop does: a hinted dispatch may wait for its fetch first.
        if not worker._fetch_first(message):
            worker.handle(message)

    def run_until(
        self, done: Callable[[], bool], timeout_s: float = 30.0, workers: tuple = ()
    ) -> None:
        """Step `workers` (both by default) and the decode side until `done`."""
        deadline = time.monotonic() + timeout_s
        dst = list(range(64))
        while not done():
            assert time.monotonic() < deadline, "timed out"
            for worker in workers or (self.a, self.b):
                worker.step()
            for r in self.decode.poll(lambda h: dst[: h.num_blocks]):
                assert r.ok, r.reason
                self.headers.append(r.header)
            time.sleep(0.001)

    def hint(self, transport: str, address: str = "", timeout_s: float = 10.0) -> PeerHint:
        num_blocks = (len(PROMPT) - 1) // BLOCK_SIZE
        return PeerHint("a", address or self.a.kv_address, num_blocks, transport, timeout_s)

    def assert_b_fetched(self, blocks: int) -> None:
        """b took `blocks` blocks from a, computed only the rest, and answered as a did."""
        fetched = self.b.peer_fetch_counters()["kv_peer_fetched_tokens_total"]
        assert fetched == blocks * BLOCK_SIZE
        assert self.b.engine.num_prefill_tokens == len(PROMPT) - blocks * BLOCK_SIZE
        assert self.headers[1].first_token_id == self.headers[0].first_token_id

    def assert_all_free(self) -> None:
        for worker in (self.a, self.b):
            books = worker.engine.block_books()
            assert books.ok, books.errors
            assert books.free + books.cached == books.total, books
            assert not worker.deferred and not worker.engine.reserved and worker.is_idle()

    def close(self) -> None:
        for worker in (self.a, self.b):
            worker.close()
        self.decode.close()
        self.router.close(0)
        self.ctx.term()


@pytest.fixture()
def pair(tiny_llama):
    p = Pair(tiny_llama[0])
    yield p
    p.close()
    # closed, every worker let go of its views of shm segments (a half-copied answer's too)
    assert not mapped_segments(), "a shm segment stayed mapped after close()"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_fetched_prefix_gives_the_computed_output_with_fewer_prefill_tokens(
    pair, tiny_llama, transport
) -> None:
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    assert pair.a.engine.num_prefill_tokens == len(PROMPT)

    pair.prefill(pair.b, "r2", pair.hint(transport))
    assert "r2" in pair.b.deferred  # waits for its fetch, computes nothing yet
    pair.run_until(lambda: len(pair.headers) == 2)
    fetched = 7 * BLOCK_SIZE
    # b computed only the prompt's tail: the 7 full blocks came from a
    assert pair.b.engine.num_prefill_tokens == len(PROMPT) - fetched
    stats = pair.b.peer_fetch_counters()
    assert stats["kv_peer_fetched_tokens_total"] == fetched
    assert stats["kv_peer_fetch_failures_total"] == 0
    assert pair.a.peer_fetch_counters()["kv_peer_served_tokens_total"] == fetched
    expected = hf_greedy(tiny_llama[0], PROMPT, GREEDY.max_tokens)
    assert [h.first_token_id for h in pair.headers] == [expected[0]] * 2
    assert pair.b.fetcher is not None and pair.b.fetcher.bytes_per_s.get(transport, 0) > 0
    pair.run_until(lambda: not pair.a.sender.num_pending() and not pair.b.sender.num_pending())
    pair.assert_all_free()
    # Decoding greedily from b's cache (the fetched blocks are its prefix hit) gives HF's output.
    engine = pair.b.engine
    (seq,) = engine.generate([PROMPT], GREEDY)
    assert seq.num_cached_tokens == fetched
    assert seq.output_token_ids == expected
    # The fetched blocks hold exactly what a computed: byte for byte
    keys = block_keys(PROMPT, BLOCK_SIZE, engine.block_manager.salt)
    token_blocks = [PROMPT[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] for i in range(7)]
    ours = engine.pool.lookup(keys, token_blocks)
    theirs = pair.a.engine.pool.lookup(keys, token_blocks)
    assert len(ours) == len(theirs) == 7
    assert torch.equal(
        engine.runner.kv_cache[:, :, ours], pair.a.engine.runner.kv_cache[:, :, theirs]
    )
    pair.assert_all_free()


def test_a_peer_that_never_answers_means_computing_after_the_timeout(pair, tiny_llama) -> None:
    silent = pair.ctx.socket(zmq.ROUTER)  # takes the fetch, never answers
    silent.bind("tcp://127.0.0.1:*")
    try:
        address = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        started = time.monotonic()
        pair.prefill(pair.b, "r1", pair.hint("tcp", address, timeout_s=0.5))
        assert "r1" in pair.b.deferred and pair.b.engine.reserved  # blocks held for the answer
        pair.run_until(lambda: len(pair.headers) == 1)
        assert time.monotonic() - started >= 0.5
        assert silent.poll(0)  # the fetch did go out
        assert pair.b.engine.num_prefill_tokens == len(PROMPT)  # computed it all
        assert pair.headers[0].first_token_id == hf_greedy(tiny_llama[0], PROMPT, 1)[0]
        assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 1
        assert address not in pair.b.sender._peers  # the silent peer's socket was closed
        pair.run_until(lambda: not pair.b.sender.num_pending())
        pair.assert_all_free()
    finally:
        silent.close(0)


def test_a_peer_that_dies_while_asked_is_noticed_by_its_lost_connection(pair, tiny_llama) -> None:
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.run_until(lambda: not pair.a.sender.num_pending())
    started = time.monotonic()
    pair.prefill(pair.b, "r2", pair.hint("tcp", timeout_s=20.0))
    assert "r2" in pair.b.deferred
    deadline = time.monotonic() + 10
    assert pair.a.receiver.socket.poll(5000)  # the fetch reached a (a has not read it)
    pair.a.receiver.socket.close(linger=0)  # a's process dies: its kernel closes the connection
    # a is gone: only b and the decode side run
    pair.run_until(lambda: len(pair.headers) == 2, deadline - time.monotonic(), (pair.b,))
    assert time.monotonic() - started < 10  # the lost connection, not the 20 s timeout
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)
    assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 1
    assert pair.headers[1].first_token_id == hf_greedy(tiny_llama[0], PROMPT, 1)[0]
    assert pair.a.kv_address not in pair.b.sender._peers  # its socket closed
    pair.run_until(lambda: not pair.b.sender.num_pending(), deadline - time.monotonic(), (pair.b,))
    pair.assert_all_free()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_peer_killed_mid_answer_means_computing_with_the_same_greedy_output(
    pair, tiny_llama, transport
) -> None:
    """The peer has begun its answer (some blocks copied into the payload, the rest still to
    come, a block a turn) when its process dies: b notices the lost connection, computes the
    whole prompt itself, and decoding from what it computed gives HF's greedy output."""
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.run_until(lambda: not pair.a.sender.num_pending())
    pair.a.fetch_server.bytes_per_turn = 1  # one block a turn: the answer takes 7 turns
    pair.a.fetch_server.share = 0  # ... however long a's turns take
    started = time.monotonic()
    pair.prefill(pair.b, "r2", pair.hint(transport, timeout_s=20.0))
    assert "r2" in pair.b.deferred
    assert pair.a.receiver.socket.poll(5000)  # the fetch reached a
    deadline = time.monotonic() + 10
    answer = pair.a.fetch_server._active
    while answer is None or answer.filled < 2:
        assert time.monotonic() < deadline, "timed out"
        pair.a.step()
        answer = pair.a.fetch_server._active
    assert 2 <= answer.filled < len(answer.sources) == 7  # mid-answer: nothing sent yet
    # a's process dies: its kernel closes its connections (and its shm segments go with it)
    pair.a.receiver.socket.close(linger=0)
    pair.a.sender.close()
    # a is gone: only b and the decode side run
    pair.run_until(lambda: len(pair.headers) == 2, deadline - time.monotonic(), (pair.b,))
    assert time.monotonic() - started < 10  # the lost connection, not the 20 s timeout
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)  # computed it all
    stats = pair.b.peer_fetch_counters()
    assert stats["kv_peer_fetch_failures_total"] == 1
    assert stats["kv_peer_fetched_tokens_total"] == 0
    expected = hf_greedy(tiny_llama[0], PROMPT, GREEDY.max_tokens)
    assert pair.headers[1].first_token_id == expected[0]
    pair.run_until(lambda: not pair.b.sender.num_pending(), deadline - time.monotonic(), (pair.b,))
    books = pair.b.engine.block_books()
    assert books.ok and books.free + books.cached == books.total, books
    assert not pair.b.deferred and not pair.b.engine.reserved and pair.b.is_idle()
    # decoding greedily from the blocks b computed (its prefix hit now) gives HF's output
    (seq,) = pair.b.engine.generate([PROMPT], GREEDY)
    assert seq.num_cached_tokens == 7 * BLOCK_SIZE
    assert seq.output_token_ids == expected
    books = pair.b.engine.block_books()
    assert books.ok and books.free + books.cached == books.total, books


def test_a_peer_address_where_nothing_listens_means_computing_at_once(pair) -> None:
    gone = pair.ctx.socket(zmq.ROUTER)  # a port that was a worker's, now closed
    gone.bind("tcp://127.0.0.1:*")
    address = gone.getsockopt_string(zmq.LAST_ENDPOINT)
    gone.close(0)
    started = time.monotonic()
    pair.prefill(pair.b, "r1", pair.hint("tcp", address, timeout_s=20.0))
    assert "r1" in pair.b.deferred
    pair.run_until(lambda: len(pair.headers) == 1)
    assert time.monotonic() - started < 10  # the refused connection, not the 20 s timeout
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)
    assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 1
    assert address not in pair.b.sender._peers
    pair.run_until(lambda: not pair.b.sender.num_pending())
    pair.assert_all_free()


def test_a_peer_holding_nothing_answers_at_once_and_the_prompt_is_computed(pair) -> None:
    pair.prefill(pair.b, "r1", pair.hint("shm", timeout_s=20.0))
    started = time.monotonic()
    pair.run_until(lambda: len(pair.headers) == 1)
    assert time.monotonic() - started < 10  # the empty answer, not the timeout
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)
    assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 1
    pair.run_until(lambda: not pair.b.sender.num_pending() and not pair.a.sender.num_pending())
    pair.assert_all_free()


def test_aborted_while_fetching_frees_the_blocks_and_refuses_the_late_answer(pair) -> None:
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.prefill(pair.b, "r2", pair.hint("tcp"))
    pair.b._abort("r2")  # before a answered
    pair.run_until(lambda: not pair.a.sender.num_pending())
    assert pair.b.engine.num_prefill_tokens == 0 and len(pair.headers) == 1
    pair.assert_all_free()


def test_a_cost_model_that_favours_computing_declines_the_hint(pair) -> None:
    fetcher = pair.b.fetcher
    assert fetcher is not None
    fetcher.bytes_per_s["tcp"] = 1.0  # a byte a second: computing is far cheaper
    costs = pair.b.engine.prefill_budget.costs
    for tokens in (16, 40, 64, 24, 56, 8, 32, 48, 60, 20):  # a measured prefill rate
        costs.record(tokens, 0, 1e-3 + 1e-5 * tokens)
    assert costs.prefill_token_s() is not None
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.prefill(pair.b, "r2", pair.hint("tcp"))
    assert "r2" not in pair.b.deferred and fetcher.declined == 1
    pair.run_until(lambda: len(pair.headers) == 2)
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)
    pair.run_until(lambda: not pair.b.sender.num_pending() and not pair.a.sender.num_pending())
    pair.assert_all_free()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_blocks_in_the_peers_tier_are_fetched_too(tiny_llama, kv_dtype) -> None:
    # 16 blocks of 8 tokens (512 bytes a token, or 160 in int8 with its scales): a second prompt
    # evicts the first's last blocks into a's RAM tier
    memory = str(16 * BLOCK_SIZE * (512 if kv_dtype == "auto" else 160))
    pair = Pair(tiny_llama[0], kv_cache_memory=memory, max_model_len=128,
                kv_offload_memory="1MiB", kv_cache_dtype=kv_dtype)  # fmt: skip
    try:
        a = pair.a.engine
        assert a.pool.num_blocks == 16 and a.tier is not None
        pair.prefill(pair.a, "r1")
        pair.run_until(lambda: len(pair.headers) == 1)
        pair.run_until(lambda: not pair.a.sender.num_pending())
        a.generate([prompts(1, seed=3, lengths=(60,))[0]], GREEDY)
        keys = block_keys(PROMPT, BLOCK_SIZE, a.block_manager.salt)[:7]
        in_tier = [key in a.tier.ram for key in keys]
        assert any(in_tier) and not all(in_tier), in_tier  # some from the cache, some the tier
        pair.prefill(pair.b, "r2", pair.hint("shm"))
        pair.run_until(lambda: len(pair.headers) == 2)
        pair.assert_b_fetched(7)
        pair.run_until(lambda: not pair.b.sender.num_pending() and not pair.a.sender.num_pending())
        pair.assert_all_free()
        # b's copy of every block is a's, byte for byte (the tier keeps blocks byte-exact)
        (seq,) = pair.b.engine.generate([PROMPT], GREEDY)
        assert seq.num_cached_tokens == 7 * BLOCK_SIZE
        assert seq.output_token_ids[0] == pair.headers[0].first_token_id
        pair.assert_all_free()
    finally:
        pair.close()


def test_a_decode_worker_fetches_for_a_prompt_it_prefills_itself(pair, tiny_llama) -> None:
    from common import protocol
    from common.protocol import Generate
    from decode.worker import DecodeWorker

    address = pair.router.getsockopt_string(zmq.LAST_ENDPOINT)
    decode = DecodeWorker(make_engine(tiny_llama[0]), address, "d", "tcp://127.0.0.1:*",
                          context=pair.ctx)  # fmt: skip
    try:
        pair.prefill(pair.a, "r1")
        pair.run_until(lambda: len(pair.headers) == 1)
        message = Generate("r2", PROMPT, GREEDY, peer=pair.hint("tcp"))
        assert decode._fetch_first(message) and "r2" in decode.deferred
        deadline = time.monotonic() + 30
        tokens: list[int] = []
        finished = False  # the last tokens may still be on the socket when the engine is done
        while not finished:
            assert time.monotonic() < deadline, "timed out"
            pair.a.step()
            decode.step()
            while pair.router.poll(0):
                identity, frame = pair.router.recv_multipart()
                msg = protocol.decode_control(frame)
                if isinstance(msg, protocol.TokenBatch):
                    tokens += [t for out in msg.outputs for t in out.token_ids]
                    finished |= any(out.finished for out in msg.outputs)
        assert not decode.engine.has_unfinished() and not decode.deferred
        assert tokens == hf_greedy(tiny_llama[0], PROMPT, GREEDY.max_tokens)
        assert decode.engine.num_prefill_tokens == len(PROMPT) - 7 * BLOCK_SIZE
        assert decode.peer_fetch_counters()["kv_peer_fetched_tokens_total"] == 7 * BLOCK_SIZE
        books = decode.engine.block_books()
        assert books.ok and books.free + books.cached == books.total, books
    finally:
        decode.close()
