"""The prefill worker in one process: its handling of a dispatch and its KV send decision.

The test plays the router (a ROUTER socket on the worker's control connection, speaking the real
protocol) and the decode worker (a real KVReceiver into a zeroed cache of the same layout). It
calls the worker's `handle`, `step` and `abort` directly instead of `run`, so every outcome is
checked at a known point: which blocks travel, with which header, and that every path ends with
the blocks released and, where the router must hear of it, one RequestFailed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest
import torch
import zmq

from common import protocol
from common.prefix_hash import block_keys
from common.protocol import KVHeader, Prefill, RequestFailed
from kvtransfer import KVReceiver
from prefill.worker import PrefillWorker
from tests.common.engine.test_engine import GREEDY, hf_greedy, make_engine, prompts

BLOCK_SIZE = 8  # make_engine's


class Harness:
    """A prefill worker wired to a test-held router socket and an in-process KV receiver."""

    def __init__(self, hf_model, kv_transport: str = "auto") -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        engine = make_engine(hf_model)
        self.worker = PrefillWorker(engine, address, "prefill-t", self.ctx, kv_transport)
        self.receiver = KVReceiver(torch.zeros_like(engine.runner.kv_cache), context=self.ctx)
        self.received: list = []

    @property
    def engine(self):
        return self.worker.engine

    def dispatch(
        self,
        rid: str,
        prompt: list[int],
        cached_tokens: int = 0,
        transport: str = "tcp",
        deadline_s: float = 10.0,
        params=GREEDY,
    ) -> None:
        self.worker.handle(
            Prefill(
                request_id=rid,
                prompt_token_ids=prompt,
                params=params,
                decode_worker_id="decode-t",
                decode_kv_address=self.receiver.address,
                num_decode_cached_tokens=cached_tokens,
                transport=transport,
                deadline_s=deadline_s,
            )
        )

    def run_until(
        self,
        done: Callable[[], bool],
        resolve: Callable[[KVHeader], list[int] | None] | None = None,
        timeout_s: float = 20.0,
    ) -> None:
        """Step the worker (and, given `resolve`, the receiver) until `done()`."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.worker.step()
            if resolve is not None:
                self.received += self.receiver.poll(resolve)
            time.sleep(0.001)

    def router_messages(self, wait_ms: int = 200) -> list[protocol.ControlMessage]:
        """Everything the worker sent to the router so far."""
        out = []
        while self.router.poll(wait_ms):
            identity, frame = self.router.recv_multipart()
            assert identity == b"prefill-t"
            out.append(protocol.decode_control(frame))
            wait_ms = 50
        return out

    def assert_all_released(self) -> None:
        assert not self.worker.jobs and not self.engine.held and not self.engine.has_unfinished()
        assert self.engine.pool.num_free == self.engine.pool.num_blocks
        assert self.worker.sender.num_pending() == 0 and self.worker.is_idle()

    def close(self) -> None:
        self.worker.close()
        self.receiver.close()
        self.router.close(0)
        self.ctx.term()


@pytest.fixture()
def harness(tiny_llama):
    h = Harness(tiny_llama[0])
    yield h
    h.close()


def blocks_from(block_ids: list[int]) -> Callable[[KVHeader], list[int]]:
    return lambda header: block_ids[: header.num_blocks]


def test_sends_only_the_blocks_decode_lacks_with_the_first_token(harness, tiny_llama) -> None:
    prompt = prompts(1, seed=4, lengths=(27,))[0]  # 4 blocks of 8, the last one partial
    params = dataclasses.replace(GREEDY, max_tokens=24, min_tokens=5)
    harness.dispatch("r1", prompt, cached_tokens=2 * BLOCK_SIZE, params=params)
    seq = harness.engine.seqs["r1"]
    # The prefill side computes the prompt and samples exactly one token.
    assert (seq.params.max_tokens, seq.params.min_tokens) == (1, 1)
    dst, tables = [5, 9, 0, 3], {}

    def resolve(header: KVHeader) -> list[int]:
        tables[header.request_id] = list(harness.engine.held[header.request_id].block_table)
        return dst[: header.num_blocks]

    harness.run_until(lambda: harness.worker.kv_bytes > 0, resolve)
    (received,) = harness.received
    header = received.header
    assert received.ok
    # Decode holds the first 16 tokens: blocks 2 and 3 travel, with the first token sampled here.
    assert (header.request_id, header.start_block, header.num_blocks) == ("r1", 2, 2)
    assert header.first_token_id == hf_greedy(tiny_llama[0], prompt, 1)[0]
    assert header.first_logprob is None and header.transport == "tcp"
    sent = harness.engine.runner.kv_cache[:, :, tables["r1"][2:4]]
    assert torch.equal(harness.receiver.kv_cache[:, :, dst[:2]], sent)
    assert harness.worker.kv_bytes == header.nbytes == sent.numel() * sent.element_size()
    assert harness.worker.histograms()["kv_transfer_seconds"].count == 1
    assert harness.worker.counters()["kv_transfer_failures_total"] == 0
    assert harness.router_messages() == []  # success needs no word to the router
    harness.assert_all_released()
    # The prompt's full blocks stay in the prefix cache after the transfer.
    keys = block_keys(prompt, BLOCK_SIZE, harness.engine.block_manager.salt)
    assert len(keys) == 3 and set(keys) <= set(harness.engine.pool.cached_keys())


