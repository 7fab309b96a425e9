"""The KV payload: its layout, checksum, and the copies between a paged cache and a flat buffer.

A payload is the KV of a list of blocks, `kv_cache[:, :, block_ids]`, as one C-order tensor of
shape [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (the layout `KVHeader`
describes). An 8-bit cache (int8 / float8_e4m3fn, common.kernels.kv_quant) ships its float32
scales too: the payload is then the KV bytes followed by `kv_scales[:, :, block_ids]` ([num_layers,
2, num_blocks, block_size, num_kv_heads]), one buffer. The sender gathers it, the receiver checks
it against its own cache and scatters it; both sides checksum it per block (`block_checksums`: a
block's KV and scales of every layer), so a damaged block is found as that block. CRC-32
(zlib.crc32's value; computed by zlib-ng when installed, about four times faster). Used by
`kvtransfer.sender`, `kvtransfer.receiver` and `kvtransfer.cuda_ipc`; nothing here touches a
socket.
"""

from __future__ import annotations

import warnings
import zlib

import torch

from common.kernels import kv_quant
from common.protocol import KVHeader

try:  # the same CRC-32 as zlib.crc32, with carry-less multiply instructions: ~4x faster
    from zlib_ng.zlib_ng import crc32 as _fast_crc32
except ImportError:
    _fast_crc32 = None

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
if kv_quant.FP8 is not None:
    DTYPES["float8_e4m3fn"] = kv_quant.FP8
SCALE_DTYPE = torch.float32  # an 8-bit cache's scales, one per (token, KV head)
LAYOUT_FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16', 'float16', 'int8' or 'float8_e4m3fn': the name headers carry."""
    return str(dtype).removeprefix("torch.")


def kv_layout(kv_cache: torch.Tensor) -> dict[str, int | str]:
    """The KVHeader layout fields of a cache: build headers with `KVHeader(..., **kv_layout(c))`."""
    num_layers, two, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert two == 2, f"kv_cache must be [L, 2, blocks, block, heads, head_dim]: {kv_cache.shape}"
    return dict(
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(kv_cache.dtype),
    )


def layout_mismatch(header: KVHeader, kv_cache: torch.Tensor) -> str:
    """Why the header's layout does not fit this cache, or '' when it does."""
    ours = kv_layout(kv_cache)
    for field in LAYOUT_FIELDS:
        theirs = getattr(header, field)
        if theirs != ours[field]:
            return f"layout mismatch: {field} {theirs!r} != {ours[field]!r}"
    return ""


def payload_shape(header: KVHeader) -> tuple[int, ...]:
    return (
        header.num_layers,
        2,
        header.num_blocks,
        header.block_size,
        header.num_kv_heads,
        header.head_dim,
    )


def payload_nbytes(
    kv_cache: torch.Tensor, num_blocks: int, kv_scales: torch.Tensor | None = None
) -> int:
    """Bytes of the KV of `num_blocks` blocks of this cache (and of their scales, if 8-bit)."""
    kv = kv_cache[:, :, 0].numel() * kv_cache.element_size() * num_blocks
    if kv_scales is None:
        return kv
    return kv + kv_scales[:, :, 0].numel() * kv_scales.element_size() * num_blocks


