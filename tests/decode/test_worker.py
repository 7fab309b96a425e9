"""The decode worker against a real ZeroMQ control socket and real KV transfers.

The test plays the router (a ROUTER socket speaking the real protocol) and the prefill side (an
in-process prefill engine with a real KVSender, or hand-made frames for the fault cases).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import msgspec
import pytest
import torch
import zmq

from common import protocol
from common.prefix_hash import block_keys
from common.protocol import (
    Abort,
    KVHeader,
    RegisterAck,
    RequestFailed,
    Reserve,
    ReserveReply,
    TokenOutput,
)
from common.sampling_params import SamplingParams
from decode.worker import DecodeWorker
from kvtransfer import KVSender, kv_layout
from tests.common.engine.test_engine import GREEDY, make_engine, prompts
from tests.common.engine.test_kv_cache_dtype import agreement
from tests.kvtransfer import damage_on_the_way, poll_until


class FakeRouter:
    """The router's control socket, driven by the test."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.worker_identity = b""
        self.outputs: list[TokenOutput] = []  # of a TokenBatch, not handed out yet

    def recv(self, kind: type, timeout_s: float = 20.0):
        """The next message of `kind` (a step's `TokenBatch` counts as its `TokenOutput`s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if kind is TokenOutput and self.outputs:
                return self.outputs.pop(0)
            if not self.sock.poll(100):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = protocol.decode_control(frame)
            if isinstance(msg, protocol.TokenBatch):
                self.outputs += msg.outputs
                continue
            if isinstance(msg, protocol.Register):
                self.worker_identity = identity
                self.send(RegisterAck(accepted=True))
            if isinstance(msg, kind):
                return msg
        raise TimeoutError(f"no {kind.__name__} from the worker")

    def send(self, msg) -> None:
        self.sock.send_multipart([self.worker_identity, protocol.encode(msg)])


@pytest.fixture()
def cluster(tiny_llama):
    hf_model, _ = tiny_llama
    ctx = zmq.Context()
    router = FakeRouter(ctx)
    decode_engine = make_engine(hf_model)
    worker = DecodeWorker(
        decode_engine, router.address, "decode-t", "tcp://127.0.0.1:*", context=ctx
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    router.recv(protocol.Register)
    prefill_engine = make_engine(hf_model)
    sender = KVSender(prefill_engine.runner.kv_cache, context=ctx)
    yield router, worker, prefill_engine, sender
    worker.running = False
    thread.join(10)
    sender.close()
    router.sock.close(0)
    ctx.term()


def prefill(engine, rid: str, prompt: list[int]):
    engine.add_request(rid, prompt, dataclasses.replace(GREEDY, max_tokens=1), hold_blocks=True)
    while rid not in engine.held:
        engine.step()
    return engine.held[rid]


def header_for(engine, rid: str, seq, transport: str = "tcp") -> KVHeader:
    return KVHeader(
        request_id=rid,
        start_block=0,
        num_blocks=len(seq.block_table),
        **kv_layout(engine.runner.kv_cache),
        nbytes=0,
        transport=transport,
        first_token_id=seq.output_token_ids[0],
    )


def reserve(router: FakeRouter, rid: str, prompt: list[int]) -> None:
    router.send(Reserve(request_id=rid, prompt_token_ids=prompt, params=GREEDY))
    reply = router.recv(ReserveReply)
    assert reply.request_id == rid and reply.ok


def wait_free(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.pool.num_free != engine.pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.pool.num_free == engine.pool.num_blocks


def books_clear(router: FakeRouter, timeout_s: float = 10.0) -> protocol.BlockBooksReply:
    """Ask the worker (over the control socket) for its block books until nothing is running,
    reserved or held; the books must balance every time."""
    deadline = time.monotonic() + timeout_s
    query_id = 0
    while True:
        query_id += 1
        router.send(protocol.BlockBooksQuery(query_id))
        books = router.recv(protocol.BlockBooksReply)
        while books.query_id != query_id:
            books = router.recv(protocol.BlockBooksReply)
        assert books.worker_id == "decode-t" and not books.errors, books
        assert books.free + books.cached + books.running + books.reserved + books.held == (
            books.total
        )
        if books.running == books.reserved == books.held == 0:
            return books
        assert time.monotonic() < deadline, f"blocks still in use: {books}"
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_kv_byte_flipped_on_the_way_is_recomputed_here_and_the_worker_keeps_serving(
    cluster, tiny_llama, transport, monkeypatch
):
    router, worker, prefill_engine, sender = cluster
    bad, good = prompts(2, seed=9, lengths=(20, 27))
    expected = make_engine(tiny_llama[0]).generate([bad, good], GREEDY)
    # 1. one byte of block 1 flips after the sender took the checksums: the real tcp frame or
    # shm segment carries it to the decode worker
    reserve(router, "bad", bad)
    seq = prefill(prefill_engine, "bad", bad)
    damage_on_the_way(monkeypatch, block=1)
    header = header_for(prefill_engine, "bad", seq, transport)
    sender.send(worker.kv_address, header, seq.block_table, 10.0)
    [result] = poll_until(sender.poll, timeout_s=10)
    assert not result.ok and result.recompute, result
    assert "checksum mismatch in block 1 (0x" in result.reason
    assert result.reason.endswith(f"of {len(seq.block_table)}")
    # the decode worker prefills it itself: the request goes on, with the engine's tokens
    tokens: list[int] = []
    while True:
        out = router.recv(TokenOutput)
        assert out.request_id == "bad"
        tokens += out.token_ids
        if out.finished:
            break
    assert tokens == expected[0].output_token_ids
    assert worker.counters()["kv_transfer_recomputed_total"] == 1
    prefill_engine.release("bad")
    books_clear(router)
    # 2. the next request goes through and decodes the same tokens as one engine alone
    reserve(router, "good", good)
    seq = prefill(prefill_engine, "good", good)
    header = header_for(prefill_engine, "good", seq, transport)
    sender.send(worker.kv_address, header, seq.block_table, 10.0)
    tokens: list[int] = []
    while True:
        out = router.recv(TokenOutput)
        tokens += out.token_ids
        if out.finished:
            break
    assert tokens == expected[1].output_token_ids
    results = []
    while not results:
        results = sender.poll()
    assert results[0].ok
    prefill_engine.release("good")
    assert books_clear(router).cached > 0  # the good prompt's full blocks stay reusable
    wait_free(prefill_engine)


def test_abort_during_transfer_frees_both_sides(cluster):
    router, worker, prefill_engine, sender = cluster
    p = prompts(1, seed=10, lengths=(33,))[0]
    reserve(router, "gone", p)
    seq = prefill(prefill_engine, "gone", p)
    router.send(Abort(request_id="gone"))  # the client left while the KV is on its way
    time.sleep(0.3)
    sender.send(worker.kv_address, header_for(prefill_engine, "gone", seq), seq.block_table, 10.0)
    results = []
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        results = sender.poll()
        time.sleep(0.02)
    assert results and not results[0].ok  # refused: the reservation is gone
    prefill_engine.release("gone")
    books_clear(router)
    wait_free(prefill_engine)


def test_worker_reports_kv_events_and_snapshots_on_request(cluster) -> None:
    router, worker, _, _ = cluster
    first = router.recv(protocol.KVEvents)  # right after registering: a full snapshot
    assert first.reset and first.seq == 0 and first.worker_id == "decode-t"
    prompt = prompts(7)[6][:20]  # 2 full blocks of 8
    router.send(protocol.Generate("g1", prompt, dataclasses.replace(GREEDY, max_tokens=2)))
    stored: list[bytes] = []
    seq = first.seq
    while len(stored) < 2:
        ev = router.recv(protocol.KVEvents)
        assert ev.seq == seq + 1 and not ev.reset  # numbered without gaps
        seq = ev.seq
        stored += ev.stored
    keys = block_keys(prompt, 8, worker.engine.block_manager.salt)
    assert stored[:2] == keys
    router.send(protocol.KVResync("test"))
    snap = router.recv(protocol.KVEvents)
    assert snap.reset and snap.seq == seq + 1 and set(keys) <= set(snap.stored)
    # Forgotten by the router: it registers again, and a snapshot follows.
    router.send(RegisterAck(accepted=False, reason=protocol.REREGISTER_REASON))
    router.recv(protocol.Register)
    again = router.recv(protocol.KVEvents)
    assert again.reset and set(keys) <= set(again.stored)


def test_a_reservation_lives_as_long_as_the_deadline_its_reserve_carries(cluster) -> None:
    router, worker, _, _ = cluster
    prompt = prompts(1)[0]
    router.send(Reserve("r-late", prompt, GREEDY, deadline_s=0.5))
    assert router.recv(ReserveReply).ok
    sent = time.monotonic()
    failed = router.recv(RequestFailed, timeout_s=10)
    assert failed.request_id == "r-late" and "in time" in failed.reason
    assert time.monotonic() - sent < 5  # the router's deadline, not the old fixed 120 s
    wait_free(worker.engine)


def test_registration_and_heartbeats_carry_what_the_router_checks(cluster) -> None:
    router, worker, _, _ = cluster
    registration = worker.registration()
    layout = kv_layout(worker.engine.runner.kv_cache)
    for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"):
        assert getattr(registration, field) == layout[field], field
    assert registration.dtype == "float32"
    # heartbeats come from the random identity the registration names, and count loop turns
    counts = []
    deadline = time.monotonic() + 10
    while len(counts) < 2 and time.monotonic() < deadline:
        if router.sock.poll(100):
            identity, frame = router.sock.recv_multipart()
            msg = protocol.decode_control(frame)
            if isinstance(msg, protocol.Heartbeat):
                assert identity == registration.heartbeat_identity
                counts.append(msg.loop_count)
    assert len(counts) == 2 and 0 < counts[0] < counts[1]  # an idle loop turns too


def test_with_the_cluster_secret_only_members_can_push_kv(tiny_llama) -> None:
    from common.runtime.auth import ClusterKeys
    from kvtransfer import KVReceiver

    hf_model, _ = tiny_llama
    ctx = zmq.Context()
    keys = ClusterKeys.from_secret(b"s3cret")
    decode_engine, prefill_engine = make_engine(hf_model), make_engine(hf_model)
    receiver = KVReceiver(decode_engine.runner.kv_cache, context=ctx, keys=keys)
    outsider = KVSender(prefill_engine.runner.kv_cache, context=ctx)
    member = KVSender(prefill_engine.runner.kv_cache, context=ctx, keys=keys)
    try:
        seq = prefill(prefill_engine, "r", prompts(1)[0])
        blocks = list(range(len(seq.block_table)))

        def push(sender: KVSender, rid: str, wait_s: float) -> tuple[list, list]:
            header = msgspec.structs.replace(header_for(prefill_engine, "r", seq), request_id=rid)
            sender.send(receiver.address, header, seq.block_table, deadline_s=wait_s)
            arrived, results = [], []
            deadline = time.monotonic() + wait_s + 1.0
            while not results and time.monotonic() < deadline:
                arrived += receiver.poll(lambda h: blocks, timeout_ms=20)
                results += sender.poll()
            return arrived, results

        arrived, results = push(outsider, "from-outsider", 1.0)
        assert arrived == [] and [r.ok for r in results] == [False]  # never got through
        arrived, results = push(member, "from-member", 10.0)
        assert [a.ok for a in arrived] == [True] and [r.ok for r in results] == [True]
    finally:
        outsider.close()
        member.close()
        receiver.close()
        ctx.term()


def test_a_worker_whose_loop_is_stuck_with_work_is_declared_dead(tiny_llama) -> None:
    """Its heartbeat thread goes on beating; the router goes by the loop's turn count."""
    from tests.router.fake_worker import RouterThread

    hf_model, _ = tiny_llama
    config = dict(model="tiny", colocated=True, heartbeat_timeout_s=30, worker_stall_timeout_s=1.5)
    with RouterThread(**config) as router:
        ctx = zmq.Context()
        worker = DecodeWorker(
            make_engine(hf_model), router.control, "decode-s", "tcp://127.0.0.1:*", context=ctx
        )
        stuck, release = threading.Event(), threading.Event()
        real_step = worker.step

        def step() -> None:
            if stuck.is_set():
                release.wait(30)  # a main loop caught in something that never returns
            real_step()

        worker.step = step
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        registry = router.server.registry

        def wait(condition, timeout_s: float) -> float:
            start = time.monotonic()
            while not condition():
                assert time.monotonic() - start < timeout_s
                time.sleep(0.05)
            return time.monotonic() - start

        try:
            wait(lambda: registry.get("decode-s") is not None, 10)
            stuck.set()
            time.sleep(0.2)  # the loop now hangs in `step`: the engine is the test's to touch
            assert worker.engine.reserve("r", prompts(1)[0], GREEDY) is not None  # work to do
            took = wait(lambda: registry.get("decode-s") is None, 10)
            assert took < 1.5 + 2 * protocol.HEARTBEAT_INTERVAL_S + 1.0
            assert worker.heartbeat.is_alive()  # the beats went on: the stall is what counted
            worker.abort("r")
            stuck.clear()
            release.set()  # unstuck: the router asks it to register again, and takes it back
            wait(lambda: registry.get("decode-s") is not None, 10)
        finally:
            release.set()
            worker.running = False
            thread.join(10)
            ctx.term()


