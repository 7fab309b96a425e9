"""Engine configuration and the command-line flags that set it.

Every flag also reads a `PDSERVE_<FLAG>` environment variable (what compose and Kubernetes set); an
explicit flag wins. Names follow vLLM where it has the same knob. Used by every `pdserve` subcommand
that runs an engine.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily so that `pdserve --help` stays fast
    from collections.abc import Mapping

    import torch

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
}


def parse_size(text: str | int) -> int:
    """'2GiB', '512M', '1073741824' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    """What one engine (in a worker or in run-batch) runs and how much memory it may use."""

    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefill_chunk: str = "auto"  # auto (from measured step costs) | off | a number of tokens
    max_model_len: int | None = None
    kv_cache_memory: str = "2GiB"  # CPU budget for the KV cache
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | torch | triton
    num_threads: int = 0  # CPU threads for torch; 0 = the usable cores (affinity, quota)
    seed: int = 0
    speculative: str = "none"  # none | ngram | draft
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    draft_layers: int = 0
    speculative_disable_by_batch_size: int | None = None  # None: auto (see the flag's help)
    speculative_adaptive: bool = True
    enforce_eager: bool = False
    warm_up: bool = True  # workers and run-batch: throwaway requests at start (Engine.warm_up)
    cuda_graph_max_batch: int = 256
    quantization: str = "auto"  # auto | none | int8 | int4 (weights only)
    quantization_group_size: int = 0  # 0 = automatic (see the flag's help)
    cpu_activations: str = "auto"  # auto | int8 | float (CPU quantized layers' activations)
    kernel_choice: str = "auto"  # auto (measured) | table | a cpu_quant path (CPU quantized layers)
    dense_weight_memory: str = "auto"  # auto | 0 | a size: dequantized copies for big CPU batches
    kv_cache_dtype: str = "auto"  # auto (model dtype) | bfloat16 | float16 | float32 | int8 | fp8
    kv_offload_memory: str = "0"  # host RAM for blocks evicted from the KV cache (0: none)
    kv_offload_dir: str = ""  # a local directory for them ("": none) ...
    kv_offload_disk: str = "0"  # ... holding at most this many bytes of block files

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        import torch

        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype == "auto":
            return torch.bfloat16
        if self.dtype not in names:
            raise ValueError(
                f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}"
            )
        return names[self.dtype]

    def resolved_kv_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model dtype for auto; int8 and fp8 (e4m3) carry a
        float32 scale per (token, KV head) beside the cache (common.kernels.kv_quant)."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        names = {
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "int8": torch.int8,
            "fp8": getattr(torch, "float8_e4m3fn", None),
        }
        if self.kv_cache_dtype not in names:
            raise ValueError(
                "--kv-cache-dtype must be auto, bfloat16, float16, float32, int8 or fp8, "
                f"not {self.kv_cache_dtype!r}"
            )
        if names[self.kv_cache_dtype] is None:
            raise ValueError("--kv-cache-dtype fp8 needs a torch with torch.float8_e4m3fn")
        return names[self.kv_cache_dtype]

    def validate(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("--block-size must be one of 8, 16, 32, 64, 128")
        if self.prefill_chunk not in ("auto", "off") and not (
            self.prefill_chunk.isdigit() and int(self.prefill_chunk) >= 1
        ):
            raise ValueError(
                "--prefill-chunk must be auto, off or a number of tokens, "
                f"not {self.prefill_chunk!r}"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be positive")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("--attention-backend must be auto, torch or triton")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        self.resolved_dtype()
        self.resolved_kv_dtype()
        parse_size(self.kv_cache_memory)
        if self.dense_weight_memory != "auto":
            parse_size(self.dense_weight_memory)
        self._validate_offload()
        if self.cuda_graph_max_batch < 1:
            raise ValueError("--cuda-graph-max-batch must be >= 1")
        self._validate_speculative()
        self._validate_quantization()
        if self.cpu_activations not in ("auto", "int8", "float"):  # cpu_quant.ACTIVATION_MODES
            raise ValueError(
                f"--cpu-activations must be auto, int8 or float, not {self.cpu_activations!r}"
            )
        if self.kernel_choice not in _KERNEL_CHOICES:
            raise ValueError(
                f"--kernel-choice must be one of {', '.join(_KERNEL_CHOICES)}, "
                f"not {self.kernel_choice!r}"
            )

    def _validate_offload(self) -> None:
        parse_size(self.kv_offload_memory)
        if bool(self.kv_offload_dir) != (parse_size(self.kv_offload_disk) > 0):
            raise ValueError(
                "--kv-offload-dir and --kv-offload-disk go together: the directory, and the most "
                "bytes of KV it may hold (e.g. --kv-offload-dir /var/cache/kv --kv-offload-disk "
                "20GiB)"
            )

    def _validate_quantization(self) -> None:
        modes = ("auto", "none", "int8", "int4")  # common.model.quant.QUANTIZATION_MODES
        if self.quantization not in modes:
            raise ValueError(
                f"--quantization must be one of {', '.join(modes)}, not {self.quantization!r}"
            )
        group = self.quantization_group_size
        if group != 0 and (group < 2 or group & (group - 1)):
            raise ValueError(
                f"--quantization-group-size must be 0 (automatic) or a power of two, not {group}"
            )

    def _validate_speculative(self) -> None:
        if self.speculative not in ("none", "ngram", "draft"):
            raise ValueError(
                f"--speculative must be none, ngram or draft, not {self.speculative!r}"
            )
        if self.draft_layers < 0:
            raise ValueError("--draft-layers must be >= 0")
        limit = self.speculative_disable_by_batch_size
        if limit is not None and limit < 0:
            raise ValueError("--speculative-disable-by-batch-size must be >= 0")
        if self.speculative == "none":
            return
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("--num-speculative-tokens must be in [1, 32]")
        if self.speculative == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    "--prompt-lookup-min must be >= 1 and <= --prompt-lookup-max "
                    f"(got {self.prompt_lookup_min} and {self.prompt_lookup_max})"
                )
        elif (self.draft_model is None) == (self.draft_layers == 0):
            raise ValueError(
                "--speculative draft needs exactly one of --draft-model PATH (a separate model "
                "sharing the vocabulary) or --draft-layers N (the target's first N layers)"
            )


# common.kernels.cpu_quant.KERNEL_CHOICES (not imported: it imports torch)
_KERNEL_CHOICES = (
    "auto", "table", "c", "f32tiles", "int4pack", "int8pack", "a8", "dense", "amxbf16", "amx4",
    "dequant",
)

_HELP = {
    "model": "'default' (SmolLM2-135M-Instruct), an HF model directory, or a .gguf file",
    "dtype": "auto (bfloat16), float32, bfloat16 or float16",
    "device": "auto, cpu or cuda[:N]",
    "block_size": "tokens per KV block",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "token budget of one step (chunked prefill splits longer prompts)",
    "prefill_chunk": "prompt tokens one step computes at most: auto = the smallest chunk whose "
    "cost per token, the step's fixed cost included, is within 10%% of the per-token cost alone, "
    "from the step times measured while serving (prompts then finish one after another and "
    "decode steps between them stay short); off = up to --max-num-batched-tokens; or a number",
    "max_model_len": "longest prompt + output; default: the model's context length",
    "kv_cache_memory": "KV cache size on CPU, e.g. 2GiB",
    "gpu_memory_utilization": "fraction of GPU memory for weights + KV cache",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "attention_backend": "auto (triton on GPU, torch on CPU), torch or triton",
    "num_threads": "CPU threads for torch (0 = the cores it may use: affinity, CPU quota)",
    "seed": "seed of the sampler's shared random generator",
    "speculative": "speculative decoding: none, ngram (prompt lookup) or draft",
    "num_speculative_tokens": "tokens drafted per sequence and step",
    "prompt_lookup_min": "ngram: shortest suffix to look up in the sequence's own tokens",
    "prompt_lookup_max": "ngram: longest suffix to look up",
    "draft_model": "draft: a separate model sharing the target's vocabulary (path or 'default')",
    "draft_layers": "draft: early exit, the target's first N layers plus its norm and head",
    "speculative_disable_by_batch_size": "no drafting while more than N sequences run (verifying "
    "costs compute a busy CPU does not have); 0 = never; default: 2 on CPU, 0 on GPU",
    "speculative_adaptive": "pause drafting while it measures slower per token than plain "
    "decoding, and verify as many of the K drafts as measured acceptance and step costs say pay "
    "(output is the same either way)",
    "enforce_eager": "never capture CUDA graphs (the CPU path is always eager)",
    "warm_up": "run a few throwaway requests at start, before the worker registers, so that the "
    "first real request does not pay one-time costs (weight repacking, first kernel calls: ~0.4 "
    "s of a first short request's TTFT, ~0.55 s of a 300-token prompt's, default model on 2 CPU "
    "cores; and the grammar engine's tokenizer, whose build a first structured request made "
    "every running stream wait for); ~1 s of start-up there",
    "cuda_graph_max_batch": "largest decode batch captured as a CUDA graph (sizes 1, 2, 4, 8, "
    "then every 8); larger batches run eagerly",
    "quantization": "weight-only quantization of the linear layers: auto (serve what the "
    "checkpoint holds, e.g. GGUF Q4_1 as int4), none (dequantize to --dtype), int8 or int4 "
    "(quantize a 16-bit checkpoint on load, round to nearest); the KV cache is unaffected "
    "(see --kv-cache-dtype)",
    "kv_cache_dtype": "KV cache element type: auto (the model's --dtype), bfloat16, float16, "
    "float32, int8 or fp8 (e4m3); int8/fp8 keep a float32 scale per token and KV head beside "
    "the cache: about half the bytes of 16-bit KV per token, twice the tokens per "
    "--kv-cache-memory",
    "kv_offload_memory": "host RAM for KV blocks evicted from the KV cache, e.g. 512MiB: a later "
    "prompt starting with them reloads them instead of computing them (when that measures "
    "cheaper); 0 = off",
    "kv_offload_dir": "a local directory for evicted KV blocks (below --kv-offload-memory, or "
    "alone), one checksummed file per block, written in the background, cleaned on start; needs "
    "--kv-offload-disk",
    "kv_offload_disk": "the most bytes --kv-offload-dir may hold, e.g. 20GiB (oldest files "
    "deleted first); 0 = off",
    "quantization_group_size": "weights per scale along the input dimension for int8/int4; 0 = "
    "automatic: int4 the largest of 128/64/32 that divides the layer, int8 per output channel",
    "cpu_activations": "activations of the quantized layers on the CPU: int8 (quantized per row "
    "and block of 32 columns, integer dot products: faster for batches, off by the activations' "
    "rounding), float (exact as the float kernels), or auto (int8 where the CPU has VNNI or "
    "AVX2, at the batch sizes where it measured faster)",
    "kernel_choice": "which kernel multiplies a quantized layer on the CPU at each batch size: "
    "auto (timed on this machine at the first start for the model, threads and CPU, cached in "
    "the kernel cache; `pdserve tune` measures again), table (a fixed table, measured on one "
    "AVX2 host), or one of c, f32tiles, int4pack, int8pack, a8, dense, amxbf16, amx4, dequant "
    "(forced where it applies)",
    "dense_weight_memory": "memory the CPU quantized layers may spend on a copy of their weights "
    "dequantized to --dtype (2 bytes per weight in bfloat16), multiplied by the CPU's 16-bit GEMM "
    "(AMX/AVX-512) at the batch sizes where that measures faster (prompt steps, big batches): "
    "auto (if the copies fit in a quarter of the memory available at start, a container's "
    "cgroup limit counted), 0 (never), or a "
    "size such as 1GiB (if they fit in it)",
}


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    helps: dict[str, str],
    defaults: Mapping[str, object] | None = None,
) -> None:
    """One flag per field of the dataclass `cls`, each defaulting to $PDSERVE_<NAME> when set,
    else to `defaults`' value for it (a command's own), else to the field's.

    Field types understood: bool (--x/--no-x), int, float, str, `int | None`, `list[str]` (nargs +,
    space-separated in the environment).
    """
    defaults = defaults or {}
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        env = "PDSERVE_" + f.name.upper()
        raw = os.environ.get(env)
        if f.name in defaults:
            default = defaults[f.name]
        else:
            default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.type == "bool":
            value = raw.lower() in ("1", "true", "yes") if raw is not None else default
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=value,
                help=f"{helps[f.name]} (env {env})",
            )
        elif f.type == "list[str]":
            parser.add_argument(
                flag,
                nargs="+",
                default=raw.split() if raw else default,
                help=f"{helps[f.name]} (env {env})",
            )
        else:
            kind = {"int": int, "float": float, "int | None": int}.get(f.type, str)
            value = kind(raw) if raw is not None else default
            parser.add_argument(
                flag,
                type=kind,
                default=value,
                help=f"{helps[f.name]} (env {env}; default {default})",
            )