@pytest.mark.parametrize(
    "worker_flag, requested, expected",
    [("auto", "shm", "shm"), ("auto", "tcp", "tcp"), ("tcp", "shm", "tcp"), ("shm", "tcp", "shm")],
)
def test_worker_transport_flag_overrides_the_routers_choice(
    tiny_llama, worker_flag: str, requested: str, expected: str
) -> None:
    h = Harness(tiny_llama[0], kv_transport=worker_flag)
    try:
        h.dispatch("t", prompts(1, seed=5, lengths=(9,))[0], transport=requested)
        h.run_until(lambda: h.worker.kv_bytes > 0, blocks_from([1, 2]))
        assert [(r.ok, r.header.transport) for r in h.received] == [(True, expected)]
        h.assert_all_released()
    finally:
        h.close()


def test_refused_transfer_fails_the_request_and_frees_the_blocks(harness) -> None:
    harness.dispatch("gone", prompts(1, seed=6, lengths=(17,))[0])
    harness.run_until(lambda: not harness.worker.jobs, resolve=lambda header: None)
    assert [r.ok for r in harness.received] == [False]
    (failed,) = harness.router_messages()
    assert isinstance(failed, RequestFailed)
    assert (failed.request_id, failed.stage) == ("gone", "transfer")
    assert "unknown or aborted request" in failed.reason
    assert harness.worker.counters()["kv_transfer_failures_total"] == 1
    assert harness.worker.kv_bytes == 0
    harness.assert_all_released()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_damaged_kv_the_receiver_recomputes_is_no_failure_of_the_request(
    harness, transport, monkeypatch
) -> None:
    from tests.kvtransfer import damage_on_the_way

    damage_on_the_way(monkeypatch, block=1)  # a byte flips after the sender's checksums
    harness.receiver.recompute_damaged = True  # as the decode worker's receiver
    harness.dispatch("dmg", prompts(1, seed=6, lengths=(17,))[0], transport=transport)
    harness.run_until(lambda: not harness.worker.jobs, blocks_from([1, 2, 3]))
    assert [(r.ok, r.damaged) for r in harness.received] == [(False, True)]
    assert harness.router_messages() == []  # the decode worker goes on with it: not a failure
    assert harness.worker.counters()["kv_transfer_failures_total"] == 1
    assert harness.worker.origin == {}
    harness.assert_all_released()


def test_deadline_counts_from_receipt(harness) -> None:
    harness.dispatch("slow", prompts(1, seed=7, lengths=(12,))[0], deadline_s=0.0)
    harness.run_until(lambda: not harness.worker.jobs)  # the receiver never reads
    (failed,) = harness.router_messages()
    assert (failed.request_id, failed.stage, failed.reason) == ("slow", "transfer", "deadline")
    harness.assert_all_released()


def test_bad_prompt_fails_at_prefill_and_queues_nothing(harness) -> None:
    too_long = [3] * harness.engine.max_model_len
    harness.dispatch("long", too_long)
    (failed,) = harness.router_messages()
    assert (failed.request_id, failed.stage) == ("long", "prefill")
    assert "tokens" in failed.reason
    harness.assert_all_released()


def test_send_error_fails_that_request_only(harness) -> None:
    bad, good = prompts(2, seed=8, lengths=(10, 11))
    harness.dispatch("bad", bad, transport="carrier-pigeon")
    harness.run_until(lambda: not harness.worker.jobs)
    (failed,) = harness.router_messages()
    assert (failed.request_id, failed.stage) == ("bad", "transfer")
    assert "unknown kv transport" in failed.reason
    assert harness.worker.kv_failures == 1
    harness.assert_all_released()
    harness.dispatch("good", good)  # the worker keeps serving
    harness.run_until(lambda: harness.worker.kv_bytes > 0, blocks_from([0, 1]))
    assert [(r.header.request_id, r.ok) for r in harness.received] == [("good", True)]
    harness.assert_all_released()


