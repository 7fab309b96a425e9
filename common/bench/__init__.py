"""`pdserve bench`: load generation against any OpenAI-compatible endpoint, with reports.

Modules: `datasets` (what to send), `client` (one streamed request, timed), `profiles` (when to
send: synchronous, concurrent, constant, poisson, sweep), `report` (metrics, JSON/CSV/PNG, Markdown)
and `command` (the CLI arguments, progress, Ctrl-C). `common.cli` calls `add_bench_args` and
`run_bench_command`.
"""

from common.bench.command import add_bench_args, run_bench_command

__all__ = ["add_bench_args", "run_bench_command"]
