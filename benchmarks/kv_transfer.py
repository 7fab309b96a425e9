"""KV transfer bandwidth: kvtransfer's shm and tcp transports against a plain memory copy.

For the default model's KV layout (30 layers, 3 KV heads, head_dim 64, blocks of 16 tokens),
builds a random kv_cache in each dtype and moves the KV of `--tokens` prompt tokens (scattered
source blocks into scattered destination blocks) to a `KVReceiver` in a separate process, timing
`send` until its `TransferResult` (gather, checksum, transport, the receiver's checksum and
scatter, the ack). The baseline is a plain memory copy of the same bytes, the gathered tensor
copied into a destination allocated and written once beforehand, timed right before each
transfer (so both see the same load on a shared machine). Medians over `--repeats` after one
warm-up transfer; % of memcpy is the median copy time over the median transfer time. Like with
like: the warm-up creates the sender's pooled shm segment and the receiver's mapping of it, and
the receiver's cache exists from the start, so neither the timed transfers nor the timed copies
pay for allocating or page-faulting their destination (the steady state of a running server).

    python benchmarks/kv_transfer.py [--tokens 1024,8192] [--dtypes bfloat16,float32]
        [--transports shm,tcp] [--repeats 5] [--json PATH]

Result: a machine line, then a Markdown table on stdout (transport, tokens, dtype, MB, ms,
GB/s, % of memcpy, send() ms = how long `send` holds the prefill loop, target), then what the
per-block checksums cost one end (`payload.block_checksums` over the payload, best of
`--repeats`: ms, ms per MB, GB/s); progress on stderr; with `--json PATH` the same rows as JSON
(`rows`, `checksums`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.protocol import KVHeader  # noqa: E402
from kvtransfer import KVReceiver, KVSender, kv_layout, payload  # noqa: E402

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16  # SmolLM2-135M
TARGET_SHM_VS_MEMCPY = 0.5
TARGET_TCP_GB_S = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_cache(num_blocks: int, dtype: torch.dtype, random: bool) -> torch.Tensor:
    shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if not random:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def block_ids(num_cache_blocks: int, n: int, seed: int) -> list[int]:
    """n distinct scattered blocks, as a real block table would be."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_cache_blocks, generator=generator)[:n].tolist()


