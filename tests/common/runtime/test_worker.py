"""common/runtime/worker.py's `WorkerBase.send_token_outputs`: a step's outputs leave as one
`TokenBatch` per router, each holding only its own requests' outputs in step order, and a
finished request's tie to its router ends there."""

from __future__ import annotations

from types import SimpleNamespace

from common import protocol
from common.runtime.worker import WorkerBase


def _link() -> SimpleNamespace:
    sent: list = []
    return SimpleNamespace(control=SimpleNamespace(send=sent.append), sent=sent)


def _out(rid: str, finished: bool = False) -> protocol.TokenOutput:
    return protocol.TokenOutput(rid, [1], [], [], finished, "length" if finished else None, 3, 0)


def test_one_token_batch_per_router_with_its_own_requests_in_order() -> None:
    a, b = _link(), _link()
    worker = WorkerBase.__new__(WorkerBase)  # the links and origins only: no engine needed
    worker.links = {"a": a, "b": b}
    worker.origin = {"r1": a, "r2": b, "r3": a, "r4": b}
    outputs = [_out("r1"), _out("r2", finished=True), _out("r3"), _out("r4")]
    worker.send_token_outputs(outputs)
    assert a.sent == [protocol.TokenBatch([outputs[0], outputs[2]])]
    assert b.sent == [protocol.TokenBatch([outputs[1], outputs[3]])]
    assert set(worker.origin) == {"r1", "r3", "r4"}  # r2 finished
    worker.send_token_outputs([])
    assert len(a.sent) == len(b.sent) == 1  # an empty step sends nothing