def test_abort_before_the_prompt_is_computed_sends_nothing(harness) -> None:
    harness.dispatch("a", prompts(1, seed=9, lengths=(20,))[0])
    harness.worker.abort("a")
    for _ in range(3):
        harness.worker.step()
    assert harness.receiver.poll(blocks_from([0, 1, 2]), timeout_ms=100) == []
    assert harness.router_messages() == []  # the router asked for the abort: no echo
    harness.assert_all_released()


def test_abort_during_transfer_ends_it_without_a_failure_report(harness) -> None:
    harness.dispatch("b", prompts(1, seed=10, lengths=(20,))[0])
    harness.run_until(lambda: harness.worker.sender.num_pending() == 1)  # KV on its way
    assert "b" in harness.engine.held  # pinned while the transfer lasts
    harness.worker.abort("b")
    harness.worker.step()  # collects the sender's "aborted" result
    assert harness.router_messages() == []
    assert harness.worker.kv_failures == 0 and harness.worker.kv_bytes == 0
    harness.assert_all_released()


def test_a_worker_waiting_for_acks_sleeps_until_one_comes(tiny_llama) -> None:
    """With nothing to compute and transfers waiting for their acks, the loop (`run`, in a
    thread) waits on the sender's sockets too: it turns about once per 10 ms wait, not every
    2 ms, and an ack ends the wait at once (its blocks released within a few ms, where a
    10 ms wait the ack cannot end would take 5 ms in the median)."""
    from tests.decode.test_worker import FakeRouter

    ctx = zmq.Context()
    router = FakeRouter(ctx)
    engine = make_engine(tiny_llama[0])
    worker = PrefillWorker(engine, router.address, "prefill-t", ctx)
    receiver = KVReceiver(torch.zeros_like(engine.runner.kv_cache), context=ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    dst = list(range(16))
    try:
        router.recv(protocol.Register)
        time.sleep(0.3)
        latencies, rates = [], []
        for i, prompt in enumerate(prompts(5, seed=21, lengths=(40,) * 5)):
            rid = f"r{i}"
            router.send(Prefill(
                request_id=rid, prompt_token_ids=prompt, params=GREEDY,
                decode_worker_id="decode-t", decode_kv_address=receiver.address,
                num_decode_cached_tokens=0, transport="tcp", deadline_s=30.0,
            ))  # fmt: skip
            assert receiver.socket.poll(20000)  # its KV came: the worker waits for the ack
            time.sleep(0.05)
            turns, started = worker.loop_count, time.monotonic()
            time.sleep(0.3)
            rates.append((worker.loop_count - turns) / (time.monotonic() - started))
            assert rid in worker.jobs  # still waiting: the ack is not sent yet
            (got,) = receiver.poll(lambda h: dst[: h.num_blocks])  # writes it and acks
            acked = time.monotonic()
            assert got.ok, got.reason
            while rid in worker.jobs:
                assert time.monotonic() - acked < 5, "the ack was never settled"
                time.sleep(0.0001)
            latencies.append(time.monotonic() - acked)
        latencies.sort()
        rates.sort()
        print(f"ack settled in {', '.join(f'{t * 1e3:.2f}' for t in latencies)} ms; "
              f"turns/s while waiting {', '.join(f'{r:.0f}' for r in rates)}")  # fmt: skip
        assert rates[2] < 150, rates  # the median: a 2 ms wait would turn ~500 times a second
        assert latencies[2] < 0.003, latencies
        assert worker.kv_bytes > 0 and worker.kv_failures == 0
        deadline = time.monotonic() + 10
        while not worker.is_idle() or engine.pool.num_free != engine.pool.num_blocks:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        books = engine.block_books()
        assert books.ok and books.free + books.cached == books.total, books
    finally:
        worker.running = False
        thread.join(10)
        worker.close()
        receiver.close()
        router.sock.close(0)
        ctx.term()


def test_an_ack_ends_the_loops_wait(harness) -> None:
    """The wait itself: asked to wait 2 s with a transfer waiting for its ack, the worker wakes
    when the ack comes (50 ms in), not when the 2 s are up."""
    harness.dispatch("r1", prompts(1, seed=22, lengths=(30,))[0])
    harness.run_until(lambda: harness.receiver.socket.poll(0))  # its KV came, no ack yet
    dst = list(range(16))
    got = []
    acker = threading.Timer(0.05, lambda: got.extend(harness.receiver.poll(blocks_from(dst))))
    started = time.monotonic()
    acker.start()
    harness.worker._wait(2000)
    waited = time.monotonic() - started
    acker.join()
    assert got and got[0].ok
    assert 0.04 < waited < 1.0, waited
    harness.run_until(lambda: not harness.worker.jobs)
    harness.assert_all_released()
