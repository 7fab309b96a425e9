"""Helpers shared by the kvtransfer tests: small caches, headers, polling, a receiver process."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from common.protocol import KVAck, KVHeader, decode_kv
from kvtransfer import KVReceiver, KVSender, ReceivedKV, TransferResult, kv_layout, payload, shm

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 8, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = [3, 7, 1], [0, 5, 2]


def make_cache(
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    device: str = "cpu",
    num_kv_heads: int = NUM_KV_HEADS,
) -> torch.Tensor:
    """A random cache (seeded), or zeros with seed=None."""
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)


def make_header(
    cache: torch.Tensor, request_id: str = "r0", transport: str = "tcp", num_blocks: int = 3
) -> KVHeader:
    return KVHeader(
        request_id=request_id,
        start_block=0,
        num_blocks=num_blocks,
        nbytes=0,
        transport=transport,
        first_token_id=42,
        first_logprob=-0.5,
        **kv_layout(cache),
    )


def damage_on_the_way(monkeypatch: pytest.MonkeyPatch, block: int, transfers: int = 1) -> None:
    """Make KVSenders flip one byte of payload block `block` (of its last layer's V) right after
    taking the checksums, in the next `transfers` transfers: the byte then travels damaged in the
    real tcp frame or shm segment, as after a bad link or bad memory."""
    from kvtransfer import sender as sender_module

    real = payload.block_checksums
    left = [transfers]

    def checksums_then_flip(buffer, kv_cache, kv_scales, num_blocks: int) -> list[int]:
        checksums = real(buffer, kv_cache, kv_scales, num_blocks)
        if left[0] > 0:
            left[0] -= 1
            rows = 2 * kv_cache.shape[0]
            piece = payload.payload_nbytes(kv_cache, 1) // rows
            where = ((rows - 1) * num_blocks + block) * piece + piece // 2
            memoryview(buffer).cast("B")[where] ^= 0x10
        return checksums

    damaged = SimpleNamespace(**vars(payload))
    damaged.block_checksums = checksums_then_flip
    monkeypatch.setattr(sender_module, "payload", damaged)


def block_bytes(buffer, kv_cache: torch.Tensor, kv_scales, num_blocks: int, block: int) -> bytes:
    """Block `block`'s bytes of a payload in the order its checksum covers them, assembled by
    torch (the reference for payload.block_checksums)."""
    kv, scales = payload._views(buffer, kv_cache, kv_scales, num_blocks)
    parts = [kv[:, :, block].contiguous()]
    if scales is not None:
        parts.append(scales[:, :, block].contiguous())
    return b"".join(bytes(payload.as_bytes(p.view(torch.uint8))) for p in parts)


def poll_until(fn, timeout_s: float = 5.0) -> list:
    """Call fn() until it returns a non-empty list (or the timeout passes); return that list."""
    end = time.monotonic() + timeout_s
    while True:
        out = fn()
        if out or time.monotonic() > end:
            return out
        time.sleep(0.002)


def transfer(
    sender: KVSender,
    receiver: KVReceiver,
    transport: str,
    request_id: str = "r0",
    src: list[int] = SRC_BLOCKS,
    dst: list[int] | None = DST_BLOCKS,
) -> tuple[ReceivedKV, TransferResult]:
    """One send, one receiver poll that resolves to `dst`, one sender result."""
    sender.send(
        receiver.address, make_header(sender.kv_cache, request_id, transport, len(src)), src, 5.0
    )
    received = poll_until(lambda: receiver.poll(lambda h: dst, timeout_ms=20))
    results = poll_until(sender.poll)
    assert len(received) == 1 and len(results) == 1
    assert sender.num_pending() == 0
    return received[0], results[0]


def assert_serves(sender: KVSender, receiver: KVReceiver, transport: str = "tcp") -> None:
    """The receiver still takes a good transfer (after whatever bad one came before)."""
    received, result = transfer(sender, receiver, transport, request_id="good")
    assert received.ok and result.ok, (received.reason, result.reason)
    dst = receiver.kv_cache[:, :, DST_BLOCKS]
    assert torch.equal(dst.cpu(), sender.kv_cache[:, :, SRC_BLOCKS].cpu())


def raw_exchange(
    receiver: KVReceiver, frames: list[bytes], dst: list[int] | None = DST_BLOCKS
) -> tuple[list[ReceivedKV], KVAck | None]:
    """Send hand-made frames from a plain DEALER: what the receiver reported, and its ack."""
    dealer = receiver.context.socket(zmq.DEALER)
    dealer.connect(receiver.address)
    try:
        dealer.send_multipart(frames)
        received = poll_until(lambda: receiver.poll(lambda h: dst, timeout_ms=20), timeout_s=0.5)
        ack = decode_kv(dealer.recv()) if dealer.poll(200 if received else 0) else None
        return received, ack
    finally:
        dealer.close(linger=0)


def own_segments() -> set[str]:
    """Segments this process created and has not unlinked."""
    mine = f"{shm.PREFIX}{os.getpid()}-"
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(mine)}


def mapped_segments() -> set[str]:
    """Segments this process still maps, unlinked or not (their memory is in use until unmapped);
    empty where /proc is missing."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return set()
    return {line.split("/")[-1].split()[0] for line in lines if f"/{shm.PREFIX}" in line}


def serve_in_child(conn, dtype: str, device: str, dst: list[int]) -> None:
    """Receiver process (spawn): take one transfer into blocks `dst` of a zeroed cache, then send
    back the outcome and the raw bytes of those blocks (no pickle: raw byte messages)."""
    cache = make_cache(payload.DTYPES[dtype], seed=None, device=device)
    receiver = KVReceiver(cache)
    conn.send_bytes(receiver.address.encode())
    received = poll_until(lambda: receiver.poll(lambda h: dst, timeout_ms=50), timeout_s=30)
    conn.send_bytes(b"ok" if received and received[0].ok else repr(received).encode())
    conn.send_bytes(bytes(payload.as_bytes(cache[:, :, dst].cpu().contiguous())))
    conn.recv_bytes()  # the parent has its result: safe to go
    receiver.close()


def run_child_transfer(transport: str, dtype: torch.dtype, device: str = "cpu") -> None:
    """Send SRC_BLOCKS to a receiver in a spawned process; check the bytes it wrote and the ack."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    name = payload.dtype_name(dtype)
    process = ctx.Process(target=serve_in_child, args=(child, name, device, DST_BLOCKS))
    process.start()
    sender = KVSender(make_cache(dtype, device=device))
    try:
        assert parent.poll(60), "receiver process did not start"
        address = parent.recv_bytes().decode()
        sender.send(address, make_header(sender.kv_cache, "child", transport), SRC_BLOCKS, 30.0)
        results = poll_until(sender.poll, timeout_s=30)
        assert parent.recv_bytes() == b"ok"
        written = parent.recv_bytes()
        parent.send_bytes(b"bye")
        expected = sender.kv_cache[:, :, SRC_BLOCKS].cpu().contiguous()
        assert written == bytes(payload.as_bytes(expected))
        assert [(r.ok, r.nbytes) for r in results] == [(True, expected.nbytes)]
    finally:
        sender.close()  # the segment stays pooled until here
        process.join(30)
        if process.is_alive():
            process.kill()
    assert not own_segments()
    assert process.exitcode == 0
