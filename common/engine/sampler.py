"""The sampler: turns a step's logits into next tokens (min_tokens, logit_bias, penalties,
temperature, top-k, top-p, min-p, per-request seeds, logprobs).

The engine (prefill and decode workers) builds one `SamplingState` per running sequence each step
and calls `Sampler()(logits, states)`. Semantics follow vLLM v1: logprobs come from the raw model
logits, penalties act on logits before temperature, and a seeded request draws only from its own
generator, so its tokens do not depend on what else is in the batch.

A state costs the same at any context length: it holds a count of output tokens, and, only for a
request with penalties, the sequence's `TokenHistory` (its distinct prompt and output tokens and
output counts), which the engine brings up to date with the step's new tokens, never rebuilding it.

Truncation (top-k, top-p, min-p) is done in logit space as one per-row cutoff: a token survives when
its scaled logit is >= the cutoff, so ties at the cutoff all survive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.engine.grammar import refused_tokens
from common.engine.penalties import TokenHistory, apply_penalties
from common.kernels import cpu_ops
from common.sampling_params import SamplingParams

# Top-p first looks for the nucleus among this many best tokens; rows whose nucleus is larger fall
# back to a full sort of the vocabulary (about 50x slower per row).
TOP_P_CANDIDATES = 1024
_NEG_INF = torch.tensor(-math.inf)


@dataclass
class SamplingState:
    """One running sequence's view of sampling, built by the engine each step (O(1) to build)."""

    params: SamplingParams
    num_output_tokens: int  # generated so far, excluding the token being sampled now
    generator: torch.Generator | None  # make_generator(params), reused every step of the request
    eos_token_ids: frozenset[int] = frozenset()
    history: TokenHistory | None = None  # required when params.has_penalties
    extra_output_ids: Sequence[int] = ()  # output past `history` (draft tokens being verified)
    # structured output: the allowed next tokens, one bit per id (GrammarMatcher.bitmask)
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def from_tokens(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        generator: torch.Generator | None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingState:
        """A state for a one-off call (tests, tools); the engine keeps histories instead."""
        history = None
        if params.has_penalties:
            history = TokenHistory(prompt_token_ids)
            history.extend(output_token_ids)
        return cls(params, len(output_token_ids), generator, eos_token_ids, history)

    def seen_ids(self) -> np.ndarray:
        seen = self._history().seen_ids
        if self.extra_output_ids:  # a token already seen may repeat: the scatter writes it twice
            seen = np.concatenate([seen, np.asarray(self.extra_output_ids, dtype=np.int64)])
        return seen

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, occurrences); an id may repeat, each entry counting its occurrences."""
        history = self._history()
        ids, counts = history.output_ids, history.output_counts
        if self.extra_output_ids:
            extra = np.asarray(self.extra_output_ids, dtype=np.int64)
            ids = np.concatenate([ids, extra])
            counts = np.concatenate([counts, np.ones(len(extra), dtype=np.float32)])
        return ids, counts

    def _history(self) -> TokenHistory:
        if self.history is None:
            raise ValueError("a request with penalties needs its TokenHistory")
        return self.history


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # raw logprob of token_id; None unless params.logprobs is set
    top_logprobs: list[tuple[int, float]] | None  # params.logprobs best alternatives, best first


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The per-request generator for a seeded request (create once, reuse every step)."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


def generator_state(generator: torch.Generator | None) -> bytes:
    """A seeded request's RNG state as bytes, to travel with the prefill/decode handoff."""
    return b"" if generator is None else generator.get_state().numpy().tobytes()


def restore_generator(generator: torch.Generator, state: bytes) -> None:
    """Set `generator` to a state from `generator_state`; a state of the wrong size is an error."""
    expected = generator.get_state().numel()
    if len(state) != expected:
        raise ValueError(f"generator state of {len(state)} bytes, expected {expected}")
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


@dataclass
class _RawLogprobs:
    rows: list[int]  # batch rows that asked for logprobs
    lse: torch.Tensor  # [len(rows)] logsumexp of each row's raw float32 logits
    top: list[list[tuple[int, float]]]  # per row, its params.logprobs best (token, logprob)


