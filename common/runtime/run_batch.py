"""`pdserve run-batch`: offline inference over a file in the OpenAI batch format.

Owns reading batch lines (`{"custom_id", "method", "url", "body"}`), driving ONE in-process engine
over all of them at once (continuous batching; lines are admitted as room frees up), applying stop
strings through `common.api.choice.Choice` (the accumulator the router uses too), and writing one
output line per input line, in input order. Request validation comes from `common.api.requests` and
`common.api.prompts`, response bodies from `common.api.responses`; a bad line gets its OpenAI error
body and the rest still run. Called by `common.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from common.api.choice import Choice
from common.api.prompts import choice_params, engine_inputs, tool_call_format
from common.api.requests import GenerationRequest, RequestError, parse_request
from common.api.responses import chat_body, completion_body
from common.api.tokenizer import Tokenizer
from common.engine.engine import Engine, RequestOutput

PROGRESS_INTERVAL_S = 2.0


@dataclass
class _Line:
    """A valid input line while its choices run."""

    custom_id: Any
    request: GenerationRequest
    num_prompt_tokens: int
    choices: list[Choice]
    num_running: int


def parse_line(
    raw: str, served_model_names: list[str], tool_call_parser: str = ""
) -> tuple[Any, GenerationRequest | RequestError]:
    """(custom_id, the validated request or why it is refused) of one input line."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, RequestError(f"the line is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return None, RequestError("a line must be an object with custom_id, method, url, body")
    custom_id = obj.get("custom_id")
    try:
        if not isinstance(custom_id, str):
            raise RequestError("custom_id must be a string", "custom_id")
        method = obj.get("method")
        if method != "POST":
            raise RequestError(f"method must be POST, got {method!r}", "method", 405)
        url = obj.get("url")
        if not isinstance(url, str):
            raise RequestError("url must be a string", "url")
        request = parse_request(url, obj.get("body"), served_model_names, tool_call_parser)
        if request.stream:
            raise RequestError("stream=true is not supported by run-batch", "stream")
    except RequestError as e:
        return custom_id, e
    return custom_id, request


def _output_line(custom_id: Any, status_code: int, body: dict, hex_id: str) -> str:
    return json.dumps(
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": f"req_{hex_id}", "body": body},
            "error": None,
        },
        ensure_ascii=False,
    )


