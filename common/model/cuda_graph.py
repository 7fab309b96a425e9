"""CUDA graphs for the decode step: capture once per padded batch size, replay every step.

Owns the static input buffers (token ids, positions, KV slots, query offsets, sequence lengths,
block tables), one captured graph per batch size in `capture_sizes` (1, 2, 4, 8, then multiples
of 8 up to the flag), and `run`, which copies a step's real inputs into the buffers, pads the batch
to the next captured size and replays. Every sequence of a graph step has the same number of query
tokens: 1 for plain decode, k+1 when speculative decoding verifies k drafted tokens. Anything else
(prefill chunks, ragged query lengths, more sequences than the largest size) runs eagerly.

Padding rows write their K/V nowhere (slot -1, which the Triton kernel skips) and attend only to
their own `query_len` positions of whatever block 0 holds; their logits are dropped. The attention
kernels take their grid from the metadata's host-side lengths, so capture uses the longest
possible sequence (`max_model_len`) and the kernels read each row's real length from the device
tensor at replay.

With `capture=False` nothing is captured: `run` calls the model eagerly on the same padded static
buffers. The CPU tests use it (with `pad_slot` set to a scratch slot, since the CPU path does not
skip negative slots) to check the padding and buffer logic against a plain eager forward; the
CUDA tests compare real replays. Used by `common.model.model_runner`.
"""

from __future__ import annotations

import logging
import math

import torch

from common.kernels.attention import AttentionMetadata
from common.model.llama import CausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch` (which is always included)."""
    if max_batch < 1:
        return []
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured forwards (hidden states -> logits) for `query_len` tokens per sequence."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_batch: int,
        query_len: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
        pad_slot: int = -1,
    ) -> None:
        if query_len < 1:
            raise ValueError("query_len must be >= 1")
        self.model = model
        self.query_len = query_len
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.capture_enabled = capture
        self.pad_slot = pad_slot
        b, q = self.sizes[-1], query_len
        max_blocks = math.ceil(max_model_len / block_size)
        self.input_ids = torch.zeros(b * q, dtype=torch.long, device=device)
        self.positions = torch.zeros(b * q, dtype=torch.long, device=device)
        self.slots = torch.full((b * q,), pad_slot, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(0, b * q + 1, q, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((b,), q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, batch: int, seq_lens_cpu: list[int] | None = None) -> AttentionMetadata:
        q = self.query_len
        return AttentionMetadata(
            slot_mapping=self.slots[: batch * q],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            query_lens_cpu=[q] * batch,
            # Captured: the kernels' grid for the longest case (they read real lengths on the
            # device). Eager (capture=False): the real lengths, which the CPU path computes with.
            seq_lens_cpu=seq_lens_cpu or [self.max_model_len] * batch,
        )

    def _forward(self, batch: int, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
        n = batch * self.query_len
        meta = self._meta(batch, seq_lens_cpu)
        hidden = self.model(self.input_ids[:n], self.positions[:n], meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool."""
        if not self.capture_enabled:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for batch in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for batch sizes %s", self.sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that fits `num_seqs` sequences; None if none does."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step with this metadata can replay a graph."""
        return (
            self.padded_size(meta.num_seqs) is not None
            and all(n == self.query_len for n in meta.query_lens_cpu)
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits [num_tokens, vocab] of the step (a view of the graph's output: use it now)."""
        num_seqs = meta.num_seqs
        batch = self.padded_size(num_seqs)
        assert batch is not None and self.fits(meta)
        n, padded = num_seqs * self.query_len, batch * self.query_len
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:padded].fill_(self.pad_slot)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs:batch].fill_(self.query_len)
        width = meta.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        self.block_tables[num_seqs:batch].zero_()
        if self.capture_enabled:
            self.graphs[batch].replay()
            logits = self.outputs[batch]
        else:
            padding = [self.query_len] * (batch - num_seqs)
            logits = self._forward(batch, list(meta.seq_lens_cpu) + padding)
        return logits[:n]
