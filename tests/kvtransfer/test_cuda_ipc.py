"""cuda_ipc transport (kvtransfer.cuda_ipc): the decode process copies blocks straight out of the
prefill process's CUDA cache. The GPU tests need CUDA and two processes; the handle-parsing test
runs anywhere."""

from __future__ import annotations

import pytest
import torch

from common.protocol import encode
from kvtransfer import KVReceiver, KVSender, cuda_ipc
from tests.kvtransfer import (
    DST_BLOCKS,
    SRC_BLOCKS,
    make_cache,
    make_header,
    raw_exchange,
    run_child_transfer,
    transfer,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bad_handles_are_refused():
    """A malformed or unusable handle is refused like any bad transfer (on CPU: no CUDA)."""
    cache = make_cache(torch.float32, seed=None)
    receiver = KVReceiver(cache)
    try:
        header = make_header(cache, "ipc", "cuda_ipc")
        header.nbytes = cache[:, :, SRC_BLOCKS].nbytes
        for handle in [b"", b"junk", b"\x81\xa6export\xc0"]:
            header.ipc_handle = handle
            [received], ack = raw_exchange(receiver, [encode(header)])
            assert not received.ok and not ack.ok and "bad ipc handle" in ack.reason
        fake = cuda_ipc.CudaIpcExport(
            pid=1,
            device=0,
            handle=b"\x00" * 64,
            storage_size_bytes=cache.nbytes,
            storage_offset_bytes=0,
            ref_counter_handle=b"/nonexistent",
            ref_counter_offset=0,
            event_handle=b"\x00" * 64,
            event_sync_required=False,
            tensor_offset=0,
            shape=list(cache.shape),
            stride=list(cache.stride()),
            dtype="float32",
        )
        header.ipc_handle = cuda_ipc.encode_ref(fake, SRC_BLOCKS)
        [received], ack = raw_exchange(receiver, [encode(header)])
        assert not received.ok and not ack.ok
        header.ipc_handle = cuda_ipc.encode_ref(fake, [0, 1, 999])
        [received], ack = raw_exchange(receiver, [encode(header)])
        assert not ack.ok and "out of range" in ack.reason
        assert not cache.any()
    finally:
        receiver.close()


@needs_cuda
@pytest.mark.e2e  # spawns the receiver process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ipc_between_processes(dtype):
    run_child_transfer("cuda_ipc", dtype, device="cuda")


@needs_cuda
def test_cuda_ipc_export_round_trips_without_pickle():
    cache = make_cache(torch.bfloat16, device="cuda")
    exported = cuda_ipc.export(cache)
    ref = cuda_ipc.decode_ref(cuda_ipc.encode_ref(exported, SRC_BLOCKS))
    assert ref.export == exported and ref.block_ids == SRC_BLOCKS
    assert exported.shape == list(cache.shape) and exported.dtype == "bfloat16"
    assert exported.handle and exported.storage_size_bytes >= cache.nbytes


@needs_cuda
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_host_transports_with_cuda_caches(transport):
    sender = KVSender(make_cache(torch.bfloat16, device="cuda"))
    receiver = KVReceiver(make_cache(torch.bfloat16, seed=None, device="cuda"))
    try:
        received, result = transfer(sender, receiver, transport)
        assert received.ok and result.ok
        src = sender.kv_cache[:, :, SRC_BLOCKS]
        assert torch.equal(receiver.kv_cache[:, :, DST_BLOCKS], src)
    finally:
        sender.close()
        receiver.close()