def test_a_worker_in_a_long_step_is_not_declared_dead(tiny_llama) -> None:
    """A step longer than the stall timeout whose layers keep running (a long prefill on a slow,
    busy CPU) is progress: the heartbeat's count includes the decoder layers run.

    Timings: beats come every HEARTBEAT_INTERVAL_S (1 s), a layer every 2.5 s, so the router sees
    progress at least every 3.5 s (< the 3.75 s stall timeout), while the one 5 s step is longer
    than timeout + interval: a count of loop turns alone would have stood still long enough."""
    from tests.router.fake_worker import RouterThread

    hf_model, _ = tiny_llama
    stall_s, layer_s = 3.75, 2.5
    config = dict(
        model="tiny", colocated=True, heartbeat_timeout_s=30, worker_stall_timeout_s=stall_s
    )
    with RouterThread(**config) as router:
        ctx = zmq.Context()
        worker = DecodeWorker(
            make_engine(hf_model), router.control, "decode-l", "tcp://127.0.0.1:*", context=ctx
        )
        for layer in worker.engine.runner.model.layers:  # the tiny model's 2 layers
            real_forward = layer.forward

            def forward(*args, _real=real_forward, **kwargs):
                time.sleep(layer_s)
                return _real(*args, **kwargs)

            layer.forward = forward
        steps: list[float] = []
        real_step = worker.step

        def step() -> None:
            start = time.monotonic()
            real_step()
            if time.monotonic() - start > 1.0:
                steps.append(time.monotonic() - start)

        worker.step = step
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        worker.engine.add_request("long", prompts(1)[0], params)  # stepped once registered
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        registry = router.server.registry
        try:
            start = time.monotonic()
            while registry.get("decode-l") is None:
                assert time.monotonic() - start < 10
                time.sleep(0.05)
            while not steps:  # the one long step
                assert registry.get("decode-l") is not None, "a slow step was taken for a stall"
                assert time.monotonic() - start < 30
                time.sleep(0.1)
            assert steps[0] > stall_s + protocol.HEARTBEAT_INTERVAL_S
            assert registry.get("decode-l") is not None
        finally:
            worker.running = False
            thread.join(10)
            worker.close()
            ctx.term()