class Sampler:
    """Holds no per-request state (that lives in SamplingState), only reusable scratch buffers."""

    def __init__(self) -> None:
        # Reused across steps: a fresh [256, 152k] float32 tensor costs more in page faults than
        # the elementwise pass that fills it.
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleResult]:
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        blocked = [_min_tokens_blocked(s) for s in states]
        needs_processing = _needs_processing(states, blocked)
        wants_logprobs = any(s.params.logprobs is not None for s in states)
        if all(s.params.greedy for s in states) and not needs_processing and not wants_logprobs:
            # Fast path, the common all-greedy decode batch: one argmax (exact in any dtype).
            return [SampleResult(t, None, None) for t in _argmax(logits)]

        x = self._buffer("logits", logits.shape, logits.device)
        refused = _grammar_refusals(states, logits.shape[1], logits.device)
        if refused is not None and not wants_logprobs and logits.dtype == x.dtype:
            torch.where(refused, _NEG_INF, logits, out=x)  # copy and mask in one pass
            refused = None
        else:
            x.copy_(logits)
        scratch = self._buffer("scratch", logits.shape, logits.device)
        raw = _raw_logprobs(x, states, scratch) if wants_logprobs else None
        if needs_processing:
            _mask_min_tokens(x, blocked)
            _add_logit_bias(x, states)
            apply_penalties(x, states)
            if refused is not None:  # after the raw logprobs, which report the model's own
                x.masked_fill_(refused, -math.inf)

        token_ids = [0] * len(states)
        greedy_rows = [i for i, s in enumerate(states) if s.params.greedy]
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if greedy_rows:
            picked = _argmax(_take_rows(x, greedy_rows))
            for i, t in zip(greedy_rows, picked):
                token_ids[i] = t
        if random_rows:
            picked = _sample(_take_rows(x, random_rows), [states[i] for i in random_rows], scratch)
            for i, t in zip(random_rows, picked):
                token_ids[i] = t
        return _results(logits, token_ids, states, raw)

    def greedy_picks(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int] | None:
        """Each row's argmax of the raw logits where every row is greedy and nothing changes
        its scores (no min_tokens mask, logit bias, penalty or grammar mask): the tokens
        process_logits(...).max() would give, without its float32 copy. None otherwise."""
        if not all(s.params.greedy for s in states):
            return None
        if _needs_processing(states, [_min_tokens_blocked(s) for s in states]):
            return None
        return _argmax(logits)

    def process_logits(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """The float32 scores each row's token is drawn from, as a new tensor.

        min_tokens masking, logit_bias and penalties for every row; for random rows also
        temperature and top-k/top-p/min-p (dropped tokens at -inf). A greedy row's token is the
        argmax, a random row's distribution is the softmax: what speculative decoding verifies
        drafts against.
        """
        x = logits.float().clone()
        blocked = [_min_tokens_blocked(s) for s in states]
        if any(blocked) or any(s.params.has_penalties or s.params.logit_bias for s in states):
            _mask_min_tokens(x, blocked)
            _add_logit_bias(x, states)
            apply_penalties(x, states)
        refused = _grammar_refusals(states, x.shape[1], x.device)
        if refused is not None:
            x.masked_fill_(refused, -math.inf)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            scratch = self._buffer("scratch", logits.shape, logits.device)
            sub = _take_rows(x, random_rows)
            _scale_and_truncate(sub, [states[i].params for i in random_rows], scratch)
            if sub is not x:
                x[torch.tensor(random_rows, device=x.device)] = sub
        return x

    def _buffer(self, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
        rows, vocab = shape
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab or buf.device != device:
            keep = buf.shape[0] if buf is not None and buf.shape[1] == vocab else 0
            buf = torch.empty(max(rows, keep), vocab, dtype=torch.float32, device=device)
            self._buffers[name] = buf
        return buf[:rows]


def _needs_processing(states: list[SamplingState], blocked: list[list[int]]) -> bool:
    """Whether any row's scores differ from its logits: min_tokens, penalties, bias, grammar."""
    return (
        any(blocked)
        or any(s.params.has_penalties or s.params.logit_bias for s in states)
        or any(s.token_bitmask is not None for s in states)
    )


def _sample(x: torch.Tensor, states: list[SamplingState], scratch: torch.Tensor) -> list[int]:
    """Random sampling; x [R, V] is float32, owned by the sampler and overwritten."""
    _scale_and_truncate(x, [s.params for s in states], scratch)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i.
    # In log space that is argmax(logit_i - log E_i), with E = -log U, U ~ Uniform[0, 1): no
    # softmax, and U = 0 gives E = inf, which can only lose (never a NaN).
    noise = scratch[: x.shape[0]]
    noise.uniform_()  # one batched draw for the unseeded rows; seeded rows are redrawn below
    for i, s in enumerate(states):
        if s.generator is not None:
            if s.generator.device == noise.device:
                noise[i].uniform_(generator=s.generator)
            else:
                noise[i].copy_(torch.rand(x.shape[1], generator=s.generator))
    noise.log_().neg_().log_()
    return _argmax(x.sub_(noise))


def _scale_and_truncate(
    x: torch.Tensor, params: list[SamplingParams], scratch: torch.Tensor
) -> None:
    """Temperature, then top-k/top-p/min-p as -inf, in place on x [R, V] (float32)."""
    x.div_(_column([p.temperature for p in params], x))
    cutoff = _truncation_cutoffs(x, params, scratch)
    cut_rows = torch.isfinite(cutoff.squeeze(1)).nonzero().squeeze(1)
    if len(cut_rows) == len(params):
        x.masked_fill_(x < cutoff, -math.inf)
    elif len(cut_rows) > 0:
        sub = x[cut_rows]
        x[cut_rows] = sub.masked_fill_(sub < cutoff[cut_rows], -math.inf)


def _min_tokens_blocked(state: SamplingState) -> list[int]:
    """Token ids that must not be sampled yet because min_tokens is not reached."""
    p = state.params
    if state.num_output_tokens >= p.min_tokens:
        return []
    # With ignore_eos the eos ids are not stops, so (as in vLLM) they are not masked.
    blocked = set(p.stop_token_ids)
    if not p.ignore_eos:
        blocked |= state.eos_token_ids
    return sorted(blocked)


def _mask_min_tokens(x: torch.Tensor, blocked: list[list[int]]) -> None:
    vocab = x.shape[1]
    rows = [i for i, ids in enumerate(blocked) for t in ids if t < vocab]
    cols = [t for ids in blocked for t in ids if t < vocab]
    if rows:
        x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = -math.inf


def _add_logit_bias(x: torch.Tensor, states: list[SamplingState]) -> None:
    """Each row's logit_bias added to its logits, in place (one scatter for the batch); ids past
    the logits' width are ignored (the router refuses ids outside the vocabulary)."""
    vocab = x.shape[1]
    rows, cols, biases = [], [], []
    for i, s in enumerate(states):
        for token_id, bias in (s.params.logit_bias or {}).items():
            if token_id < vocab:
                rows.append(i)
                cols.append(token_id)
                biases.append(bias)
    if rows:
        index = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
        x.index_put_(index, torch.tensor(biases, dtype=x.dtype, device=x.device), accumulate=True)


def _grammar_refusals(
    states: list[SamplingState], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Bool [R, V]: the tokens each row's structured-output grammar refuses (None: no row has a
    grammar). Applied before temperature and truncation, so top-k/top-p pick among allowed tokens;
    a model's padded vocabulary beyond the tokenizer is refused too."""
    rows = [i for i, s in enumerate(states) if s.token_bitmask is not None]
    if not rows:
        return None
    refused = refused_tokens(torch.stack([states[i].token_bitmask for i in rows]), vocab_size)
    if len(rows) < len(states):
        full = torch.zeros(len(states), vocab_size, dtype=torch.bool)
        full[torch.tensor(rows)] = refused
        refused = full
    return refused.to(device)


def _truncation_cutoffs(
    x: torch.Tensor, params: list[SamplingParams], scratch: torch.Tensor
) -> torch.Tensor:
    """Per-row logit cutoff [R, 1] for top-k, then top-p, then min-p (-inf: keep everything).

    Each filter drops the tokens below some logit, so their composition is the largest cutoff.
    """
    rows, vocab = x.shape
    dev = x.device
    cutoff = torch.full((rows, 1), -math.inf, device=dev)

    k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    k_best = None  # [len(k_rows), max k] best logits, sorted, for top-p on top of top-k
    if k_rows:
        ks = torch.tensor([params[i].top_k for i in k_rows], device=dev)
        k_best = _take_rows(x, k_rows).topk(int(ks.max()), dim=-1).values
        cutoff[k_rows] = k_best.gather(1, (ks - 1)[:, None])
        k_best.masked_fill_(torch.arange(k_best.shape[1], device=dev) >= ks[:, None], -math.inf)

    # Top-p on the distribution left by top-k: the nucleus lies within the top-k survivors.
    pk_rows = [j for j, i in enumerate(k_rows) if params[i].top_p < 1.0]
    if pk_rows:
        best = k_best[pk_rows]
        top_p = _column([params[k_rows[j]].top_p for j in pk_rows], x)
        rows_p = [k_rows[j] for j in pk_rows]
        nucleus, _ = _nucleus_cutoff(best, torch.logsumexp(best, dim=-1, keepdim=True), top_p)
        cutoff[rows_p] = torch.maximum(cutoff[rows_p], nucleus)

    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0 and not 0 < p.top_k < vocab]
    if p_rows:
        sub = _take_rows(x, p_rows)
        lse = _logsumexp(sub, scratch)
        top_p = _column([params[i].top_p for i in p_rows], x)
        best = sub.topk(min(TOP_P_CANDIDATES, vocab), dim=-1).values
        nucleus, covered = _nucleus_cutoff(best, lse, top_p)
        wide = (~covered).nonzero().squeeze(1)
        if best.shape[1] < vocab and len(wide) > 0:
            full = sub[wide].sort(dim=-1, descending=True).values
            nucleus[wide] = _nucleus_cutoff(full, lse[wide], top_p[wide])[0]
        cutoff[p_rows] = nucleus

    m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p). Top-k / top-p never drop
        # the best token and renormalizing keeps ratios, so min-p needs no softmax.
        best_logit = _take_rows(x, m_rows).amax(dim=-1, keepdim=True)
        floor = best_logit + _column([math.log(params[i].min_p) for i in m_rows], x)
        cutoff[m_rows] = torch.maximum(cutoff[m_rows], floor)
    return cutoff


