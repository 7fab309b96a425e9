"""The serving side of peer fetches (`kvtransfer.peer_serve`), between two real prefill workers in
one process (the `Pair` of tests/kvtransfer/test_peer_fetch.py: a router socket, a decode-side
receiver). Worker `a` holds a prompt's blocks and answers `b`'s fetch of them: a slice a turn within
its per-turn bound (more after a long turn of its own), its cache blocks pinned until copied; an
answer its asker stopped waiting for is given up and unpinned; fetches beyond the queue's bound
are answered empty at once. Every engine's books balance, with every block free, at the end.
"""

from __future__ import annotations

import time

import pytest
import torch

from common.prefix_hash import block_keys
from kvtransfer import peer_fetch, peer_serve
from prefill.worker import PrefillWorker
from tests.common.engine.test_engine import GREEDY, hf_greedy, prompts
from tests.kvtransfer.test_peer_fetch import BLOCK_SIZE, PROMPT, Pair


@pytest.fixture()
def pair(tiny_llama):
    p = Pair(tiny_llama[0])
    yield p
    p.close()


def _blocks_a_turn(worker: PrefillWorker, num_blocks: int) -> None:
    """Let `worker` copy at most `num_blocks` blocks into its answers to peers per turn, however
    long its turns take."""
    worker.fetch_server.bytes_per_turn = num_blocks * peer_fetch.block_nbytes(worker.engine)
    worker.fetch_server.share = 0


@pytest.mark.parametrize(("transport", "kv_dtype"), [("tcp", "auto"), ("shm", "int8")])
def test_an_answer_is_copied_a_bounded_slice_a_turn(tiny_llama, transport, kv_dtype) -> None:
    pair = Pair(tiny_llama[0], kv_cache_dtype=kv_dtype)
    try:
        pair.prefill(pair.a, "r1")
        pair.run_until(lambda: len(pair.headers) == 1)
        pair.run_until(lambda: not pair.a.sender.num_pending())
        _blocks_a_turn(pair.a, 2)  # the 7 blocks take 4 of a's turns
        server = pair.a.fetch_server
        pair.prefill(pair.b, "r2", pair.hint(transport))
        filled: list[int] = []  # after each of a's turns with an answer under way
        dst = list(range(64))
        deadline = time.monotonic() + 30
        while len(pair.headers) < 2:
            assert time.monotonic() < deadline, "timed out"
            pair.a.step()
            if server._active is not None:
                filled.append(server._active.filled)
                books = pair.a.engine.block_books()
                assert books.ok and books.held == 7, books  # its cache blocks stay pinned
            pair.b.step()
            for r in pair.decode.poll(lambda h: dst[: h.num_blocks]):
                assert r.ok, r.reason
                pair.headers.append(r.header)
            time.sleep(0.001)
        assert filled == [2, 4, 6]  # then the seventh, and the answer went out
        assert server.served_blocks == 7 and server.given_up == 0
        pair.assert_b_fetched(7)
        pair.run_until(lambda: not pair.a.sender.num_pending() and not pair.b.sender.num_pending())
        pair.assert_all_free()
        # the blocks b fetched in slices are a's, byte for byte (and scales, for int8)
        keys = block_keys(PROMPT, BLOCK_SIZE, pair.b.engine.block_manager.salt)[:7]
        token_blocks = [PROMPT[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] for i in range(7)]
        ours = pair.b.engine.pool.lookup(keys, token_blocks)
        theirs = pair.a.engine.pool.lookup(keys, token_blocks)
        assert len(ours) == len(theirs) == 7
        runner_a, runner_b = pair.a.engine.runner, pair.b.engine.runner
        assert torch.equal(runner_b.kv_cache[:, :, ours].view(torch.uint8),
                           runner_a.kv_cache[:, :, theirs].view(torch.uint8))  # fmt: skip
        if runner_a.kv_scales is not None:
            assert torch.equal(runner_b.kv_scales[:, :, ours], runner_a.kv_scales[:, :, theirs])
        (seq,) = pair.b.engine.generate([PROMPT], GREEDY)
        assert seq.num_cached_tokens == 7 * BLOCK_SIZE
        if kv_dtype == "auto":
            assert seq.output_token_ids == hf_greedy(tiny_llama[0], PROMPT, GREEDY.max_tokens)
        pair.assert_all_free()
    finally:
        pair.close()


