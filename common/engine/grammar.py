"""Structured outputs: grammars compiled from a request's `StructuredOutput` and the per-sequence
matchers that say which tokens may come next.

Built on llguidance (a Rust grammar engine with no Python dependencies; its matchers compute a
token bitmask per step in tens of microseconds and roll back consumed tokens, which speculative
decoding needs). Owns:
- `grammar_text`: a StructuredOutput as llguidance grammar text (JSON schema, regex, choice, Lark
  or GBNF);
- `GrammarCompiler`: per tokenizer, compiles each (kind, spec) once into a prototype matcher kept
  in a bounded LRU (bad specs are cached too, as their error) and hands out copies;
- `GrammarMatcher`: one sequence's matcher (`SequenceState.grammar`). It follows the sequence's
  output tokens by count (`sync`), so a preempted and recomputed sequence, whose output tokens
  stay, never feeds a token twice, and a decode worker that receives the prefill worker's first
  token consumes it like any other;
- `check_structured_output`: the router's check before dispatch (a ValueError naming the
  unsupported feature becomes a 400). It validates without the tokenizer where the grammar names
  no token (every JSON schema, regex and choice): building llguidance's tokenizer holds the GIL
  for 0.3-1 s, which would stall the router's event loop, and costs its memory;
- `compiler_thread`: the thread a worker compiles new grammars on, off its loop
  (common.runtime.worker_grammar `_compile_first`).

The engine creates matchers (`Engine._new_sequence`) and advances them as tokens are appended; the
verifier (`common.engine.spec.verify`) asks for bitmasks, also after draft tokens; the sampler
(`common.engine.sampler`) applies them to the logits.
"""

from __future__ import annotations

import json
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from common.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import torch

