"""A worker compiles a new structured output on its compiler thread while its streams go on
(common/runtime/worker.py `_compile_first`), against a real control socket.

The model is test_engine_grammar's tiny Llama over SmolLM2's tokenizer; each test gets a fresh
GrammarCompiler whose compile of the test's spec waits on a gate, standing for a large grammar.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import jsonschema
import pytest
import torch
import zmq

from common import protocol
from common.engine.grammar import GrammarCompiler
from common.protocol import Abort, RequestFailed, TokenOutput
from common.sampling_params import SamplingParams, StructuredOutput
from decode.worker import DecodeWorker
from tests.common.engine.test_engine_grammar import JSON, SCHEMA, make_engine, model, prompt
from tests.decode.test_worker import FakeRouter

__all__ = ["model"]  # the fixture, imported for pytest

PLAIN = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class GatedCompiler(GrammarCompiler):
    """Compiles `gated` specs only once `gate` is set; counts the compiles per thread."""

    def __init__(self, tokenizer, vocab_size: int, gated: set[str]) -> None:
        super().__init__(tokenizer, vocab_size=vocab_size)
        self.gate = threading.Event()
        self.gated = gated
        self.threads: list[str] = []

    def _compile(self, so):
        self.threads.append(threading.current_thread().name)
        if so.spec in self.gated:
            assert self.gate.wait(30)
        return super()._compile(so)


@pytest.fixture()
def served(model):
    """(router, worker, compiler): a decode worker on its own thread, serving generate."""
    ctx = zmq.Context()
    router = FakeRouter(ctx)
    engine = make_engine(model, max_num_batched_tokens=256)
    compiler = GatedCompiler(model[2], engine.vocab_size, {JSON.spec, "gated-bad"})
    engine.grammars = compiler
    worker = DecodeWorker(engine, router.address, "decode-g", "tcp://127.0.0.1:*", context=ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    router.recv(protocol.Register)
    yield router, worker, compiler
    compiler.gate.set()
    worker.running = False
    thread.join(10)
    router.sock.close(0)
    ctx.term()


def outputs_of(router: FakeRouter, rid: str, count: int) -> list[TokenOutput]:
    got: list[TokenOutput] = []
    while len(got) < count:
        out = router.recv(TokenOutput)
        if out.request_id == rid:
            got.append(out)
    return got


def test_streams_go_on_while_a_new_grammar_compiles(model, served) -> None:
    router, worker, compiler = served
    steps: list[tuple[bool, int]] = []  # (a compile waiting, the step's torch threads)
    step = worker.step

    def counted_step() -> None:
        steps.append((bool(worker.compiling), torch.get_num_threads()))
        step()

    worker.step = counted_step
    router.send(protocol.Generate("plain", prompt(model), PLAIN))
    outputs_of(router, "plain", 2)  # decoding
    structured = SamplingParams(max_tokens=60, temperature=0.0, structured_output=JSON)
    router.send(protocol.Generate("json", prompt(model), structured))
    # The compile waits on the gate; the other stream keeps getting tokens meanwhile.
    got = outputs_of(router, "plain", 10)
    assert "json" in worker.compiling and not any(o.finished for o in got[:-1])
    beat = worker._heartbeat(next(iter(worker.links.values())))
    # the router sees it waiting, its prompt still to prefill
    assert beat.num_running == 1 and beat.num_waiting == 1
    assert beat.queued_prefill_tokens >= len(prompt(model))
    compiler.gate.set()
    tokens: list[int] = []
    while True:
        out = router.recv(TokenOutput)
        if out.request_id == "json":
            tokens += out.token_ids
            if out.finished:
                break
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(model[2].decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert compiler.threads == ["grammar_0"]  # compiled once, on the compiler thread
    assert not worker.compiling
    # While it compiled, the steps left it a core: one thread fewer than before and after (a
    # step as the compile ends may still see it in `compiling`, done, and run on all of them).
    during = {threads for compiling, threads in steps if compiling}
    alone = {threads for compiling, threads in steps if not compiling}
    assert len(alone) == 1
    own = alone.pop()
    assert (own - 1 if own > 1 else own) in during and during <= {own - 1, own}


STRUCTURED = SamplingParams(max_tokens=20, temperature=0.0, structured_output=JSON)


def send_structured(router, worker, message) -> float:
    """Send a dispatch whose grammar the gated compiler holds; return once the worker has it
    waiting in `compiling` (or at the deadline, which is returned)."""
    router.send(message)
    deadline = time.monotonic() + 10
    while message.request_id not in worker.compiling and time.monotonic() < deadline:
        time.sleep(0.01)
    return deadline


def test_an_abort_while_compiling_drops_the_dispatch(model, served) -> None:
    router, worker, compiler = served
    deadline = send_structured(router, worker, protocol.Generate("gone", prompt(model), STRUCTURED))
    router.send(Abort("gone"))
    while "gone" in worker.compiling and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "gone" not in worker.compiling
    compiler.gate.set()
    # Never started: the next request runs alone and the pool is whole once it ends.
    router.send(protocol.Generate("next", prompt(model), dataclasses.replace(PLAIN, max_tokens=3)))
    outs = outputs_of(router, "next", 1)
    while not outs[-1].finished:
        outs += outputs_of(router, "next", 1)
    assert "gone" not in worker.engine.seqs
    deadline = time.monotonic() + 10
    while worker.engine.pool.num_free != worker.engine.pool.num_blocks:
        assert time.monotonic() < deadline, "blocks still held"
        time.sleep(0.01)


def test_a_grammar_that_fails_to_compile_fails_its_request(model, served) -> None:
    router, worker, compiler = served
    compiler.gate.set()
    bad = StructuredOutput("grammar", "start: <|nosuch|>\n")
    params = SamplingParams(max_tokens=5, temperature=0.0, structured_output=bad)
    router.send(protocol.Generate("bad", prompt(model), params))
    failed = router.recv(RequestFailed)
    assert failed.request_id == "bad" and "nosuch" in failed.reason
    assert "grammar_0" in compiler.threads and not worker.compiling


def test_a_reservation_waiting_on_its_grammar_counts_no_prompt_to_prefill(model, served) -> None:
    router, worker, compiler = served
    send_structured(router, worker, protocol.Reserve("held", prompt(model), STRUCTURED))
    beat = worker._heartbeat(next(iter(worker.links.values())))
    # it waits here, but its prompt is prefilled on a prefill worker, not on this one
    assert beat.num_waiting == 1 and beat.queued_prefill_tokens == 0
    compiler.gate.set()
    assert router.recv(protocol.ReserveReply).request_id == "held"