def test_a_worker_whose_own_turns_are_long_copies_more_of_an_answer_a_turn(pair) -> None:
    """A turn copies `bytes_per_turn`, then more while its copying has taken under `share` of
    the worker's own time since its previous turn: a busy prefill worker's turn is a whole
    prompt step, and an answer paced at one small slice a turn would miss its asker's timeout.
    Here a slice is one block: right after a turn (no time of its own to share) a copies one,
    after a second of its own work (a long step) the other six go out in that turn, and the blocks
    b then holds are a's."""
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.run_until(lambda: not pair.a.sender.num_pending())
    server = pair.a.fetch_server
    server.bytes_per_turn = peer_fetch.block_nbytes(pair.a.engine)  # a slice: one block
    assert server.share == peer_serve.SERVE_SHARE > 0
    pair.prefill(pair.b, "r2", pair.hint("tcp"))
    assert pair.a.receiver.socket.poll(5000)  # the fetch reached a
    pair.a.receiver.poll(pair.a._resolve_kv)  # ... and is taken, as a's turn would
    (fetch,) = pair.a.receiver.take_fetches()
    server.step()  # a turn with nothing to copy
    server.add(fetch)
    server.step()  # right after it: no time of its own to share, so one slice
    assert server._active is not None and server._active.filled == 1
    assert pair.a.engine.block_books().held == 7  # its cache blocks stay pinned
    time.sleep(1.0)  # a's own work between turns: a long step (250 ms to copy 6 tiny blocks)
    server.step()
    assert server._active is None and server.served_blocks == 7  # the other six, in one turn
    pair.run_until(lambda: len(pair.headers) == 2)
    pair.assert_b_fetched(7)
    pair.run_until(lambda: not pair.a.sender.num_pending() and not pair.b.sender.num_pending())
    pair.assert_all_free()


def test_an_answer_sent_in_time_is_still_there_when_a_busy_asker_reads_it(pair) -> None:
    """The asker reads an answer between its own steps, which can outlast its wait: b's fetch
    waits 0.5 s, a answers over shm at once, then b is in a 0.8 s step while a turns on (past
    the wait, a's sender expires nothing: the payload outlives the wait by `ANSWER_GRACE_S`).
    b then takes the answer that came in time and computes only what it did not fetch."""
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.run_until(lambda: not pair.a.sender.num_pending())
    pair.prefill(pair.b, "r2", pair.hint("shm", timeout_s=0.5))
    assert "r2" in pair.b.deferred
    pair.run_until(lambda: pair.a.fetch_server.served_blocks == 7, workers=(pair.a,))
    assert pair.b.receiver.socket.poll(5000)  # the answer is at b, unread: b is busy
    time.sleep(0.8)  # b's long step, past its wait
    pair.a.step()  # a turns meanwhile: its answer's payload stays
    assert pair.a.sender.num_pending() == 1
    pair.run_until(lambda: len(pair.headers) == 2)
    pair.assert_b_fetched(7)
    assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 0
    pair.run_until(lambda: not pair.a.sender.num_pending() and not pair.b.sender.num_pending())
    pair.assert_all_free()


def test_an_answer_the_asker_stopped_waiting_for_is_given_up_and_unpinned(pair) -> None:
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    pair.run_until(lambda: not pair.a.sender.num_pending())
    _blocks_a_turn(pair.a, 1)
    server = pair.a.fetch_server
    pair.prefill(pair.b, "r2", pair.hint("tcp", timeout_s=0.5))
    deadline = time.monotonic() + 10
    while server._active is None:  # a takes the fetch and copies its first block
        assert time.monotonic() < deadline, "timed out"
        pair.a.step()
    assert pair.a.engine.block_books().held == 7
    time.sleep(0.6)  # past the fetch's deadline on both sides
    pair.run_until(lambda: len(pair.headers) == 2)  # b computed the prompt after its timeout
    pair.run_until(lambda: server._active is None and not pair.a.sender.num_pending())
    assert server.given_up == 1 and server.served_blocks == 0
    assert pair.a.peer_fetch_counters()["kv_peer_served_tokens_total"] == 0
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)
    assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 1
    assert pair.headers[1].first_token_id == pair.headers[0].first_token_id
    assert pair.a.kv_address not in pair.b.sender._peers  # no answer came: socket closed
    pair.run_until(lambda: not pair.b.sender.num_pending())
    pair.assert_all_free()