assert sys.byteorder == "little", "refused_tokens reads bitmask words as little-endian"
MAX_CACHED_GRAMMARS = 256
# llguidance's warning for a grammar whose token references it validated without a tokenizer.
NO_TOKENIZER = "no tokenizer"
# Fixed separators and no free whitespace: a model that may emit whitespace anywhere can pad an
# object until max_tokens; this way every object has exactly one spelling up to its values.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar for `so`; ValueError when the spec text itself is malformed."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    so.validate()
    if so.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object (or true/false)")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if so.kind == "regex":
        return LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices:
            raise ValueError("choice must be a non-empty list of strings")
        if not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        # Lark string literals are JSON strings, so json.dumps escapes them exactly.
        alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
        return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    try:  # "grammar": Lark (llguidance's dialect) or GBNF as llama.cpp and vLLM take it
        return LLMatcher.grammar_from_lark(any_to_lark(so.spec))
    except GbnfToLarkError as e:
        raise ValueError(f"the grammar does not parse: {e}") from None


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer and caches the results (thread-safe).

    `vocab_size` is the model's logits width when known: a padded vocabulary makes it larger than
    the tokenizer's, and bitmasks then cover every column (the padding is never allowed).
    """

    def __init__(
        self,
        hf_tokenizer: Any = None,
        vocab_size: int | None = None,
        max_cached: int = MAX_CACHED_GRAMMARS,
        load_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        """`hf_tokenizer`, or `load_tokenizer` to load it on first use (an engine loads its
        model's tokenizer only when a structured request comes)."""
        self._hf = hf_tokenizer
        self._load = load_tokenizer
        self._vocab_size = vocab_size
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # matcher or ValueError
        self._checked: OrderedDict[tuple[str, str], ValueError | None] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._tokenizer = None
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and the benchmark

    @property
    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use: about a second for a 150k vocabulary)."""
        with self._tokenizer_lock:  # built once even when router threads ask together
            if self._tokenizer is None:
                try:
                    if self._hf is None and self._load is not None:
                        self._hf = self._load()
                    # common.api.tokenizer.Tokenizer or a HF tokenizer
                    hf = getattr(self._hf, "hf", self._hf)
                    n_vocab = max(len(hf), self._vocab_size or 0)
                    self._tokenizer = _ll_tokenizer(hf, n_vocab)
                except Exception as e:  # the request fails, not the worker
                    raise ValueError(f"structured outputs need the model's tokenizer: {e}") from e
        return self._tokenizer

    @property
    def tokenizer_built(self) -> bool:
        """Whether `ll_tokenizer` has been built (the router's checks mostly never need it)."""
        return self._tokenizer is not None

    @classmethod
    def for_model(cls, model: str, vocab_size: int) -> GrammarCompiler:
        """A compiler for the tokenizer of `model` (a name or path as `resolve_model` takes it),
        loaded on first use."""

        def load() -> Any:
            from transformers import AutoTokenizer

            from common.model.model_files import resolve_model

            return AutoTokenizer.from_pretrained(resolve_model(model).hf_dir)

        return cls(vocab_size=vocab_size, load_tokenizer=load)

    def compile(self, so: StructuredOutput) -> Any:
        """The prototype matcher of `so` (never advance it: `matcher` copies it); ValueError
        naming what is wrong or unsupported."""
        key = (so.kind, so.spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._compile(so)
            with self._lock:
                self._cache[key] = cached
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
        if isinstance(cached, ValueError):
            raise ValueError(str(cached))
        return cached

    def _compile(self, so: StructuredOutput) -> Any:
        from llguidance import LLMatcher

        self.num_compiled += 1
        try:
            text = grammar_text(so)
        except ValueError as e:
            return e
        tokenizer = self.ll_tokenizer
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            return ValueError(f"unsupported {_kind_name(so.kind)}: {'; '.join(messages)}")
        matcher = LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            return ValueError(f"unsupported {_kind_name(so.kind)}: {matcher.get_error()}")
        return matcher

    def is_compiled(self, so: StructuredOutput) -> bool:
        """Whether `compile(so)` would answer from the cache (a matcher or a cached error)."""
        with self._lock:
            return (so.kind, so.spec) in self._cache

    def check(self, so: StructuredOutput) -> None:
        """ValueError as `compile`, without building the tokenizer unless the grammar names
        tokens (`<|special|>`, `<[id]>`): only those need it to be validated. Cached."""
        key = (so.kind, so.spec)
        with self._lock:
            found = key in self._checked
            error = self._checked.get(key)
            if found:
                self._checked.move_to_end(key)
        if not found:
            error = self._check(so)
            with self._lock:
                self._checked[key] = error
                while len(self._checked) > self._max_cached:
                    self._checked.popitem(last=False)
        if error is not None:
            raise ValueError(str(error))

    def _check(self, so: StructuredOutput) -> ValueError | None:
        from llguidance import LLMatcher

        try:
            text = grammar_text(so)
        except ValueError as e:
            return e
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, None)
        if is_error:
            return ValueError(f"unsupported {_kind_name(so.kind)}: {'; '.join(messages)}")
        if any(NO_TOKENIZER in m for m in messages):  # token references: only a compile can tell
            try:
                self.compile(so)
            except ValueError as e:
                return e
        return None

    def matcher(self, so: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one sequence; ValueError as `compile`."""
        tokenizer = self.ll_tokenizer
        return GrammarMatcher(self.compile(so).deep_copy(), tokenizer.vocab_size)


def _ll_tokenizer(hf: Any, n_vocab: int) -> Any:
    """llguidance's tokenizer of a fast HF tokenizer, as `llguidance.hf.from_tokenizer` builds
    it, less its copy of the tokenizer (0.14 s of the 0.37 it takes on the default model's 49k
    tokens, all holding the interpreter lock) where there is no padding or truncation to drop."""
    from copy import copy

    from llguidance import LLTokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf, PreTrainedTokenizerFast):
        raise ValueError("only fast (Rust) tokenizers are supported")
    backend = hf.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy(backend)  # the serialized tokenizer must neither pad nor truncate
        backend.no_padding()
        backend.no_truncation()
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=hf.eos_token_id)


def _kind_name(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object", "choice": "choice"}.get(kind, kind)


class GrammarMatcher:
    """One sequence's grammar state: which output tokens it has consumed and what may come next."""

    def __init__(self, matcher: Any, num_bits: int) -> None:
        self.matcher = matcher
        self.num_words = (num_bits + 31) // 32  # int32 words in a bitmask
        self.num_consumed = 0  # output tokens consumed so far

    @property
    def failed(self) -> bool:
        """A token the grammar refused was consumed (only when a mask was bypassed)."""
        return self.matcher.is_error()

    @property
    def is_terminated(self) -> bool:
        """Nothing but the end may follow: the sequence stops here (finish_reason "stop")."""
        return self.matcher.is_stopped()

    def sync(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Consume the sequence's output tokens (`token_ids[num_prompt_tokens:]`) past those
        already consumed; True when the grammar is over (complete, or failed). Idempotent: tokens
        already consumed are skipped by count, so recomputing a sequence never feeds them twice."""
        start = num_prompt_tokens + self.num_consumed
        if start < len(token_ids):
            new = token_ids[start:]
            self.num_consumed += len(new)
            self.matcher.consume_tokens(new)
        return self.matcher.is_stopped()

    def bitmask(self) -> torch.Tensor:
        """The allowed next tokens, one bit per token id ([num_words] int32)."""
        import torch  # not at import: the router compiles grammars and loads no torch

        mask = torch.empty(self.num_words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        return mask

    def draft_bitmasks(self, draft_token_ids: list[int]) -> list[torch.Tensor]:
        """Bitmasks at each draft's position and after the last ([k+1] of them).

        Drafts are consumed tentatively and rolled back before returning. A draft the grammar
        refuses gets a mask without it, so verification rejects it; the positions after it can
        never be reached, and repeat its mask so that every row stays a real distribution.
        """
        num_valid = self.matcher.validate_tokens(draft_token_ids)
        masks = []
        for j in range(len(draft_token_ids) + 1):
            if j <= num_valid:
                masks.append(self.bitmask())
                if j < num_valid:
                    self.matcher.consume_token(draft_token_ids[j])
            else:
                masks.append(masks[num_valid])
        if num_valid:
            self.matcher.rollback(num_valid)
        return masks


def refused_tokens(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [R, vocab_size], True where a token is refused, from int32 bitmasks [R, W] of
    allowed tokens (on the CPU, as matchers fill them); columns beyond the masks are refused."""
    import torch

    # Bit i of word w is token 32 w + i: on a little-endian host that is numpy's little-endian
    # bit order over the words' bytes (one pass; shifting int32 words in torch takes five).
    words = np.invert(bitmasks.cpu().numpy())
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    width = bits.shape[1]
    if width >= vocab_size:
        bits = bits[:, :vocab_size]
    else:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - width)), constant_values=1)
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)


