"""`pdserve quantize`: write a W4A16 / W8A16 compressed-tensors checkpoint from a 16-bit model.

Owns the command's arguments and its two methods:
- `rtn`: round-to-nearest with min-max scales, written by
  `common.model.compressed_tensors.write_compressed_tensors`; needs nothing beyond pdserve.
- `gptq`: llm-compressor's GPTQModifier on a calibration text (the optional extra
  `pip install -e '.[quantize]'`); llm-compressor writes the checkpoint itself.
Both outputs load in pdserve (`common.model.compressed_tensors.iter_compressed_tensors`) and in
vLLM. `common/cli.py` registers the subcommand and calls `run_quantize_command`; torch is imported
only when the command runs, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SCHEMES = {"W4A16": 4, "W8A16": 8}
# llm-compressor's presets: W4A16 groups of 128, W8A16 one scale per output channel.
DEFAULT_GROUP_SIZE = {"W4A16": 128, "W8A16": 0}
_DTYPES = ("bfloat16", "float16", "float32")
# The shipped calibration text: the other helper's benchmarks/data copy when present (a source
# checkout), else the small public-domain text packaged next to this module.
_REPO_ROOT = Path(__file__).resolve().parents[2]
CALIBRATION_CANDIDATES = (
    _REPO_ROOT / "benchmarks" / "data" / "calibration.txt",
    Path(__file__).resolve().parent / "data" / "calibration.txt",
)


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="'default', a .gguf file, or a Hugging Face model directory")
    parser.add_argument("--scheme", required=True, choices=sorted(SCHEMES),
                        help="weight-only scheme; activations stay 16-bit")
    parser.add_argument("--method", default="rtn", choices=("rtn", "gptq"),
                        help="rtn: round-to-nearest, no extras; gptq: llm-compressor "
                             "(pip install -e '.[quantize]')")
    parser.add_argument("-o", "--output", required=True, help="output directory")
    parser.add_argument("--group-size", type=int, default=None,
                        help="weights per scale along the input dimension; 0 = one per output "
                             "channel (default: 128 for W4A16, per channel for W8A16)")
    parser.add_argument("--asymmetric", action="store_true",
                        help="store a zero point per group (default: symmetric)")
    parser.add_argument("--ignore", nargs="*", default=["lm_head"],
                        help="modules left 16-bit, names or 're:' patterns (default: lm_head)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *_DTYPES),
                        help="dtype of the 16-bit tensors and scales (auto: the config's)")
    parser.add_argument("--calibration", default=None,
                        help="gptq: calibration text file (default: the text shipped with pdserve)")
    parser.add_argument("--num-samples", type=int, default=64, help="gptq: calibration sequences")
    parser.add_argument("--max-seq-len", type=int, default=512,
                        help="gptq: tokens per calibration sequence")


def default_calibration() -> Path:
    for path in CALIBRATION_CANDIDATES:
        if path.is_file():
            return path
    raise ValueError("no calibration text shipped; pass --calibration FILE")


def _dtype(name: str, hf_config):
    import torch

    if name == "auto":
        configured = getattr(hf_config, "dtype", None)
        name = str(configured).removeprefix("torch.") if configured is not None else "bfloat16"
    return getattr(torch, name if name in _DTYPES else "bfloat16")


def run_quantize_command(args: argparse.Namespace) -> int:
    from common.model.compressed_tensors import is_compressed_tensors, iter_compressed_tensors
    from common.model.model_files import resolve_model

    bits = SCHEMES[args.scheme]
    group_size = DEFAULT_GROUP_SIZE[args.scheme] if args.group_size is None else args.group_size
    if group_size < 0 or (group_size and group_size % 2):
        raise ValueError(f"--group-size {group_size}: expected 0 (per channel) or a positive even "
                         "number")
    source = resolve_model(args.model)
    if is_compressed_tensors(source.hf_config):
        raise ValueError(f"--model {args.model!r} is already a compressed-tensors checkpoint")
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"-o {out}: directory exists and is not empty")
    dtype = _dtype(args.dtype, source.hf_config)
    if args.method == "rtn":
        from common.model.compressed_tensors import write_compressed_tensors
        from common.model.weights import iter_weights

        write_compressed_tensors(iter_weights(source), source.hf_dir, out, bits,
                                 group_size or None, symmetric=not args.asymmetric,
                                 ignore=args.ignore, dtype=dtype)
    else:
        calibration = Path(args.calibration) if args.calibration else default_calibration()
        _gptq(source, out, bits, group_size or None, not args.asymmetric, args.ignore, dtype,
              calibration, args.num_samples, args.max_seq_len)
    # Read back what was written: a checkpoint pdserve cannot load fails here, not at serve time.
    from transformers import AutoConfig

    count = sum(1 for _ in iter_compressed_tensors(out, AutoConfig.from_pretrained(out)))
    print(f"wrote {args.scheme} ({args.method}, group size {group_size or 'per channel'}, "
          f"{'asymmetric' if args.asymmetric else 'symmetric'}) with {count} tensors to {out}")
    return 0


def _gptq(source, out: Path, bits: int, group_size: int | None, symmetric: bool,
          ignore: list[str], dtype, calibration: Path, num_samples: int,
          max_seq_len: int) -> None:
    """GPTQ through llm-compressor (optional extra); it saves the compressed checkpoint itself."""
    try:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
    except ImportError as e:
        raise RuntimeError(
            f"--method gptq needs llm-compressor ({e}); install the extra with "
            "pip install -e '.[quantize]', or use --method rtn") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.model.compressed_tensors import scheme_config

    if source.kind == "gguf":
        load = dict(pretrained_model_name_or_path=source.path.parent, gguf_file=source.path.name)
    else:
        load = dict(pretrained_model_name_or_path=source.path)
    model = AutoModelForCausalLM.from_pretrained(**load, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
    ids = tokenizer(calibration.read_text())["input_ids"]
    chunks = [ids[i:i + max_seq_len] for i in range(0, len(ids), max_seq_len)][:num_samples]
    chunks = [c for c in chunks if len(c) > 1]
    if not chunks:
        raise ValueError(f"--calibration {calibration}: no text to calibrate on")
    dataset = Dataset.from_dict({"input_ids": chunks,
                                 "attention_mask": [[1] * len(c) for c in chunks]})
    groups = scheme_config(bits, group_size, symmetric, ignore)["config_groups"]
    groups = {name: {k: v for k, v in g.items() if k != "format"} for name, g in groups.items()}
    recipe = GPTQModifier(config_groups=groups, ignore=list(ignore))
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=max_seq_len,
            num_calibration_samples=len(chunks))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
