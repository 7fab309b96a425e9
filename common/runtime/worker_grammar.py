"""A worker's dispatches that wait for their grammar: `WorkerGrammar`, mixed into
`common.runtime.worker.WorkerBase`.

A dispatch (generate, reserve, prefill) whose structured output the engine has not compiled yet
waits in `compiling` while the compiler thread (`common.engine.grammar.compiler_thread`) compiles
it, and is handled once that is done, as if it came then (`add_request` then finds it cached; a
bad grammar is cached as its error, which `handle` reports as before). llguidance releases the
interpreter lock while it compiles, so the worker's loop steps the running streams meanwhile.
Compiled on the loop, a new large grammar stopped every stream for all of its compile: on the
default tokenizer a forced call of 200 tools compiles in 66-85 ms, a 3,000-property schema in
0.3-1.2 s, a 20,000-way choice in 0.3-0.5 s (benchmarks/grammar_stall.py measures the streams'
gaps). An abort drops a waiting dispatch (its compile finishes and stays cached).
While a compile runs, a CPU engine's steps run on one torch thread fewer (`_core_for_compiles`), so
that the compile does not push a step's thread off its core (grammar_stall.py, default model,
2 cores, 4 runs each alternated: 17-49 gaps over 40 ms against 64-74, the schema request
1.45-1.79 s against 1.63-2.46 s, the largest gap 112-235 ms against 184-228).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

import msgspec
import torch

from common import protocol
from common.engine.grammar import compiler_thread

if TYPE_CHECKING:
    from common.engine.engine import Engine
    from common.engine.grammar import GrammarCompiler
    from common.sampling_params import StructuredOutput


class WorkerGrammar:
    """Compile-first for a worker's dispatches (state: `compiling`, the compiler thread)."""

    engine: Engine
    compiling: dict[str, tuple[Future, msgspec.Struct]]  # request id -> (compile, dispatch)
    _compiler: ThreadPoolExecutor | None = None  # started on the first compile

    if TYPE_CHECKING:  # the worker's own (WorkerBase, WorkerKV): only declared here

        def handle(self, message: protocol.ControlMessage) -> None: ...

        def _fetch_first(self, message: protocol.ControlMessage) -> bool: ...

    def _abort(self, request_id: str) -> None:
        """Abort a request, a dispatch waiting on its grammar included."""
        self.compiling.pop(request_id, None)
        super()._abort(request_id)  # type: ignore[misc]

    def _compile_first(self, message: protocol.ControlMessage) -> bool:
        """Start compiling the dispatch's structured output on the compiler thread when it is
        not compiled yet; True: the dispatch waits for it in `compiling`."""
        params = getattr(message, "params", None)
        so = getattr(params, "structured_output", None)
        grammars = self.engine.grammars
        if so is None or grammars.is_compiled(so):
            return False
        if self._compiler is None:
            self._compiler = compiler_thread()
        rid = message.request_id  # type: ignore[union-attr]
        self.compiling[rid] = (self._compiler.submit(_compile, grammars, so), message)
        return True

    def _handle_compiled(self) -> None:
        """Handle each dispatch whose grammar is compiled (or cached as an error); those ready
        together, in the order they came."""
        for rid, (future, message) in list(self.compiling.items()):
            if future.done():
                del self.compiling[rid]
                if not self._fetch_first(message):
                    self.handle(message)

    def _compiling_load(self) -> tuple[int, int]:
        """(dispatches waiting on their grammar, prompt tokens this worker will prefill for them)
        for its heartbeat: they are not in the engine yet but wait as its queue does (a dispatch
        waiting on a peer fetch counts there already, through its reserved blocks). A decode
        worker's reservation is prefilled elsewhere, so its prompt is not counted."""
        waiting = [message for _, message in list(self.compiling.values())]
        tokens = sum(
            len(m.prompt_token_ids) for m in waiting if not isinstance(m, protocol.Reserve)
        )
        return len(waiting), tokens

    @contextmanager
    def _core_for_compiles(self) -> Iterator[None]:
        """Around a step: while a compile runs, a CPU engine of several threads steps on one
        fewer, so that the compile has a core of its own (on as many threads as cores, a step's
        parallel regions waited for a thread the compile had pushed off its core)."""
        threads = torch.get_num_threads()
        if (
            threads < 2
            or not self.compiling
            or self.engine.runner.device.type != "cpu"
            or all(future.done() for future, _ in self.compiling.values())
        ):
            yield
            return
        torch.set_num_threads(threads - 1)
        try:
            yield
        finally:  # the lent cores' count, where the step handed some back (runtime.cores)
            cores = getattr(self, "cores", None)
            torch.set_num_threads(threads if cores is None else cores.threads)

    def _close_compiler(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)


def _compile(grammars: GrammarCompiler, so: StructuredOutput) -> None:
    """Compile `so` into the engine's cache (a bad spec is cached as its error: the dispatch's
    `add_request` raises it)."""
    try:
        grammars.compile(so)
    except ValueError:
        pass