def serve(conn, dtypes: list[str], num_cache_blocks: int) -> None:
    """Receiver process: one KVReceiver per dtype, each writing into scattered blocks."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    receivers = [KVReceiver(make_cache(num_cache_blocks, DTYPES[d], False)) for d in dtypes]
    conn.send_bytes(" ".join(r.address for r in receivers).encode())

    def resolve(header: KVHeader) -> list[int]:
        return block_ids(num_cache_blocks, header.num_blocks, seed=1)

    poller = zmq.Poller()
    for receiver in receivers:
        poller.register(receiver.socket, zmq.POLLIN)
    while not conn.poll():
        ready = dict(poller.poll(100))
        for receiver in receivers:
            if receiver.socket in ready:
                for received in receiver.poll(resolve):
                    if not received.ok:
                        print(f"refused: {received.reason}", file=sys.stderr)
    for receiver in receivers:
        receiver.close()


def time_transfer(sender: KVSender, address: str, transport: str, ids: list[int], rid: str):
    """(seconds until the result, seconds inside send) of one transfer."""
    header = KVHeader(
        request_id=rid,
        start_block=0,
        num_blocks=len(ids),
        nbytes=0,
        transport=transport,
        first_token_id=0,
        **kv_layout(sender.kv_cache),
    )
    start = time.perf_counter()
    sender.send(address, header, ids, deadline_s=60.0)
    sent = time.perf_counter()
    while True:
        results = sender.poll()
        if results:
            break
        time.sleep(0.0002)
    end = time.perf_counter()
    [result] = results
    if not result.ok:
        raise RuntimeError(f"transfer failed: {result.reason}")
    return end - start, sent - start


def checksum_seconds(cache: torch.Tensor, ids: list[int], repeats: int) -> float:
    """Best time of `payload.block_checksums` over the payload of `ids` (what each end pays)."""
    data = payload.as_bytes(payload.gather(cache, torch.tensor(ids)))
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        payload.block_checksums(data, cache, None, len(ids))
        best = min(best, time.perf_counter() - start)
    return best


class Memcpy:
    """The baseline: the gathered blocks copied into a destination that is already faulted in,
    as the shm segment and the receiver's cache are in the timed transfers."""

    def __init__(self, cache: torch.Tensor, ids: list[int]) -> None:
        self.source = payload.gather(cache, torch.tensor(ids))
        self.destination = torch.empty_like(self.source)
        self.destination.copy_(self.source)  # fault every page in before anything is timed

    def seconds(self) -> float:
        start = time.perf_counter()
        self.destination.copy_(self.source)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = args.dtypes.split(",")
    transports = args.transports.split(",")
    max_blocks = max(tokens) // BLOCK_SIZE
    num_cache_blocks = max_blocks + 32

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child, dtypes, num_cache_blocks), daemon=True)
    process.start()
    addresses = dict(zip(dtypes, parent.recv_bytes().decode().split()))

    rows, checksums = [], []
    for dtype in dtypes:
        sender = KVSender(make_cache(num_cache_blocks, DTYPES[dtype], True))
        for n_tokens in tokens:
            ids = block_ids(num_cache_blocks, n_tokens // BLOCK_SIZE, seed=2)
            nbytes = sender.kv_cache[:, :, ids[:1]].nbytes * len(ids)
            memcpy, memcpy_times, transfer_rows = Memcpy(sender.kv_cache, ids), [], []
            crc_s = checksum_seconds(sender.kv_cache, ids, args.repeats)
            checksums.append(dict(tokens=n_tokens, dtype=dtype, nbytes=nbytes, seconds=crc_s))
            for transport in transports:
                print(f"{dtype} {n_tokens} tokens {transport}", file=sys.stderr)
                address = addresses[dtype]
                time_transfer(sender, address, transport, ids, "warmup")
                times = []
                for i in range(args.repeats):
                    # Each transfer right after a baseline copy: both see the same machine.
                    memcpy_times.append(memcpy.seconds())
                    times.append(time_transfer(sender, address, transport, ids, f"r{i}"))
                transfer_rows.append(dict(
                    transport=transport, tokens=n_tokens, dtype=dtype, nbytes=nbytes,
                    seconds=statistics.median(t for t, _ in times),
                    send_seconds=statistics.median(s for _, s in times),
                ))  # fmt: skip
            memcpy_s = statistics.median(memcpy_times)
            for row in [dict(transport="memcpy", tokens=n_tokens, dtype=dtype, nbytes=nbytes,
                             seconds=memcpy_s, send_seconds=None), *transfer_rows]:  # fmt: skip
                rows.append(dict(row, memcpy_seconds=memcpy_s))
        sender.close()
    parent.send_bytes(b"stop")
    process.join(10)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"crc32 by {'zlib-ng' if payload._fast_crc32 else 'zlib'}"
    )
    print()
    print("| transport | tokens | dtype | MB | ms | GB/s | % of memcpy | send() ms | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        gb_s = row["nbytes"] / row["seconds"] / 1e9
        ratio = row["memcpy_seconds"] / row["seconds"]
        row.update(gb_per_s=gb_s, fraction_of_memcpy=ratio)
        if row["transport"] == "shm":
            met = ratio >= TARGET_SHM_VS_MEMCPY
            target = f">= {TARGET_SHM_VS_MEMCPY:.0%} of memcpy: {'met' if met else 'missed'}"
        elif row["transport"] == "tcp":
            met = gb_s >= TARGET_TCP_GB_S
            target = f">= {TARGET_TCP_GB_S:g} GB/s: {'met' if met else 'missed'}"
        else:
            target = "baseline"
        row["target"] = target
        send_ms = "" if row["send_seconds"] is None else f"{row['send_seconds'] * 1e3:.1f}"
        print(
            f"| {row['transport']} | {row['tokens']} | {row['dtype']} | "
            f"{row['nbytes'] / 1e6:.1f} | {row['seconds'] * 1e3:.1f} | {gb_s:.2f} | "
            f"{ratio:.0%} | {send_ms} | {target} |"
        )
    print()
    print("| block checksums of | tokens | dtype | MB | ms | ms per MB | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for row in checksums:
        mb, ms = row["nbytes"] / 1e6, row["seconds"] * 1e3
        row.update(ms_per_mb=ms / mb, gb_per_s=mb / ms)
        print(f"| one end | {row['tokens']} | {row['dtype']} | {mb:.1f} | {ms:.2f} | "
              f"{ms / mb:.3f} | {mb / ms:.2f} |")  # fmt: skip
    if args.json:
        body = {"machine": platform.platform(), "rows": rows, "checksums": checksums}
        args.json.write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    main()