class BatchRunner:
    """Runs batch lines through one engine; see `run`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        served_model_names: list[str],
        tool_call_parser: str = "",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names
        # --tool-call-parser as the chat template allows: hermes or generic
        self.tool_call_parser = tool_call_format(tool_call_parser, tokenizer)
        # Engine requests admitted ahead of the running batch, so the scheduler always has work.
        self.max_in_flight = 2 * engine.config.max_num_seqs
        self._running: dict[str, tuple[int, Choice]] = {}  # engine request id: (line_no, choice)
        self._lines: dict[int, _Line] = {}
        self._ready: dict[int, str] = {}

    def run(
        self, input_lines: Iterable[str], write: Callable[[str], None], log: TextIO | None = None
    ) -> dict[str, float]:
        """Write one output line per non-blank input line, in input order; return totals."""
        lines = [raw for raw in input_lines if raw.strip()]
        pending = iter(enumerate(lines))
        next_out, num_tokens, num_errors = 0, 0, 0
        start = last_log = time.monotonic()
        exhausted = False
        while True:
            while not exhausted and len(self._running) < self.max_in_flight:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                num_errors += not self._admit(*item)
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    num_tokens += self._on_output(out)
            while next_out in self._ready:
                write(self._ready.pop(next_out))
                next_out += 1
            now = time.monotonic()
            done_all = exhausted and not self.engine.has_unfinished() and not self._running
            if log is not None and (done_all or now - last_log >= PROGRESS_INTERVAL_S):
                last_log = now
                print(
                    f"run-batch: {next_out}/{len(lines)} done, "
                    f"{num_tokens / max(now - start, 1e-9):.1f} tok/s",
                    file=log,
                    flush=True,
                )
            if done_all:
                break
        assert next_out == len(lines), "every line gets an output line"
        elapsed = time.monotonic() - start
        return {
            "num_lines": len(lines),
            "num_errors": num_errors,
            "num_generated_tokens": num_tokens,
            "elapsed_s": elapsed,
        }

    def _admit(self, line_no: int, raw: str) -> bool:
        """Parse, tokenize and queue one line; on error its error line is ready at once."""
        custom_id, request = parse_line(raw, self.served_model_names, self.tool_call_parser)
        if isinstance(request, RequestError):
            self._fail(line_no, custom_id, request)
            return False
        added: list[str] = []
        try:
            inputs = engine_inputs(request, self.tokenizer, self.engine.max_model_len)
            choices = []
            for p, inp in enumerate(inputs):
                for k, params in enumerate(choice_params(inp.params, request.n)):
                    index = p * request.n + k
                    choice = Choice(index, inp.prompt_token_ids, params, request, self.tokenizer)
                    request_id = f"batch-{line_no}-{choice.index}"
                    try:
                        self.engine.add_request(request_id, inp.prompt_token_ids, params)
                    except ValueError as e:
                        raise RequestError(str(e)) from None
                    added.append(request_id)
                    choices.append(choice)
        except RequestError as e:
            for request_id in added:
                self.engine.abort(request_id)
            self._fail(line_no, custom_id, e)
            return False
        for request_id, choice in zip(added, choices):
            self._running[request_id] = (line_no, choice)
        self._lines[line_no] = _Line(
            custom_id=custom_id,
            request=request,
            num_prompt_tokens=sum(len(inp.prompt_token_ids) for inp in inputs),
            choices=choices,
            num_running=len(choices),
        )
        return True

    def _fail(self, line_no: int, custom_id: Any, error: RequestError) -> None:
        self._ready[line_no] = _output_line(custom_id, error.code, error.body(), uuid.uuid4().hex)

    def _on_output(self, out: RequestOutput) -> int:
        """Apply one engine output to its choice; returns the number of tokens it carried."""
        line_no, choice = self._running[out.request_id]
        choice.add(
            out.new_token_ids,
            out.new_logprobs,
            out.new_top_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_logprobs=out.prompt_logprobs,
        )
        if not choice.done:
            return len(out.new_token_ids)
        if not out.finished:
            self.engine.abort(out.request_id)  # a stop string cut it short
        del self._running[out.request_id]
        line = self._lines[line_no]
        line.num_running -= 1
        if line.num_running == 0:
            self._finish_line(line_no)
        return len(out.new_token_ids)

    def _finish_line(self, line_no: int) -> None:
        line = self._lines.pop(line_no)
        hex_id = uuid.uuid4().hex
        chat = line.request.endpoint == "chat"
        build, prefix = (chat_body, "chatcmpl") if chat else (completion_body, "cmpl")
        body = build(
            line.request,
            [c.result() for c in line.choices],
            self.tokenizer,
            line.num_prompt_tokens,
            request_id=f"{prefix}-{hex_id}",
        )
        self._ready[line_no] = _output_line(line.custom_id, 200, body, hex_id)


def run_batch_command(args: argparse.Namespace) -> int:
    """`pdserve run-batch`: load the model once, run the input file, write the output file."""
    from common.config import config_from_args
    from common.model.model_files import resolve_model
    from common.model.weights import iter_weights
    from common.runtime import omp_spin
    from common.runtime.malloc import keep_step_buffers
    from common.runtime.worker_cli import seed_generators

    config = config_from_args(args)
    served = args.served_model_name or [args.model]
    source = resolve_model(config.model)
    tokenizer = Tokenizer.from_source(source)
    engine = Engine(
        config, source.hf_config, iter_weights(source), eos_token_ids=tokenizer.eos_token_ids
    )
    if engine.runner.device.type == "cpu":
        keep_step_buffers()
    if spin := omp_spin.describe():
        print(f"run-batch: {spin}", file=sys.stderr)
    if config.warm_up:
        engine.warm_up()
    seed_generators(config.seed)  # unseeded sampled requests: same --seed, same output file
    if args.input_file == "-":
        input_lines = sys.stdin.read().splitlines()
    else:
        with open(args.input_file, encoding="utf-8") as f:
            input_lines = f.read().splitlines()
    runner = BatchRunner(engine, tokenizer, served, getattr(args, "tool_call_parser", ""))
    out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    try:

        def write(line: str) -> None:
            out.write(line + "\n")
            out.flush()

        totals = runner.run(input_lines, write, log=sys.stderr)
    finally:
        if out is not sys.stdout:
            out.close()
    print(
        f"run-batch: {totals['num_lines']} lines ({totals['num_errors']} errors), "
        f"{totals['num_generated_tokens']} tokens in {totals['elapsed_s']:.1f} s",
        file=sys.stderr,
    )
    return 0
