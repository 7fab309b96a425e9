"""The engine: requests in, tokens out, one scheduled step at a time.

Owns the live sequences and the stop rules (eos, stop token ids, max_tokens, context length), the
sampling of each step's logits and, with speculative decoding, the verification of drafts and its
bookkeeping: appending the accepted tokens (cut at a stop), rolling the KV of rejected drafts back
and counting drafts. The scheduler decides what runs, the proposer (`common.engine.spec.proposers`)
drafts, the model runner turns rows of tokens into logits, the sampler and the verifier
(`common.engine.spec.verify`) pick the tokens, `common.engine.prompt_logprobs` scores prompts
on the same forward, `common.engine.warm_up` runs the start-up requests. `block_books` audits
where every KV block is.
Used in-process by `pdserve run-batch` and the benchmarks, and inside the prefill/decode workers.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from common.config import EngineConfig
from common.engine import kv_tier, warm_up
from common.engine import prompt_logprobs as scoring
from common.engine.block_manager import BlockBooks, BlockManager
from common.engine.block_pool import BlockPool
from common.engine.grammar import GrammarCompiler
from common.engine.handoff import KVHandoff
from common.engine.sampler import Sampler, SampleResult, make_generator
from common.engine.scheduler import ScheduledSeq, Scheduler
from common.engine.sequence import SequenceState, SequenceStatus
from common.engine.spec.governor import ShadowDrafts, SpeculationGovernor
from common.engine.spec.proposers import NgramProposer, make_proposer
from common.engine.spec.verify import Verifier
from common.engine.step_budget import PrefillBudget
from common.kernels import cpu_quant
from common.kernels.attention import Row
from common.model.model_runner import ModelRunner
from common.prefix_hash import model_salt
from common.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None]
    new_top_logprobs: list[list[tuple[int, float]] | None]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[scoring.PromptLogprob] | None = None  # with the first token, if asked


CPU_SPECULATIVE_MAX_BATCH = 2  # --speculative-disable-by-batch-size's default on a CPU


def config_eos_ids(hf_config) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class Engine(KVHandoff):
    """Continuous-batching generation over a paged, prefix-cached KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config=None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        """Load `config.model` (or use the given HF config and HF-named weights)."""
        config.validate()
        self.config = config
        if hf_config is None or weights is None:
            from common.model.model_files import resolve_model
            from common.model.weights import iter_weights

            source = resolve_model(config.model)
            hf_config, weights = source.hf_config, iter_weights(source)
        self.hf_config = hf_config
        eos = config_eos_ids(hf_config) if eos_token_ids is None else frozenset(eos_token_ids)
        self.eos_token_ids = eos
        self.runner = ModelRunner(config, hf_config, weights)
        self.max_model_len = self.runner.max_model_len
        self.pool = BlockPool(self.runner.num_blocks, config.block_size)
        kv_dtype = "" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        salt = model_salt(str(config.model), config.dtype, config.block_size, kv_dtype)
        self.block_manager = BlockManager(self.pool, salt, config.enable_prefix_caching)
        # blocks the cache evicts fall to host RAM / disk (--kv-offload-*), None when off
        self.tier = kv_tier.attach(config, self.runner, self.pool, self.block_manager)
        self.num_prefill_tokens = 0  # tokens computed in prefill (not taken from a cache)
        self.sampler = Sampler()
        runner = self.runner
        self.proposer = make_proposer(
            config, runner.model, runner.draft_model, runner.build_rows, self.eos_token_ids
        )
        # Where the tune picked a float kernel for 1 row and int8 activations for 2+ (their
        # times are close: 0.20 vs 0.20 ms a layer here), a request's output would depend on
        # whether it decodes alone, and a verify step's rows would round otherwise than the
        # decode steps they stand for: one row takes the order of two.
        cpu_quant.set_uniform_rows(True)
        self.verifier = Verifier(self.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            num_lookahead_tokens=config.num_speculative_tokens if self.proposer else 0,
            max_model_len=self.max_model_len,
            speculative_max_batch=self._speculative_max_batch(),
            row_granule=runner.row_granule,  # a cut chunk's step then needs no padding rows
        )
        # prompt tokens per step, from the step costs measured here (--prefill-chunk)
        self.prefill_budget = PrefillBudget.from_flag(
            config.prefill_chunk, config.max_num_batched_tokens
        )
        self.governor = (
            SpeculationGovernor() if self.proposer and config.speculative_adaptive else None
        )
        # n-gram drafts cost nothing to make: while drafting is paused, what they would have
        # gained is watched, and drafting resumes as soon as it would pay
        self.shadow = ShadowDrafts(self._free_draft) if self.governor is not None else None
        self.num_steps = 0  # steps that ran a batch: progress, for the workers' stall checks
        self.num_drafts = 0  # verify rows with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.seqs: dict[str, SequenceState] = {}  # waiting or running
        self.held: dict[str, SequenceState] = {}  # finished, blocks kept until their KV is sent
        self.reserved: dict[str, SequenceState] = {}  # blocks held for KV that is on its way
        self.reserve_refused: OrderedDict[str, None] = OrderedDict()  # see KVHandoff.reserve
        self.vocab_size = int(hf_config.vocab_size)
        # structured outputs: the model's tokenizer is loaded when the first such request comes
        self.grammars = GrammarCompiler.for_model(str(config.model), self.vocab_size)
        self._ids = itertools.count()
        self.check_books_when_idle = False  # tests: audit the blocks whenever the engine idles

    def warm_up(self) -> float:
        """Throwaway requests before the first one (common.engine.warm_up); returns seconds."""
        return warm_up.warm_up(self)

    def _speculative_max_batch(self) -> int:
        """Most running sequences that still draft (0: no limit). On a CPU a verify row costs
        nearly its k+1 tokens of compute, so beyond a couple of sequences drafting only slows the
        batch; a GPU verifies for almost free."""
        limit = self.config.speculative_disable_by_batch_size
        if limit is None:
            limit = 0 if self.runner.device.type == "cuda" else CPU_SPECULATIVE_MAX_BATCH
        return limit

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_blocks: bool = False,
        num_output_tokens: int = 0,
    ) -> None:
        """Queue a request; ValueError for a bad prompt or parameters (nothing is queued then).

        With `hold_blocks` the finished sequence keeps its KV blocks (see `held`) until `release`.
        `num_output_tokens`: the last that many of `prompt_token_ids` are output already produced
        elsewhere (a migrated request): it goes on from there as if it had produced them here.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if num_output_tokens:
            self._resume(seq, num_output_tokens)
        seq.hold_blocks = hold_blocks
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> SequenceState:
        """A validated new sequence (ValueError naming the problem otherwise)."""
        self._check_new(request_id, prompt_token_ids, params)
        seq = SequenceState(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            generator=make_generator(params),
        )
        if params.structured_output is not None:
            seq.grammar = self.grammars.matcher(params.structured_output)  # ValueError if bad
        return seq

    def _resume(self, seq: SequenceState, num_output_tokens: int) -> None:
        """Make the last `num_output_tokens` of `seq`'s tokens output: the stop rules, penalties
        and grammar count them, and a seeded generator is where it was after drawing them (one
        row of noise per sampled token, as the sampler draws without speculation)."""
        if not 0 < num_output_tokens < seq.num_tokens:
            raise ValueError(f"num_output_tokens must be in [0, {seq.num_tokens})")
        seq.num_prompt_tokens = seq.num_tokens - num_output_tokens
        if seq.num_output_tokens >= seq.params.max_tokens:
            raise ValueError("the request already produced max_tokens tokens")
        if seq.generator is not None and seq.params.temperature > 0:
            for _ in range(num_output_tokens):
                torch.rand(self.vocab_size, generator=seq.generator, device=seq.generator.device)
        if seq.grammar is not None:
            seq.grammar.sync(seq.token_ids, seq.num_prompt_tokens)

    def _check_new(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        params.validate()
        if request_id in self.seqs or request_id in self.held or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens including at least one output token"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if params.prompt_logprobs is not None:
            scoring.check_prompt_length(len(prompt_token_ids))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it is not here."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        else:
            seq = self.held.pop(request_id, None) or self.reserved.pop(request_id, None)
            if seq is None:
                return False
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"
        return True

    def release(self, request_id: str) -> bool:
        """Free a held sequence's blocks once its KV has been sent (or the transfer ended)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; report each sequence that got a token."""
        governor = self.governor
        num_running = len(self.scheduler.running)
        if governor is not None:
            k = self.config.num_speculative_tokens
            governor.steer(self.scheduler, num_running, k, k + 1 in self.runner.graphs)
        start = time.perf_counter()
        self.scheduler.prefill_budget = self.prefill_budget.tokens()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.num_steps += 1
        num_prefill = kv_tier.prefill_tokens(batch)  # before the step advances the sequences
        # the fit of prompt steps sees prompt tokens only: a verify step's drafts ride along like
        # decode rows (counted as prompt tokens, verify steps made the chunk 16 tokens)
        prompt_tokens, decode_rows = num_prefill, len(batch)
        outputs = self._step(batch)
        self.num_prefill_tokens += num_prefill
        if self.tier is not None:  # the prefill rate the tier weighs reloads against
            self.tier.costs.record_step(num_prefill, sum(i.num_new_tokens for i in batch), start)
        self.prefill_budget.costs.record(prompt_tokens, decode_rows, time.perf_counter() - start)
        if governor is not None and all(item.num_new_tokens == 1 for item in batch):
            governor.record_step(num_running, batch, outputs, time.perf_counter() - start)
            if self.shadow is not None:
                self.shadow.watch(governor, num_running, outputs, self.seqs)
        if self.check_books_when_idle and not self.has_unfinished():
            books = self.block_books()
            if books.errors:
                raise RuntimeError(f"the KV block books do not balance: {books}")
        return outputs

    def _free_draft(self, token_ids: list[int]) -> list[int]:
        """What the proposer would draft after `token_ids`, where that costs nothing (n-gram)."""
        if not isinstance(self.proposer, NgramProposer):
            return []
        return self.proposer.draft(token_ids, self.config.num_speculative_tokens)

    def _step(self, batch: list[ScheduledSeq]) -> list[RequestOutput]:
        """Draft, run the model over the batch's rows, sample or verify, keep what was kept."""
        if self.proposer is not None:
            drafting = [item for item in batch if item.num_lookahead_tokens]
            if drafting:
                self.proposer.propose(drafting)
        rows: list[Row] = []
        num_logits: list[int] = []  # per row: 0 (a prefill chunk), 1 (sample) or k+1 (verify)
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            tokens = seq.token_ids[start : start + item.num_new_tokens] + item.draft_token_ids
            rows.append((tokens, start, seq.block_table))
            at_end = start + item.num_new_tokens == seq.num_tokens
            num_logits.append(len(item.draft_token_ids) + 1 if at_end else 0)
        logits = scoring.run_and_score(self.runner, batch, rows, num_logits)
        results = self.verifier.pick_tokens(self.sampler, batch, logits, num_logits)
        outputs = []
        for item, samples in zip(batch, results):
            seq = item.seq
            num_drafts = len(item.draft_token_ids)
            if not num_drafts:
                seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.commit(seq)
                if item.num_lookahead_tokens:
                    self.block_manager.trim(seq)  # slots reserved for drafts that never came
                if samples:
                    outputs.append(self._append_tokens(seq, samples))
                continue
            num_accepted = len(samples) - 1
            if self.governor is not None:
                self.governor.verified(num_drafts, num_accepted)
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            # KV is valid up to the last accepted draft (the new token's is computed next step)
            computed = seq.num_computed_tokens + item.num_new_tokens + num_accepted
            outputs.append(self._append_tokens(seq, samples))
            if seq.is_finished and seq.request_id not in self.held:
                continue  # its blocks are already freed
            seq.num_computed_tokens = min(computed, seq.num_tokens - 1)
            self.block_manager.commit(seq)  # only computed, accepted tokens' blocks
            self.block_manager.trim(seq)  # the slots of rejected drafts
            seq.num_draft_computed_tokens = min(
                seq.num_draft_computed_tokens, seq.num_computed_tokens
            )
        return outputs

    def _append_tokens(self, seq: SequenceState, samples: list[SampleResult]) -> RequestOutput:
        """Append a step's tokens (one, or a verify step's accepted run), stopping at the first
        that finishes the sequence."""
        reason = None
        kept = []
        handed = seq.prompt_logprobs if seq.scores_prompt else None  # with the first token only
        for sample in samples:
            seq.token_ids.append(sample.token_id)
            seq.output_logprobs.append(sample.logprob)
            seq.output_top_logprobs.append(sample.top_logprobs)
            kept.append(sample)
            reason = self._finish_reason(seq, sample.token_id)
            if reason is not None:
                self._finish(seq, reason)
                break
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[s.token_id for s in kept],
            new_logprobs=[s.logprob for s in kept],
            new_top_logprobs=[s.top_logprobs for s in kept],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=handed,
        )

    def _finish(self, seq: SequenceState, reason: str) -> None:
        seq.finish_reason = reason
        del self.seqs[seq.request_id]
        if seq.hold_blocks:
            if seq in self.scheduler.running:
                self.scheduler.running.remove(seq)
            else:
                self.scheduler.waiting.remove(seq)
            self.held[seq.request_id] = seq
        else:
            self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _finish_reason(self, seq: SequenceState, token: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.sync(seq.token_ids, seq.num_prompt_tokens):
            return "stop"  # the structured output is complete: only the end may follow
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[SequenceState]:
        """Run prompts to completion; returns their finished sequences in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = []
        for prompt, p in zip(prompts, params_list):
            rid = f"generate-{next(self._ids)}"
            self.add_request(rid, prompt, p)
            seqs.append(self.seqs[rid])
        while any(not s.is_finished for s in seqs):
            self.step()
        return seqs

    def block_books(self) -> BlockBooks:
        """Where every KV block is (free, cached, running, reserved, held) and what does not add
        up; call between steps. Tests run it whenever the engine idles; workers on request."""
        scheduled = [*self.scheduler.running, *self.scheduler.waiting]
        books = self.block_manager.check_books(
            {"running": scheduled, "reserved": self.reserved.values(), "held": self.held.values()}
        )
        if {s.request_id for s in scheduled} != set(self.seqs):
            books.errors.append("the scheduler's sequences are not the engine's live ones")
        return books

    def stats(self) -> dict[str, float]:
        """Counters and gauges for metrics and tests."""
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": self.pool.usage(),
            "num_free_blocks": self.pool.num_free,
            "num_blocks": self.pool.num_blocks,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "prefix_cache_queries_total": self.pool.query_tokens,
            "prefix_cache_hits_total": self.pool.hit_tokens,
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "kv_cache_bytes_per_token": self.runner.kv_bytes_per_token,
            "prefill_kv_computed_tokens_total": self.num_prefill_tokens,
            **(self.tier.stats() if self.tier is not None else {}),
        }
