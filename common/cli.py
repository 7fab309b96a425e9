"""The `pdserve` console script: parses the command line and runs one subcommand.

The dispatcher is the only module in `common/` that imports the stages (`router`, `prefill`,
`decode`): each stage's flags and command live with it (`router/cli.py`, `prefill/cli.py`,
`decode/cli.py`); `up` (`common.runtime.up`) starts them as processes and imports none. Each
subcommand is a small `cmd_*` function taking the parsed args and returning an exit code, plus
an `add_parser` call in `build_parser`. Heavy imports happen inside the command functions, so
`pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _engine_process() -> None:
    """Before torch loads: how long this engine process's OpenMP threads spin between steps."""
    from common.runtime.omp_spin import configure

    configure()


def cmd_models_pull(args: argparse.Namespace) -> int:
    from common.model.model_files import pull_default_model

    path = pull_default_model(progress=not args.quiet)
    print(path)
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    _engine_process()
    from common.runtime.run_batch import run_batch_command

    return run_batch_command(args)


def cmd_router(args: argparse.Namespace) -> int:
    from router.cli import run_router

    return run_router(args)


def cmd_prefill(args: argparse.Namespace) -> int:
    _engine_process()
    from prefill.cli import cmd_prefill

    return cmd_prefill(args)


def cmd_decode(args: argparse.Namespace) -> int:
    _engine_process()
    from decode.cli import cmd_decode

    return cmd_decode(args)


def cmd_up(args: argparse.Namespace) -> int:
    from common.runtime.up import cmd_up

    return cmd_up(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from common.bench import run_bench_command

    return run_bench_command(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    from common.model.quantize import run_quantize_command

    return run_quantize_command(args)


def cmd_tune(args: argparse.Namespace) -> int:
    """Load the engine flags' model as an engine would (threads, activation mode, dtype), then
    time its quantized matmuls again (common.kernels.tune)."""
    _engine_process()
    import torch

    from common.config import config_from_args
    from common.kernels import cpu_quant, tune
    from common.model.llama import CausalLM
    from common.model.model_files import resolve_model
    from common.model.model_runner import allow_dense_weights
    from common.model.quant import kernel_weights
    from common.model.weights import iter_weights

    config = config_from_args(args)
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    cpu_quant.set_activations(config.cpu_activations)
    source = resolve_model(config.model)
    hf_config = source.hf_config
    max_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    model = CausalLM(hf_config, max_positions=max_len)
    model.load_weights(iter_weights(source), config.quantization, config.quantization_group_size)
    dtype = config.resolved_dtype()
    model = model.to(dtype=dtype).eval()
    weights = kernel_weights([model])
    allow_dense_weights(config.dense_weight_memory, [w for _, w in weights], dtype)
    return tune.run_tune_command(weights, dtype)


def cmd_limits(args: argparse.Namespace) -> int:
    import torch

    from common.bench.limits import measure
    from common.model.model_files import resolve_model

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    print(measure(resolve_model(args.model).hf_config).describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    models = commands.add_parser("models", help="manage model files")
    models_commands = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    pull = models_commands.add_parser("pull", help="fetch the default model into the cache")
    pull.add_argument("-q", "--quiet", action="store_true", help="no download progress")
    pull.set_defaults(func=cmd_models_pull)

    from common.config import OFFLINE_DEFAULTS, add_engine_args

    batch = commands.add_parser(
        "run-batch", help="offline inference over an OpenAI batch file (JSONL), in-process"
    )
    batch.add_argument("-i", "--input-file", required=True, help="input JSONL ('-' for stdin)")
    batch.add_argument("-o", "--output-file", required=True, help="output JSONL ('-' for stdout)")
    batch.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names requests may use (default: the --model argument as given)",
    )
    batch.add_argument(
        "--tool-call-parser",
        default="",
        choices=("", "hermes", "generic"),
        help="the tool-call format, as the router's flag (hermes, or generic: the default)",
    )
    add_engine_args(batch, OFFLINE_DEFAULTS)
    batch.set_defaults(func=cmd_run_batch)

    from router.cli import add_router_args

    router = commands.add_parser("router", help="run the router (HTTP API + worker registry)")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    from prefill.cli import add_prefill_args

    prefill = commands.add_parser("prefill", help="run a prefill worker")
    add_prefill_args(prefill)
    prefill.set_defaults(func=cmd_prefill)

    from decode.cli import add_decode_args

    decode = commands.add_parser("decode", help="run a decode worker")
    add_decode_args(decode)
    decode.set_defaults(func=cmd_decode)

    from common.runtime.up import add_up_args

    up = commands.add_parser("up", help="run router + prefill + decode workers locally")
    add_up_args(up)
    up.set_defaults(func=cmd_up)

    bench = commands.add_parser(
        "bench", help="benchmark an OpenAI-compatible endpoint (latency, throughput, plots)"
    )
    from common.bench.command import add_bench_args

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    from common.model.quantize import add_quantize_args

    quantize = commands.add_parser(
        "quantize", help="write a W4A16/W8A16 compressed-tensors checkpoint (rtn or gptq)"
    )
    add_quantize_args(quantize)
    quantize.set_defaults(func=cmd_quantize)

    tune = commands.add_parser(
        "tune", help="time the CPU quantized kernels on the model's shapes, cache the choice"
    )
    add_engine_args(tune)
    tune.set_defaults(func=cmd_tune)

    limits = commands.add_parser(
        "limits", help="measure this machine's memory bandwidth and matmul rates (5-10 s)"
    )
    limits.add_argument("--model", default="default", help="whose linear shapes to time")
    limits.add_argument("--num-threads", type=int, default=0, help="torch threads (0: default)")
    limits.set_defaults(func=cmd_limits)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RuntimeError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