def _nucleus_cutoff(
    best: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cutoff from each row's best logits (sorted descending) and its logsumexp.

    Keeps a token while the probability mass strictly before it is < top_p: the smallest set
    reaching top_p, always including the best token. Returns (cutoff [n, 1], covered [n]);
    covered is False where `best` does not hold the whole nucleus.
    """
    probs = (best - lse).exp()
    mass = probs.cumsum(dim=-1)
    num_kept = ((mass - probs) < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return best.gather(1, num_kept - 1), mass[:, -1] >= top_p.squeeze(1)


def _raw_logprobs(
    x: torch.Tensor, states: list[SamplingState], scratch: torch.Tensor
) -> _RawLogprobs:
    """Logprob normalizers and top alternatives from the raw float32 logits x (before penalties)."""
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    sub = _take_rows(x, rows)
    lse = _logsumexp(sub, scratch).squeeze(1)
    n_max = max(states[i].params.logprobs for i in rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if n_max > 0:
        best = sub.topk(min(n_max, x.shape[1]), dim=-1)
        vals = (best.values - lse[:, None]).tolist()
        ids = best.indices.tolist()
        for j, i in enumerate(rows):
            n = states[i].params.logprobs
            top[j] = list(zip(ids[j][:n], vals[j][:n]))
    return _RawLogprobs(rows, lse, top)


def _results(
    logits: torch.Tensor,
    token_ids: list[int],
    states: list[SamplingState],
    raw: _RawLogprobs | None,
) -> list[SampleResult]:
    results = [SampleResult(t, None, None) for t in token_ids]
    if raw is None:
        return results
    dev = logits.device
    rows = torch.tensor(raw.rows, device=dev)
    chosen = torch.tensor([token_ids[i] for i in raw.rows], device=dev)
    chosen_lp = (logits[rows, chosen].float() - raw.lse).tolist()
    for j, i in enumerate(raw.rows):
        results[i] = SampleResult(token_ids[i], chosen_lp[j], raw.top[j])
    return results


def _logsumexp(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """[R, 1] logsumexp of x's rows; 2x faster than torch.logsumexp, whose temporaries fault in."""
    best = x.amax(dim=-1, keepdim=True)
    shifted = torch.sub(x, best, out=scratch[: x.shape[0]])
    return shifted.exp_().sum(dim=-1, keepdim=True).log_().add_(best)


def _argmax(x: torch.Tensor) -> list[int]:
    if cpu_ops.supports(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1]:
        return cpu_ops.argmax(x)  # the same indices, a vector loop instead of a scalar one
    # max().indices is argmax (first maximum on ties), 4x faster on bf16 CPU tensors (torch 2.13).
    return x.max(dim=-1).indices.tolist()


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows]: x itself (no copy) when rows is every row in order."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]