def block_index(block_ids: list[int], num_blocks: int, device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor; ValueError when one is out of range or repeated."""
    if any(not 0 <= b < num_blocks for b in block_ids):
        raise ValueError(f"block ids out of range [0, {num_blocks}): {block_ids}")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"repeated block ids: {block_ids}")
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def gather(
    kv_cache: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The payload of the indexed blocks (a contiguous copy), written into `out` when given."""
    num_layers, two, num_blocks = kv_cache.shape[:3]
    shape = (num_layers, two, index.numel(), *kv_cache.shape[3:])
    if kv_cache.is_contiguous():
        # As [layers * 2, blocks, block elements] gathered along dim 1: torch's fast path. Dim 2
        # of the 6-d view takes a generic kernel, 4x slower and far worse on a busy CPU.
        rows = kv_cache.view(num_layers * two, num_blocks, kv_cache[0, 0, 0].numel())
        if out is not None and out.device == kv_cache.device:
            torch.index_select(rows, 1, index, out=out.view(rows.shape[0], -1, rows.shape[2]))
            return out
        gathered = torch.index_select(rows, 1, index).view(shape)
    else:
        gathered = kv_cache.index_select(2, index)
    return gathered if out is None else out.copy_(gathered)


def scatter(kv_cache: torch.Tensor, index: torch.Tensor, payload: torch.Tensor) -> None:
    """Write a payload into the indexed blocks of the cache."""
    kv_quant.storage(kv_cache).index_copy_(2, index, kv_quant.storage(payload).to(kv_cache.device))


def gather_payload(
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
    index: torch.Tensor,
    out: memoryview | None = None,
) -> torch.Tensor:
    """The whole payload of the indexed blocks, KV then scales, as one CPU tensor (the cache's
    dtype without scales, else bytes); written into the byte buffer `out` when given."""
    if kv_scales is None and out is None:
        return gather(kv_cache, index).cpu()
    n = index.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    if out is None:
        out = memoryview(bytearray(payload_nbytes(kv_cache, n, kv_scales)))
    kv, scales = _views(out, kv_cache, kv_scales, n)
    gather(kv_quant.storage(kv_cache), index, out=kv)
    if kv_scales is not None:
        gather(kv_scales, index, out=scales)
    return torch.frombuffer(out, dtype=torch.uint8)


def scatter_payload(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, index: torch.Tensor, buffer
) -> None:
    """Write a payload's bytes (KV, then scales for an 8-bit cache) into the indexed blocks."""
    kv, scales = _views(buffer, kv_cache, kv_scales, index.numel())
    scatter(kv_cache, index, kv)
    if kv_scales is not None:
        kv_scales.index_copy_(2, index, scales.to(kv_scales.device))


def _views(
    buffer, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The payload's KV (in the cache's storage type) and scales as tensors over `buffer`."""
    storage = kv_quant.storage(kv_cache)
    kv_shape = (storage.shape[0], 2, num_blocks, *storage.shape[3:])
    kv_bytes = payload_nbytes(kv_cache, num_blocks)
    with warnings.catch_warnings():
        # zmq frames and read-only mmaps are not writable; we only read them.
        warnings.simplefilter("ignore", UserWarning)
        view = memoryview(buffer).cast("B")
        if not kv_bytes:
            return torch.empty(kv_shape, dtype=storage.dtype), (
                None if kv_scales is None else torch.empty(0, dtype=SCALE_DTYPE)
            )
        kv = torch.frombuffer(view[:kv_bytes], dtype=storage.dtype).view(kv_shape)
        if kv_scales is None:
            return kv, None
        scale_shape = (kv_scales.shape[0], 2, num_blocks, *kv_scales.shape[3:])
        scales = torch.frombuffer(view[kv_bytes:], dtype=kv_scales.dtype).view(scale_shape)
    return kv, scales


def assemble_payload(
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
    sources: list[int | torch.Tensor],
    out: memoryview | None = None,
    first: int = 0,
    num_blocks: int | None = None,
) -> torch.Tensor:
    """The payload of blocks from two kinds of source, in order: a block id of the cache, or one
    block's bytes as a KV tier keeps them (`common.engine.kv_tier_store.BlockIO`: its KV rows of
    every layer, K then V, then its scales: a one-block payload). A peer fetch sends blocks of
    its cache and of its tier in one payload. Returns the bytes (a uint8 CPU tensor, over `out`
    when given).

    With `first` and `num_blocks` (and `out`), `sources` are blocks `first`, `first + 1`, ... of
    a payload of `num_blocks` blocks, written into their places: a payload filled in slices."""
    num_total = len(sources) if num_blocks is None else num_blocks
    if not 0 <= first <= first + len(sources) <= num_total:
        raise ValueError(f"blocks {first}..{first + len(sources)} of a {num_total}-block payload")
    if out is None:
        out = memoryview(bytearray(payload_nbytes(kv_cache, num_total, kv_scales)))
    if not len(out):
        return torch.empty(0, dtype=torch.uint8)
    data = torch.frombuffer(out, dtype=torch.uint8)
    if not sources:
        return data
    storage = kv_quant.storage(kv_cache)
    rows = 2 * storage.shape[0]  # (layer, K|V) rows: the payload holds each row's blocks in turn
    cache_rows = storage.view(rows, storage.shape[2], -1)
    kv_piece = cache_rows.shape[2] * storage.element_size()
    kv_bytes = kv_piece * rows * num_total
    here = slice(first, first + len(sources))  # this slice's blocks in every (layer, K|V) row
    dst_kv = data[:kv_bytes].view(rows, num_total, kv_piece)[:, here]
    scale_rows = dst_scales = None
    scale_piece = 0
    if kv_scales is not None:
        scale_rows = kv_scales.view(rows, kv_scales.shape[2], -1)
        scale_piece = scale_rows.shape[2] * kv_scales.element_size()
        dst_scales = data[kv_bytes:].view(rows, num_total, scale_piece)[:, here]
    ids = [(i, s) for i, s in enumerate(sources) if isinstance(s, int)]
    if ids:  # the cache's blocks in one gather (as `gather`: along dim 1 of the row view)
        at = torch.tensor([i for i, _ in ids])
        index = torch.tensor([s for _, s in ids], device=storage.device)
        dst_kv[:, at] = (
            cache_rows.index_select(1, index).cpu().view(torch.uint8).view(rows, -1, kv_piece)
        )
        if dst_scales is not None:
            picked = scale_rows.index_select(1, index).cpu().view(torch.uint8)
            dst_scales[:, at] = picked.view(rows, -1, scale_piece)
    for i, block in enumerate(sources):
        if isinstance(block, int):
            continue
        if block.numel() != rows * (kv_piece + scale_piece):
            raise ValueError(f"a block is {rows * (kv_piece + scale_piece)} bytes, got "
                             f"{block.numel()}")  # fmt: skip
        dst_kv[:, i] = block[: rows * kv_piece].view(rows, kv_piece)
        if dst_scales is not None:
            dst_scales[:, i] = block[rows * kv_piece :].view(rows, scale_piece)
    return data


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def from_bytes(buffer, header: KVHeader) -> torch.Tensor:
    """The payload tensor over a byte buffer (no copy; the buffer must outlive it)."""
    with warnings.catch_warnings():
        # zmq frames and read-only mmaps are not writable; we only read them.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=DTYPES[header.dtype])
    return flat.view(payload_shape(header))


def block_checksums(
    buffer,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
    num_blocks: int,
    blocks: range | None = None,
) -> list[int]:
    """Each block's CRC-32 over its bytes in payload order (`KVHeader.block_checksums`): its K
    then V of layer 0, 1, ..., then, for an 8-bit cache, its K and V scales of each layer the
    same way. `buffer` holds the payload of `num_blocks` blocks of this cache; `blocks`: only
    these (a slice of the payload just filled), else all."""
    view = memoryview(buffer).cast("B")
    rows = 2 * kv_cache.shape[0]  # (layer, K|V) rows, each holding every block's piece in turn
    pieces = [(0, payload_nbytes(kv_cache, 1) // rows)]  # (where the rows start, piece bytes)
    if kv_scales is not None:
        scale_piece = kv_scales[0, 0, 0].numel() * kv_scales.element_size()
        pieces.append((payload_nbytes(kv_cache, num_blocks), scale_piece))
    crc32 = _fast_crc32 or zlib.crc32
    checksums = []
    for block in range(num_blocks) if blocks is None else blocks:
        crc = 0
        for base, size in pieces:
            stride = size * num_blocks
            first = base + block * size
            for start in range(first, first + rows * stride, stride):
                crc = crc32(view[start : start + size], crc)
        checksums.append(crc)
    return checksums