# `pdserve run-batch`'s defaults where they differ from a worker's: offline nobody waits for a
# first token, so a step takes whole prompts up to a larger budget instead of the chunks that keep
# a server's time to first token and inter-token latency short. Measured (default model,
# bfloat16, 2 threads, 64 x (256 -> 128), three runs in turns): 8.21-9.09 s against 9.16-9.74 s
# with the serving defaults; the prompts took 2.54-3.13 s in 5 steps against 3.77-3.93 s in 16-17
# (prompt steps of about 950 tokens, each with the running sequences' decode rows, run at ~4,000
# prompt tokens/s; steps of 2,600-8,192 at ~5,500). Budgets tried in turns, twice, chunks off:
# 4,096 tokens 9.61 / 8.57 s, 8,192 8.77 / 7.91 s, 16,384 (one step of every prompt) 9.77 / 8.90 s.
OFFLINE_DEFAULTS: dict[str, str | int] = {"prefill_chunk": "off", "max_num_batched_tokens": 8192}


def add_engine_args(
    parser: argparse.ArgumentParser, defaults: Mapping[str, object] | None = None
) -> None:
    """Add one flag per EngineConfig field, each defaulting to $PDSERVE_<NAME> when set, else to
    `defaults`' value for it (a command's own, as OFFLINE_DEFAULTS), else to the field's."""
    add_dataclass_args(parser, EngineConfig, _HELP, defaults)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
    config.validate()
    return config