EIGHT_BIT_CASES = [("int8", "tcp", False), ("int8", "shm", True)]
if hasattr(torch, "float8_e4m3fn"):
    EIGHT_BIT_CASES += [("fp8", "tcp", False), ("fp8", "shm", True)]
NGRAM = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
             speculative_disable_by_batch_size=0, speculative_adaptive=False)  # fmt: skip


@pytest.mark.parametrize(("kv_dtype", "transport", "spec"), EIGHT_BIT_CASES)
def test_8bit_kv_travels_with_its_scales(tiny_llama, kv_dtype, transport, spec) -> None:
    """1P1D with --kv-cache-dtype int8|fp8 on both (the decode worker speculating with ngram in
    half the cases): the blocks and their scales cross over kvtransfer and the decode worker
    continues with exactly one 8-bit engine's tokens. Against the 32-bit KV reference the output
    keeps the first token (computed from unrounded K/V) and, on this random tiny model whose
    logits are near ties, the agreement measured for a single engine
    (test_kv_cache_dtype.test_greedy_agrees_with_float_kv: int8 >= 0.8, fp8 >= 0.2)."""
    hf_model, _ = tiny_llama
    spec_args = NGRAM if spec else {}
    ctx = zmq.Context()
    router = FakeRouter(ctx)
    decode_engine = make_engine(hf_model, kv_cache_dtype=kv_dtype, **spec_args)
    worker = DecodeWorker(
        decode_engine, router.address, "decode-t", "tcp://127.0.0.1:*", context=ctx
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    prefill_engine = make_engine(hf_model, kv_cache_dtype=kv_dtype)
    runner = prefill_engine.runner
    sender = KVSender(runner.kv_cache, context=ctx, kv_scales=runner.kv_scales)
    try:
        registered = router.recv(protocol.Register).dtype
        assert registered == {"int8": "int8", "fp8": "float8_e4m3fn"}[kv_dtype]
        # a prompt that repeats itself gives ngram drafts to verify
        p = [5, 6, 7, 8] * 7 + [5] if spec else prompts(1, seed=11, lengths=(29,))[0]
        single = make_engine(hf_model, kv_cache_dtype=kv_dtype, **spec_args)
        expected = single.generate([p], GREEDY)[0]
        reference = make_engine(hf_model).generate([p], GREEDY)[0].output_token_ids
        reserve(router, "q", p)
        seq = prefill(prefill_engine, "q", p)
        header = header_for(prefill_engine, "q", seq, transport)
        sender.send(worker.kv_address, header, seq.block_table, 10.0)
        tokens: list[int] = []
        while True:
            out = router.recv(TokenOutput)
            tokens += out.token_ids
            if out.finished:
                break
        assert tokens == expected.output_token_ids
        assert tokens[0] == reference[0]
        assert agreement([reference], [tokens]) >= (0.8 if kv_dtype == "int8" else 0.2)
        if spec:
            assert decode_engine.num_draft_tokens > 0  # it did verify drafts
        results = []
        while not results:
            results = sender.poll()
        blocks = len(seq.block_table)
        nbytes = runner.kv_cache[:, :, :blocks].nbytes + runner.kv_scales[:, :, :blocks].nbytes
        assert results[0].ok and results[0].nbytes == nbytes
        prefill_engine.release("q")
        books_clear(router)
        wait_free(prefill_engine)
    finally:
        worker.running = False
        thread.join(10)
        sender.close()
        router.sock.close(0)
        ctx.term()


def test_an_ack_to_the_workers_own_sender_ends_the_loops_wait(tiny_llama) -> None:
    """`WorkerBase._wait` polls the sockets the worker's sender waits on for acks (a decode
    worker's sender answers peers' fetches): asked to wait 2 s with a transfer of its own waiting
    for its ack, the worker wakes when the ack comes (50 ms in), not when the 2 s are up; with
    nothing in flight the wait runs its length."""
    from kvtransfer import KVReceiver

    ctx = zmq.Context()
    router = FakeRouter(ctx)
    engine = make_engine(tiny_llama[0])
    worker = DecodeWorker(engine, router.address, "decode-t", "tcp://127.0.0.1:*", context=ctx)
    peer = KVReceiver(torch.zeros_like(engine.runner.kv_cache), context=ctx)
    try:
        started = time.monotonic()
        worker._wait(100)
        assert time.monotonic() - started >= 0.09  # nothing to wake it
        seq = prefill(engine, "answer", prompts(1, seed=23, lengths=(30,))[0])
        worker.sender.send(peer.address, header_for(engine, "answer", seq), seq.block_table, 10.0)
        assert worker.sender.ack_sockets()  # in flight: its ack will come on that socket
        assert peer.socket.poll(10000)  # the KV came; not acked yet
        dst = list(range(len(seq.block_table)))
        got: list = []
        acker = threading.Timer(0.05, lambda: got.extend(peer.poll(lambda h: dst[: h.num_blocks])))
        started = time.monotonic()
        acker.start()
        worker._wait(2000)
        waited = time.monotonic() - started
        acker.join()
        assert got and got[0].ok, got
        assert 0.04 < waited < 1.0, waited
        (result,) = poll_until(worker.sender.poll)
        assert result.ok and result.request_id == "answer"
        assert not worker.sender.ack_sockets()  # settled: nothing left to wait on
        engine.release("answer")
        assert engine.pool.num_free == engine.pool.num_blocks
        assert engine.block_books().ok
    finally:
        worker.close()
        peer.close()
        router.sock.close(0)
        ctx.term()


def test_a_worker_that_lends_cores_hands_them_back_between_layers(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    """With a core ledger the model's `between_layers` is the lender's `give_back` (a long
    prefill step hands a lender's cores back at the next layer: common.runtime.cores); closing
    the worker unhooks it before the ledger goes."""
    from common.runtime import cores

    ledger = tmp_path / "cores"
    cores.create_ledger(ledger, total_cores=2, slots=2)
    monkeypatch.setenv(cores.LEDGER_ENV, str(ledger))
    ctx = zmq.Context()
    router = FakeRouter(ctx)
    engine = make_engine(tiny_llama[0])
    worker = DecodeWorker(engine, router.address, "decode-l", "tcp://127.0.0.1:*", context=ctx)
    try:
        assert worker.cores is not None
        assert engine.runner.model.between_layers == worker.cores.give_back
    finally:
        worker.close()
        router.sock.close(0)
        ctx.term()
    assert engine.runner.model.between_layers is None and worker.cores is None
