"""Runs the model: rows of tokens in, logits out.

Owns the model weights on their device, each model's attention backend, the KV cache tensors
(sized from the memory budget); with `--draft-model` also the draft model and its KV cache, laid
out like the target's and addressed by the same block tables; on CUDA (unless `--enforce-eager`)
the captured decode graphs (`common.model.cuda_graph`) that replay uniform decode and verify steps.

The engine calls `run` once per step with the step's rows (tokens, first position, block table;
see `common.kernels.attention.build_batch`) and how many trailing logits each row wants; it samples
and verifies drafts itself. A step with rows whose prompt tokens are scored (prompt logprobs) calls
`run_with_hidden` instead, which also returns those rows' final hidden states for the engine to put
through `compute_logits` a slice at a time; other steps never pay for it. The runner knows nothing
of sequences, sampling or speculation.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import EngineConfig, parse_size
from common.kernels import cpu_quant, kv_quant, tune, weight_copies
from common.kernels.attention import AttentionMetadata, Row, build_batch
from common.model.llama import PAD_ROWS, CausalLM, head_dim_of
from common.model.quant import kernel_weights
from common.runtime.cores import fit_threads

if TYPE_CHECKING:
    from common.model.cuda_graph import DecodeGraphs

# (input ids, positions, attention metadata) of a forward over some rows.
Batch = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]

log = logging.getLogger(__name__)

SCALE_BYTES = 4  # an 8-bit cache's scales are float32


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V (with an 8-bit cache's float32 scales,
    one per token and KV head)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    row = head_dim_of(hf_config) * elem + (SCALE_BYTES if kv_quant.is_8bit(dtype) else 0)
    return 2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads * row


def allow_dense_weights(budget: str, weights: list, dtype: torch.dtype) -> bool:
    """Let the quantized layers keep dequantized copies (cpu_quant's "dense" path, which the tune
    then times) when all of them fit in `budget` (--dense-weight-memory: auto = a quarter of the
    memory available now); logs the decision. Returns it."""
    if not weights:  # no quantized layers: nothing to decide (the flag is process-wide)
        return False
    need = cpu_quant.dense_bytes(weights, dtype)
    if budget == "auto":
        limit, what = available_memory_bytes() // 4, "a quarter of the available memory"
    else:
        limit, what = parse_size(budget), f"--dense-weight-memory {budget}"
    allowed = 0 < need <= limit
    # Batches the C decode layers run (decode steps up to DENSE_FLOOR_ROWS sequences) stay
    # on c / a8, which those layers need: measured on the default model (bfloat16, 2 threads),
    # 64 x 320-token decode steps took 139 ms through them against 150 ms through the dense
    # per-op path, although a dense matmul alone is faster there (the tune times matmuls only).
    cpu_quant.set_dense_weights(allowed, _c_layer_rows())
    log.info(
        "dense copies of the quantized weights (%s, %.1f MiB) %s %s (%.1f MiB)",
        str(dtype).removeprefix("torch."), need / 2**20,
        "fit in" if allowed else "do not fit in: the dense path is off;", what, limit / 2**20,
    )  # fmt: skip
    return allowed


def _c_layer_rows() -> int:
    from common.kernels import cpu_layer

    return cpu_layer.DENSE_FLOOR_ROWS if cpu_layer.enabled and cpu_layer.available() else 0


def available_memory_bytes(root: str = "/") -> int:
    """Memory this process may still take: MemAvailable from /proc/meminfo, or less where a
    cgroup limit (a container's, a Kubernetes pod's) leaves less; 0 where neither can be read
    (auto then keeps no copies). `root`: where /proc and /sys are (tests)."""
    available = _read_int(os.path.join(root, "proc/meminfo"), "MemAvailable:", 1024)
    for limit_file, usage_file in (
        ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),  # cgroup v2
        ("sys/fs/cgroup/memory/memory.limit_in_bytes",
         "sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):  # fmt: skip
        limit = _read_int(os.path.join(root, limit_file))
        usage = _read_int(os.path.join(root, usage_file))
        if limit and usage is not None and limit < (1 << 60):  # "max" / v1's huge "no limit"
            room = max(limit - usage, 0)
            available = room if available is None else min(available, room)
            break
    return available or 0


def _read_int(path: str, prefix: str = "", unit: int = 1) -> int | None:
    """The integer in `path` (on its line starting with `prefix`, the first word after it, times
    `unit`), or None when there is none (no file, "max", another format)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    words = line[len(prefix) :].split()
                    return int(words[0]) * unit if words and words[0].isdigit() else None
    except OSError:
        pass
    return None


