"""Runs the model for one scheduled step: builds the flat batch, runs the forward, samples.

Owns the model weights on their device, the KV cache tensors (sized from the memory budget) and the
sampler; with `--draft-model` also the draft model and its KV cache, laid out like the target's and
addressed by the same block tables; on CUDA (unless `--enforce-eager`) the captured decode graphs
(`common.model.cuda_graph`) that replay uniform decode and verify steps. Called by the engine once
per
step with the scheduler's decision (`execute`, or `execute_speculative` when the step verifies
draft tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import EngineConfig, parse_size
from common.engine.sampler import Sampler, SampleResult, SamplingState
from common.engine.scheduler import ScheduledSeq
from common.kernels.attention import AttentionMetadata
from common.model.llama import CausalLM, head_dim_of, set_attention_backend

if TYPE_CHECKING:
    from common.engine.spec.spec_decode import Verifier
    from common.model.cuda_graph import DecodeGraphs

# One row of a forward: input token ids, the position of the first, the sequence's block table.
Row = tuple[list[int], int, list[int]]

log = logging.getLogger(__name__)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return (
        2
        * hf_config.num_hidden_layers
        * block_size
        * hf_config.num_key_value_heads
        * head_dim_of(hf_config)
        * elem
    )


class ModelRunner:
    """The model, its paged KV cache, and the per-step input preparation."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        weights: Iterable[tuple[str, torch.Tensor]],
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        set_attention_backend(backend)

        model_max = int(getattr(hf_config, "max_position_embeddings", 2048))
        self.max_model_len = config.max_model_len or model_max
        if self.max_model_len > model_max:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's {model_max}"
            )
        model = CausalLM(hf_config, max_positions=self.max_model_len)
        model.load_weights(weights, config.quantization, config.quantization_group_size)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if self.device.type == "cpu" and torch.backends.mkldnn.is_available():
            self.model.pack_for_cpu()
        self.model.rotary.to_device(self.device)
        self.draft_model: CausalLM | None = None
        if config.speculative == "draft":
            self._check_draft_layers(hf_config)
        if config.speculative == "draft" and config.draft_model is not None:
            self.draft_model = self._load_draft(config.draft_model, hf_config)
        self.num_blocks = self._num_blocks(hf_config)
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, less than "
                f"--max-model-len {self.max_model_len}: raise --kv-cache-memory / "
                "--gpu-memory-utilization or lower --max-model-len"
            )
        self.kv_cache = self._allocate_kv_cache(self.model, hf_config)
        if self.draft_model is not None:
            self.draft_kv_cache = self._allocate_kv_cache(self.draft_model, self.draft_model.config)
        self.sampler = Sampler()
        self.graphs: dict[int, DecodeGraphs] = {}  # by query tokens per sequence
        if self.device.type == "cuda" and not config.enforce_eager and backend == "triton":
            self._capture_graphs()
        log.info(
            "model ready: %d KV blocks of %d tokens (%s, %s)",
            self.num_blocks,
            self.block_size,
            self.dtype,
            self.device,
        )

    def _allocate_kv_cache(self, model: CausalLM, hf_config) -> torch.Tensor:
        """[layers, 2 (K, V), blocks, block_size, kv heads, head_dim], bound to model's layers."""
        cache = torch.zeros(
            hf_config.num_hidden_layers,
            2,
            self.num_blocks,
            self.block_size,
            hf_config.num_key_value_heads,
            head_dim_of(hf_config),
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(model.layers):
            layer.self_attn.k_cache = cache[i, 0]
            layer.self_attn.v_cache = cache[i, 1]
        return cache

    def _capture_graphs(self) -> None:
        """CUDA graphs for plain decode steps and, with speculation, for k+1-token verify steps."""
        from common.model.cuda_graph import DecodeGraphs

        max_batch = min(self.config.max_num_seqs, self.config.cuda_graph_max_batch)
        query_lens = [1]
        if self.config.speculative != "none":
            query_lens.append(self.config.num_speculative_tokens + 1)
        for query_len in query_lens:
            graphs = DecodeGraphs(
                self.model,
                max_batch=max_batch,
                query_len=query_len,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                device=self.device,
            )
            graphs.capture()
            self.graphs[query_len] = graphs

    def _logits(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, index: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the flat batch's tokens `index`: a CUDA graph replay when one fits the step
        (every sequence with the same query length, a captured one), else an eager forward."""
        graphs = self.graphs.get(meta.query_lens_cpu[0]) if self.graphs else None
        if graphs is not None and graphs.fits(meta):
            return graphs.run(ids, pos, meta)[index]
        hidden = self.model(ids, pos, meta)
        return self.model.compute_logits(hidden[index])

    def _check_draft_layers(self, hf_config) -> None:
        layers = self.config.draft_layers
        if layers >= hf_config.num_hidden_layers:
            raise ValueError(
                f"--draft-layers {layers} must be less than the target's "
                f"{hf_config.num_hidden_layers} layers"
            )

    def _load_draft(self, path: str, hf_config) -> CausalLM:
        """The separate draft model, on the target's device and dtype; same vocabulary required."""
        from common.model.model_files import resolve_model
        from common.model.weights import iter_weights

        source = resolve_model(path)
        if int(source.hf_config.vocab_size) != int(hf_config.vocab_size):
            raise ValueError(
                f"--draft-model has a vocabulary of {source.hf_config.vocab_size} tokens, the "
                f"target {hf_config.vocab_size}: they must share one vocabulary"
            )
        draft = CausalLM(source.hf_config, max_positions=self.max_model_len)
        draft.load_weights(
            iter_weights(source), self.config.quantization, self.config.quantization_group_size
        )
        draft = draft.to(device=self.device, dtype=self.dtype).eval()
        if self.device.type == "cpu" and torch.backends.mkldnn.is_available():
            draft.pack_for_cpu()
        draft.rotary.to_device(self.device)
        return draft

    def _num_blocks(self, hf_config) -> int:
        per_block = kv_bytes_per_block(hf_config, self.block_size, self.dtype)
        if self.draft_model is not None:  # the draft's cache has as many blocks as the target's
            per_block += kv_bytes_per_block(self.draft_model.config, self.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used
        else:
            budget = parse_size(self.config.kv_cache_memory)
        return max(budget // per_block, 0)

    def _prepare(self, batch: list[ScheduledSeq]):
        rows = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            tokens = seq.token_ids[start : start + item.num_new_tokens]
            rows.append((tokens, start, seq.block_table))
        return self.prepare_rows(rows)

    def prepare_rows(self, rows: list[Row]):
        """(input ids, positions, attention metadata) of a forward over `rows`."""
        bs = self.block_size
        input_ids: list[int] = []
        slots: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        max_blocks = max(len(row[2]) for row in rows)
        tables = np.zeros((len(rows), max_blocks), dtype=np.int32)
        for i, (tokens, start, block_table) in enumerate(rows):
            n = len(tokens)
            input_ids.extend(tokens)
            pos = np.arange(start, start + n)
            table = np.asarray(block_table, dtype=np.int64)
            tables[i, : len(table)] = table
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.tensor(
                [0, *np.cumsum(query_lens)], dtype=torch.int32, device=dev
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.from_numpy(np.concatenate(positions)).to(dev)
        return ids, pos, meta

    def _states(self, batch: list[ScheduledSeq], rows: list[int]) -> list[SamplingState]:
        """What the sampler needs to know of each of the batch's `rows`."""
        return [
            SamplingState(
                params=batch[i].seq.params,
                prompt_token_ids=batch[i].seq.prompt_token_ids,
                output_token_ids=batch[i].seq.output_token_ids,
                generator=batch[i].seq.generator,
                eos_token_ids=self.eos_token_ids,
            )
            for i in rows
        ]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[SampleResult | None]:
        """Compute the batch's KV; sample one token for each sequence whose known tokens are all in.

        Returns one entry per scheduled sequence: its new token, or None for a prefill chunk that
        does not reach the end of the prompt yet.
        """
        ids, pos, meta = self._prepare(batch)
        ends = [
            i
            for i, s in enumerate(batch)
            if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens
        ]
        results: list[SampleResult | None] = [None] * len(batch)
        if not ends:
            self.model(ids, pos, meta)  # a prefill chunk: only its KV is wanted
            return results
        last = meta.query_start_loc[1:][ends].long() - 1
        logits = self._logits(ids, pos, meta, last)
        for i, result in zip(ends, self.sampler(logits, self._states(batch, ends))):
            results[i] = result
        return results

    @torch.inference_mode()
    def execute_speculative(
        self, batch: list[ScheduledSeq], verifier: Verifier
    ) -> list[list[SampleResult]]:
        """Like `execute`, in the same single forward, with each row's draft tokens appended.

        A row with drafts gets logits at every one of its last k+1 positions and `verifier` keeps
        the accepted drafts plus one token; other rows sample as in `execute`. Returns each row's
        new tokens (none for a prefill chunk short of the prompt's end).
        """
        rows = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            tokens = seq.token_ids[start : start + item.num_new_tokens] + item.draft_token_ids
            rows.append((tokens, start, seq.block_table))
        ids, pos, meta = self.prepare_rows(rows)
        ends = np.cumsum(meta.query_lens_cpu).tolist()
        plain: list[int] = []  # batch rows sampling one token
        verify: list[int] = []  # batch rows verifying drafts
        plain_index: list[int] = []  # hidden rows whose logits are needed
        verify_index: list[int] = []
        for i, item in enumerate(batch):
            if item.draft_token_ids:
                verify.append(i)
                verify_index.extend(range(ends[i] - len(item.draft_token_ids) - 1, ends[i]))
            elif item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens:
                plain.append(i)
                plain_index.append(ends[i] - 1)
        index = plain_index + verify_index
        results: list[list[SampleResult]] = [[] for _ in batch]
        if not index:
            self.model(ids, pos, meta)  # prefill chunks only: their KV is what is wanted
            return results
        logits = self._logits(ids, pos, meta, torch.tensor(index, device=ids.device))
        if plain:
            states = self._states(batch, plain)
            for i, result in zip(plain, self.sampler(logits[: len(plain)], states)):
                results[i] = [result]
        if verify:
            accepted = verifier.verify(logits[len(plain) :], [batch[i] for i in verify])
            for i, samples in zip(verify, accepted):
                results[i] = samples
        return results
