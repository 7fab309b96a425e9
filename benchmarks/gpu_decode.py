"""GPU decode-step benchmark: eager vs CUDA-graph replay, and the Triton paged attention vs SDPA.

Needs CUDA (exits with a message otherwise); `scripts/gpu_check.sh` runs it after the CUDA tests.
Model: a random-weight Llama with TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV
heads, MLP 5632, vocabulary 32000) in bfloat16, built directly (no weights to load), with the
Triton attention backend. Each sequence has `--context` cached tokens.

1. Decode step (forward + LM head, one token per sequence) at batch 1, 8 and 32: eager, then a
   replay of the `DecodeGraphs` capture; median of `--iters` timed steps after warm-up.
2. Attention alone (decode, one query per sequence, GQA): `paged_attention_triton` over the block
   tables vs torch `scaled_dot_product_attention` over dense, contiguous K/V (what the paged kernel
   competes with when there is no paging), median of `--iters`.

    python benchmarks/gpu_decode.py [--context 512] [--iters 50] [--batches 1,8,32]

Prints two Markdown tables. A few minutes on one GPU (most of it Triton compiling the kernels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kernels.attention import AttentionMetadata  # noqa: E402
from common.model.cuda_graph import DecodeGraphs  # noqa: E402
from common.model.llama import CausalLM  # noqa: E402

BLOCK = 16


def tinyllama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip


def build(cfg, max_batch: int, context: int) -> tuple[CausalLM, torch.Tensor]:
    model = CausalLM(cfg, max_positions=cfg.max_position_embeddings)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_attention_backend("triton")
    model.rotary.to_device(torch.device("cuda"))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    blocks_per_seq = (context + 1 + BLOCK - 1) // BLOCK
    cache = torch.randn(
        cfg.num_hidden_layers, 2, 1 + max_batch * blocks_per_seq, BLOCK,
        cfg.num_key_value_heads, head_dim, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    for i, layer in enumerate(model.layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = cache[i, 0], cache[i, 1]
    return model, cache


def decode_inputs(batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One new token per sequence at position `context`, sequence i on its own blocks."""
    blocks_per_seq = (context + 1 + BLOCK - 1) // BLOCK
    tables = torch.tensor(
        [[1 + i * blocks_per_seq + b for b in range(blocks_per_seq)] for i in range(batch)],
        dtype=torch.int32,
    )
    slots = tables[:, context // BLOCK].long() * BLOCK + context % BLOCK
    meta = AttentionMetadata(
        slot_mapping=slots.cuda(),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context + 1] * batch,
    )
    ids = torch.randint(0, 32000, (batch,), device="cuda")
    pos = torch.full((batch,), context, dtype=torch.long, device="cuda")
    return ids, pos, meta


def eager_step(model: CausalLM, ids, pos, meta) -> torch.Tensor:
    return model.compute_logits(model(ids, pos, meta))


def median_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


@torch.inference_mode()
def bench_steps(args: argparse.Namespace) -> list[tuple[int, float, float]]:
    cfg = tinyllama_config()
    batches = [int(b) for b in args.batches.split(",")]
    model, _ = build(cfg, max(batches), args.context)
    graphs = DecodeGraphs(
        model, max_batch=max(batches), query_len=1, max_model_len=cfg.max_position_embeddings,
        block_size=BLOCK, device=torch.device("cuda"),
    )  # fmt: skip
    t0 = time.perf_counter()
    graphs.capture()
    print(f"captured {len(graphs.sizes)} graphs in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for b in batches:
        ids, pos, meta = decode_inputs(b, args.context)
        eager = median_ms(partial(eager_step, model, ids, pos, meta), args.iters)
        graph = median_ms(partial(graphs.run, ids, pos, meta), args.iters)
        rows.append((b, eager, graph))
        print(f"batch {b}: eager {eager:.2f} ms, graph {graph:.2f} ms", flush=True)
    return rows


@torch.inference_mode()
def bench_attention(args: argparse.Namespace) -> list[tuple[int, int, float, float]]:
    import torch.nn.functional as F

    from common.kernels.triton_attention import paged_attention_triton

    heads, kv_heads, head_dim = 32, 4, 64
    rows = []
    for batch in (8, 32):
        for ctx in (args.context, 4 * args.context):
            blocks_per_seq = (ctx + BLOCK - 1) // BLOCK
            n_blocks = 1 + batch * blocks_per_seq
            k_cache = torch.randn(n_blocks, BLOCK, kv_heads, head_dim, dtype=torch.bfloat16,
                                  device="cuda")  # fmt: skip
            v_cache = torch.randn_like(k_cache)
            tables = torch.arange(1, n_blocks, dtype=torch.int32, device="cuda").view(batch, -1)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(batch, dtype=torch.long, device="cuda"),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
                block_tables=tables,
                query_lens_cpu=[1] * batch,
                seq_lens_cpu=[ctx] * batch,
            )
            q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
            scale = head_dim**-0.5
            paged = median_ms(
                partial(paged_attention_triton, q, k_cache, v_cache, meta, scale), args.iters
            )
            # Dense, contiguous K/V per sequence (GQA heads expanded), as SDPA wants them.
            k = k_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
            v = v_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
            k = k.repeat_interleave(heads // kv_heads, dim=1).contiguous()
            v = v.repeat_interleave(heads // kv_heads, dim=1).contiguous()
            q4 = q.unsqueeze(2)
            sdpa = median_ms(
                partial(F.scaled_dot_product_attention, q4, k, v, scale=scale), args.iters
            )
            rows.append((batch, ctx, paged * 1000, sdpa * 1000))
            print(f"attention b={batch} ctx={ctx}: triton {paged * 1000:.0f} us, "
                  f"sdpa {sdpa * 1000:.0f} us", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batches", default="1,8,32")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device; nothing to measure")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    steps = bench_steps(args)
    attention = bench_attention(args)
    print(f"\nDecode step, random-weight TinyLlama-1.1B shape, bf16, context {args.context}:\n")
    print("| batch | eager ms | CUDA graph ms | speedup |")
    print("|---:|---:|---:|---:|")
    for b, eager, graph in steps:
        print(f"| {b} | {eager:.2f} | {graph:.2f} | {eager / graph:.2f}x |")
    print("\nDecode attention (32 q heads, 4 KV heads, head_dim 64, bf16):\n")
    print("| batch | context | Triton paged us | SDPA dense us | paged / dense |")
    print("|---:|---:|---:|---:|---:|")
    for b, ctx, paged, sdpa in attention:
        print(f"| {b} | {ctx} | {paged:.0f} | {sdpa:.0f} | {paged / sdpa:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