def compiler_thread() -> ThreadPoolExecutor:
    """One thread for compiling grammars off a worker's loop: llguidance releases the
    interpreter lock while it compiles, so the loop goes on meanwhile. The thread competes for the
    cores at normal priority. Measured beside a worker's OpenMP threads (default model, 2 threads,
    8 streams decoding through `pdserve up`, a 3,000-property schema new to router and worker):
    the streams' largest token gaps 155-259 ms, among gaps of 7-12 ms. At the idle scheduling
    class (SCHED_IDLE) three runs of five showed none over 94-102 ms, but two had gaps of 553 and
    1,089 ms: an idle thread preempted while it holds the interpreter lock keeps every other
    thread of the process waiting until a core goes idle. So normal priority."""
    return ThreadPoolExecutor(1, thread_name_prefix="grammar")


# The router's compilers, one per tokenizer it serves (weakly keyed: they go with the tokenizer).
_compilers: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any) -> GrammarCompiler:
    """The shared compiler of a tokenizer (common.api.tokenizer.Tokenizer or a HF tokenizer)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


def check_structured_output(so: StructuredOutput, tokenizer: Any) -> None:
    """Raise ValueError naming what is malformed or unsupported in `so` (the router's 400).

    Validates without the tokenizer where it can (`GrammarCompiler.check`) and caches: a schema's
    first call may take milliseconds to (for huge schemas) a second, so call it off the event
    loop. A grammar naming tokens builds the tokenizer on its first call (0.3-1 s holding the GIL).
    """
    compiler_for(tokenizer).check(so)
