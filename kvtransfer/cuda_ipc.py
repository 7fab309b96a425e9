"""The `cuda_ipc` transport: the decode side reads the prefill side's KV cache in place on the GPU.

The sender (`kvtransfer.sender`) exports its whole kv_cache storage once per peer with torch's
own CUDA IPC sharing (`torch.multiprocessing.reductions.reduce_tensor`, which calls
`storage._share_cuda_()`), but puts the result on the wire as msgpack, never pickle. The
receiver (`kvtransfer.receiver`) rebuilds the exporter's cache once per handle with
`rebuild_cuda_tensor` (the same call torch makes when unpickling), keeps it open, and copies the
listed blocks device to device into its own cache.

`KVHeader.ipc_handle` encoding: msgpack of `CudaIpcRef` below, that is a map
{"export": CudaIpcExport, "block_ids": [source block ids, in payload order]}. CudaIpcExport holds
exactly the values `_share_cuda_()` returns (device index, cudaIpcMemHandle bytes, storage size
and offset in the allocation, the producer's ref-counter file name and offset, the
cudaIpcEventHandle bytes and whether to wait on it) plus the tensor's offset, shape, stride and
dtype name. The device index is the exporter's: both processes must see the same GPU numbering
(same CUDA_VISIBLE_DEVICES). No checksums: the bytes never leave the GPUs (header.block_checksums
is empty).
"""

from __future__ import annotations

import os
from typing import Annotated

import msgspec
import torch
from msgspec import Meta

from common.protocol import MAX_KV_BLOCKS, KVHeader
from kvtransfer import payload


class CudaIpcExport(msgspec.Struct, forbid_unknown_fields=True):
    pid: int
    device: int
    handle: bytes | None
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int | None
    event_handle: bytes | None
    event_sync_required: bool | None
    tensor_offset: int
    shape: Annotated[list[int], Meta(max_length=8)]  # a KV cache has 6 dims: checked later
    stride: Annotated[list[int], Meta(max_length=8)]
    dtype: str


class CudaIpcRef(msgspec.Struct, forbid_unknown_fields=True):
    export: CudaIpcExport
    block_ids: Annotated[list[int], Meta(max_length=MAX_KV_BLOCKS)]


_ref_decoder = msgspec.msgpack.Decoder(CudaIpcRef)


class CudaIpcError(Exception):
    """A handle that cannot be opened or does not describe a usable cache."""


def export(kv_cache: torch.Tensor) -> CudaIpcExport:
    """Share the storage of a CUDA kv_cache; call once per peer (each call is one consumer ref)."""
    if not kv_cache.is_cuda:
        raise ValueError("cuda_ipc needs a CUDA kv_cache")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(kv_cache)
    (
        _tensor_cls,
        shape,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return CudaIpcExport(
        pid=os.getpid(),
        device=int(device),
        handle=handle,
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset,
        event_handle=event_handle,
        event_sync_required=event_sync_required,
        tensor_offset=int(tensor_offset),
        shape=list(shape),
        stride=list(stride),
        dtype=payload.dtype_name(dtype),
    )


def encode_ref(exported: CudaIpcExport, block_ids: list[int]) -> bytes:
    """The bytes for `KVHeader.ipc_handle`."""
    return msgspec.msgpack.encode(CudaIpcRef(exported, list(block_ids)))


def decode_ref(data: bytes) -> CudaIpcRef:
    try:
        return _ref_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CudaIpcError(f"bad ipc handle: {exc}") from None


class CudaIpcImporter:
    """The receiver's view of every exporter's cache, each opened once and kept open."""

    def __init__(self) -> None:
        self._opened: dict[tuple[bytes, int], torch.Tensor] = {}

    def source(self, exported: CudaIpcExport) -> torch.Tensor:
        key = (exported.handle or b"", exported.storage_offset_bytes)
        tensor = self._opened.get(key)
        if tensor is None:
            if exported.pid == os.getpid():
                raise CudaIpcError("cuda_ipc between two caches of one process is not supported")
            if exported.dtype not in payload.DTYPES or not exported.handle:
                raise CudaIpcError(f"unusable export: dtype {exported.dtype!r}")
            if not torch.cuda.is_available():
                raise CudaIpcError("cuda_ipc needs CUDA on the receiver")
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            try:
                tensor = rebuild_cuda_tensor(
                    torch.Tensor,
                    torch.Size(exported.shape),
                    tuple(exported.stride),
                    exported.tensor_offset,
                    torch.TypedStorage,
                    payload.DTYPES[exported.dtype],
                    exported.device,
                    exported.handle,
                    exported.storage_size_bytes,
                    exported.storage_offset_bytes,
                    False,
                    exported.ref_counter_handle,
                    exported.ref_counter_offset,
                    exported.event_handle,
                    exported.event_sync_required,
                )
            except RuntimeError as exc:
                raise CudaIpcError(f"cannot open the exporter's cache: {exc}") from None
            self._opened[key] = tensor
        return tensor

    def check(self, ref: CudaIpcRef, header: KVHeader) -> torch.Tensor:
        """The exporter's cache after checking it against the header; CudaIpcError otherwise."""
        exported = ref.export
        if len(exported.shape) != 6 or exported.dtype != header.dtype:
            raise CudaIpcError("exported cache does not match the header")
        layout = exported.shape[:2] + exported.shape[3:]
        wanted = [header.num_layers, 2, header.block_size, header.num_kv_heads, header.head_dim]
        if layout != wanted:
            raise CudaIpcError(f"exported cache shape {exported.shape} does not match the header")
        if len(ref.block_ids) != header.num_blocks:
            raise CudaIpcError(f"{len(ref.block_ids)} source blocks for {header.num_blocks}")
        if any(not 0 <= b < exported.shape[2] for b in ref.block_ids):
            raise CudaIpcError("source block ids out of range")
        return self.source(exported)

    def copy(
        self, source: torch.Tensor, ref: CudaIpcRef, kv_cache: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy the referenced blocks into kv_cache[:, :, dst], finished when this returns."""
        src = torch.tensor(ref.block_ids, dtype=torch.long, device=source.device)
        blocks = source.index_select(2, src)
        payload.scatter(kv_cache, dst, blocks)
        # The sender unpins its blocks on our ack: the copy must be complete before we answer.
        torch.cuda.synchronize(kv_cache.device)

    def close(self) -> None:
        self._opened.clear()
