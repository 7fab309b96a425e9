"""The `pdserve` console script: parses the command line and runs one subcommand.

Each subcommand is a small `cmd_*` function taking the parsed args and returning an exit code, plus
an `add_parser` call in `build_parser`. Heavy imports happen inside the command functions, so
`pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def cmd_models_pull(args: argparse.Namespace) -> int:
    from common.model_files import pull_default_model

    path = pull_default_model(progress=not args.quiet)
    print(path)
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