class ModelRunner:
    """The model, its paged KV cache, and the per-step input preparation."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.kv_dtype = config.resolved_kv_dtype()
        self.block_size = config.block_size
        # the model pads a CPU prompt step's rows to a multiple of this (llama.PAD_ROWS)
        self.row_granule = PAD_ROWS if self.device.type == "cpu" else 1
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        elif self.device.type == "cpu":  # not past a container's CPU quota
            fit_threads(torch.get_num_threads, torch.set_num_threads)
        cpu_quant.set_activations(config.cpu_activations)  # process-wide: one model per process
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.attention_backend = backend
        if backend == "triton" and self.kv_dtype != self.dtype and self.kv_dtype.itemsize != 1:
            raise ValueError(
                f"--kv-cache-dtype {config.kv_cache_dtype} (a 16/32-bit cache of another dtype "
                f"than the model's {self.dtype}) is read by the torch attention backend only: "
                "use --attention-backend torch, or with Triton auto, int8 or fp8"
            )
        # the row builder the engine hands to a draft proposer (which never sees the runner)
        self.build_rows: Callable[[list[Row]], Batch] = functools.partial(
            build_batch, block_size=self.block_size, device=self.device
        )

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
        self.model.set_attention_backend(backend)
        self.draft_model: CausalLM | None = None
        if config.speculative == "draft":
            self._check_draft_layers(hf_config)
        if config.speculative == "draft" and config.draft_model is not None:
            self.draft_model = self._load_draft(config.draft_model, hf_config)
        if self.device.type == "cpu":  # which kernel serves which batch size: measured or cached
            weights = kernel_weights([self.model, self.draft_model])
            allow_dense_weights(config.dense_weight_memory, [w for _, w in weights], self.dtype)
            tune.prepare(config.kernel_choice, self.dtype, weights)
            self._prepare_copies(config, weights)
        self.num_blocks = self._num_blocks(hf_config)
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, less than "
                f"--max-model-len {self.max_model_len}: raise --kv-cache-memory / "
                "--gpu-memory-utilization or lower --max-model-len"
            )
        self.kv_cache, self.kv_scales = self._allocate_kv_cache(self.model, hf_config)
        if self.draft_model is not None:
            self.draft_kv_cache, self.draft_kv_scales = self._allocate_kv_cache(
                self.draft_model, self.draft_model.config
            )
        self.graphs: dict[int, DecodeGraphs] = {}  # by query tokens per sequence
        if self.device.type == "cuda" and not config.enforce_eager and backend == "triton":
            self._capture_graphs()
        log.info(
            "model ready: %d KV blocks of %d tokens: %d tokens of KV cache, %d bytes per token "
            "(KV %s; %s, %s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.kv_bytes_per_token,
            str(self.kv_dtype).removeprefix("torch."),
            self.dtype,
            self.device,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes (all layers, K and V, scales; the draft's too)."""
        return self._kv_bytes_per_block() // self.block_size

    def _allocate_kv_cache(
        self, model: CausalLM, hf_config
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[layers, 2 (K, V), blocks, block_size, kv heads, head_dim] and, for an 8-bit cache,
        its float32 scales [layers, 2, blocks, block_size, kv heads]; bound to model's layers."""
        shape = (hf_config.num_hidden_layers, 2, self.num_blocks, self.block_size,
                 hf_config.num_key_value_heads)  # fmt: skip
        cache = torch.zeros(
            *shape, head_dim_of(hf_config), dtype=self.kv_dtype, device=self.device
        )
        scales = None
        if kv_quant.is_8bit(self.kv_dtype):
            scales = torch.zeros(*shape, dtype=torch.float32, device=self.device)
        for i, layer in enumerate(model.layers):
            layer.self_attn.k_cache = cache[i, 0]
            layer.self_attn.v_cache = cache[i, 1]
            if scales is not None:
                layer.self_attn.k_scales = scales[i, 0]
                layer.self_attn.v_scales = scales[i, 1]
        return cache, scales

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
        draft.set_attention_backend(self.attention_backend)
        return draft

    def _kv_bytes_per_block(self) -> int:
        per_block = kv_bytes_per_block(self.model.config, self.block_size, self.kv_dtype)
        if self.draft_model is not None:  # the draft's cache has as many blocks as the target's
            per_block += kv_bytes_per_block(
                self.draft_model.config, self.block_size, self.kv_dtype
            )
        return per_block

    def _prepare_copies(self, config: EngineConfig, weights: list) -> None:
        """The repacked weight copies every batch size up to the step's token budget will use,
        made now rather than by the first steps of each size (weight_copies.prepare_copies); an LM
        head's batches are logits rows, at most a step's sequences times their tokens to
        verify (prompt logprobs may ask for more: those copies are still made when first
        used)."""
        start = time.perf_counter()
        most = config.max_num_batched_tokens
        per_seq = 1 + (config.num_speculative_tokens if config.speculative != "none" else 0)
        logits = min(most, config.max_num_seqs * per_seq)
        serves = weight_copies.prepare_copies(
            [(w, logits if name.rsplit(".", 1)[-1] == "lm_head" else most) for name, w in weights],
            self.dtype,
        )
        log.info(
            "weight copies made for batches up to %d rows (%d logits rows) in %.2f s: %s",
            most, logits, time.perf_counter() - start,
            ", ".join(f"{path} {n} weights" for path, n in sorted(serves.items())) or "none",
        )  # fmt: skip

    def _num_blocks(self, hf_config) -> int:
        per_block = self._kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used
        else:
            budget = parse_size(self.config.kv_cache_memory)
        return max(budget // per_block, 0)

    def prepare_rows(self, rows: list[Row]) -> Batch:
        """(input ids, positions, attention metadata) of a forward over `rows`."""
        return self.build_rows(rows)

    @torch.inference_mode()
    def run(self, rows: list[Row], num_logits: list[int]) -> torch.Tensor | None:
        """One forward over `rows`: writes their KV and returns the logits of each row's last
        `num_logits[i]` tokens, row after row ([sum(num_logits), vocab]).

        None when no row wants logits (prefill chunks short of the prompt's end: only their KV is
        wanted).
        """
        ids, pos, meta = self.build_rows(rows)
        if not any(num_logits):
            self.model(ids, pos, meta)
            return None
        ends = np.cumsum(meta.query_lens_cpu)
        if all(n == 1 for n in num_logits):
            index = torch.from_numpy(ends - 1).to(self.device)
        else:
            wanted = [range(end - n, end) for end, n in zip(ends.tolist(), num_logits) if n]
            index = torch.tensor([i for r in wanted for i in r], device=self.device)
        return self._logits(ids, pos, meta, index)

    @torch.inference_mode()
    def run_with_hidden(
        self, rows: list[Row], num_logits: list[int], hidden_rows: list[int]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """As `run` (always eager), plus the final hidden states of every token of each row in
        `hidden_rows` ([row's tokens, hidden] each, views into one forward's output)."""
        ids, pos, meta = self.build_rows(rows)
        hidden = self.model(ids, pos, meta)
        starts = np.concatenate(([0], np.cumsum(meta.query_lens_cpu)))
        kept = [hidden[starts[i] : starts[i + 1]] for i in hidden_rows]
        if not any(num_logits):
            return None, kept
        wanted = [range(end - n, end) for end, n in zip(starts[1:].tolist(), num_logits) if n]
        index = torch.tensor([i for r in wanted for i in r], device=self.device)
        return self.model.compute_logits(hidden[index]), kept

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states (from `run_with_hidden`)."""
        return self.model.compute_logits(hidden)