def test_fetches_beyond_the_queue_bound_are_answered_empty_at_once(pair, monkeypatch) -> None:
    monkeypatch.setattr(peer_serve, "MAX_QUEUED_FETCHES", 0)
    pair.prefill(pair.a, "r1")
    pair.run_until(lambda: len(pair.headers) == 1)
    started = time.monotonic()
    pair.prefill(pair.b, "r2", pair.hint("tcp", timeout_s=20.0))
    pair.run_until(lambda: len(pair.headers) == 2)
    assert time.monotonic() - started < 10  # the empty answer, not the timeout
    assert pair.b.engine.num_prefill_tokens == len(PROMPT)
    assert pair.a.fetch_server.served_blocks == 0
    assert pair.a.kv_address in pair.b.sender._peers  # it answered: its socket is kept
    pair.run_until(lambda: not pair.b.sender.num_pending() and not pair.a.sender.num_pending())
    pair.assert_all_free()


def test_a_disk_tier_block_found_damaged_while_answering_means_an_empty_answer(
    tiny_llama, tmp_path
) -> None:
    # 16 blocks of 8 tokens: a second prompt evicts the first's last blocks to a's disk tier
    pair = Pair(tiny_llama[0], kv_cache_memory=str(16 * BLOCK_SIZE * 512), max_model_len=128,
                kv_offload_dir=str(tmp_path), kv_offload_disk="1MiB")  # fmt: skip
    try:
        a = pair.a.engine
        assert a.pool.num_blocks == 16 and a.tier is not None and a.tier.disk is not None
        pair.prefill(pair.a, "r1")
        pair.run_until(lambda: len(pair.headers) == 1)
        pair.run_until(lambda: not pair.a.sender.num_pending())
        a.generate([prompts(1, seed=3, lengths=(60,))[0]], GREEDY)
        a.tier.flush()
        keys = block_keys(PROMPT, BLOCK_SIZE, a.block_manager.salt)[:7]
        on_disk = [key for key in keys if key in a.tier.disk]
        assert on_disk and len(on_disk) < 7, on_disk  # the leading blocks are still cached
        _blocks_a_turn(pair.a, 1)
        server = pair.a.fetch_server
        started = time.monotonic()
        pair.prefill(pair.b, "r2", pair.hint("tcp", timeout_s=20.0))
        deadline = time.monotonic() + 10
        while server._active is None:  # a takes the fetch and copies its first (cached) block
            assert time.monotonic() < deadline, "timed out"
            pair.a.step()
        assert server._active.filled == 1 and isinstance(server._active.sources[-1], bytes)
        with open(a.tier.disk._file(on_disk[-1]), "r+b") as f:  # a bit flips on the disk
            f.seek(-3, 2)
            byte = f.read(1)
            f.seek(-3, 2)
            f.write(bytes([byte[0] ^ 0x40]))
        pair.run_until(lambda: len(pair.headers) == 2)
        assert time.monotonic() - started < 10  # the empty answer, not the 20 s timeout
        assert server.given_up == 1 and server.served_blocks == 0
        assert a.tier.stats()["kv_offload_disk_corrupt_total"] == 1
        assert pair.b.engine.num_prefill_tokens == len(PROMPT)  # computed: never wrong KV
        assert pair.b.peer_fetch_counters()["kv_peer_fetch_failures_total"] == 1
        assert pair.headers[1].first_token_id == pair.headers[0].first_token_id
        pair.run_until(lambda: not pair.b.sender.num_pending() and not pair.a.sender.num_pending())
        pair.assert_all_free()
    finally:
        pair.close()
