"""Prefixes fetched from peers: a worker missing a prompt's leading blocks that another live worker
holds (in its cache or its KV tier) pulls them over kvtransfer instead of computing them.

The router names the peer in the dispatch (`PeerHint` in `Prefill`). Two halves, both driven
from the workers' loops (`common.runtime.worker.WorkerBase`), never blocking them:
- the asker, `PeerFetcher`: decides whether the fetch pays (the measured seconds per byte of its
  earlier fetches against the measured seconds per prompt token of the engine's own steps, the
  fit `common.engine.step_budget.StepCosts` keeps; either unmeasured: fetch, which measures it),
  holds new blocks for the missing run (a placeholder sequence in `engine.reserved`, so the block
  books count them), sends `KVFetch` to the peer's kv socket and waits for the peer's push on its
  own receiver. The pushed blocks are written and checked by `kvtransfer.receiver` like any
  transfer, then registered in the prefix cache under their keys; the request then runs as usual
  and finds them there. A refusal, a damaged payload or no answer within the hint's timeout
  (the peer is stuck, or its host went away) frees the blocks, and the request computes its
  prompt itself: a fetch never fails a request. A peer process that dies is noticed sooner: its
  connection is lost (`KVSender.peer_down`), and the fetch ends on the next turn. After no
  answer the socket to that peer is closed too (a dead peer's socket would keep the fetch
  queued and stay in the sender's map). The placeholder keeps
  the fetched blocks pinned until the request's own sequence has taken them.
- the peer: `kvtransfer.peer_serve.FetchServer` answers, a bounded slice a turn.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.engine.sequence import SequenceState
from common.prefix_hash import block_keys
from common.protocol import MAX_FETCH_BLOCKS, MAX_FETCH_TOKENS, KVFetch, KVHeader, PeerHint, encode
from common.sampling_params import SamplingParams
from kvtransfer import payload
from kvtransfer.receiver import ReceivedKV
from kvtransfer.sender import KVSender, TransferResult

log = logging.getLogger(__name__)

FETCH_ID_PREFIX = "peer-fetch/"  # the transfer id (and placeholder id) of a request's fetch
MIN_FETCH_BLOCKS = 1  # fewer missing blocks than this are computed, not fetched
_EWMA = 0.3  # weight of each new fetch in the measured transfer rate


def fetch_id(request_id: str) -> str:
    return FETCH_ID_PREFIX + request_id


def is_fetch_id(transfer_id: str) -> bool:
    return transfer_id.startswith(FETCH_ID_PREFIX)


@dataclass
class _Fetch:
    request_id: str
    # In engine.reserved under the fetch id: the leading blocks the engine holds itself (pinned,
    # so that allocating the others cannot evict them), then the blocks asked for.
    placeholder: SequenceState
    offset: int  # where the blocks asked for start in its block table
    keys: list[bytes]  # of the blocks asked for
    tokens: list[list[int]]  # ... and their tokens
    start_block: int
    peer: str
    kv_address: str
    transport: str
    nbytes: int
    started: float
    deadline: float
    arrived: bool = False


class PeerFetcher:
    """The asking side of peer fetches for one worker's engine (see the module docstring)."""

    def __init__(self, engine, sender: KVSender, reply_address: str) -> None:
        self.engine = engine
        self.sender = sender
        self.reply_address = reply_address
        self.bytes_per_s: dict[str, float] = {}  # measured, per transport
        self._fetches: dict[str, _Fetch] = {}  # by fetch id
        self._pinned: dict[str, SequenceState] = {}  # request id -> placeholder, blocks arrived
        self._ended: list[str] = []  # request ids whose fetch ended since the last poll
        self.fetched_tokens = 0  # prompt tokens pulled from peers instead of computed
        self.fetched_bytes = 0
        self.failed = 0  # fetches that ended without blocks (timeout, refusal, damage)
        self.declined = 0  # hints not followed: computing measured cheaper

    # ---- starting ------------------------------------------------------------------------------

    def start(
        self, request_id: str, prompt: list[int], params: SamplingParams, hint: PeerHint
    ) -> bool:
        """Ask `hint`'s peer for the prompt's leading blocks this engine lacks; True while a fetch
        is under way (the caller runs the request after `poll` names it), False to compute now."""
        engine = self.engine
        if not engine.config.enable_prefix_caching or params.prompt_logprobs is not None:
            return False  # the request would not read fetched blocks
        bs = engine.config.block_size
        usable = min(hint.num_blocks, (len(prompt) - 1) // bs)  # one token is always computed
        keys = block_keys(prompt[: usable * bs], bs, engine.block_manager.salt)
        tokens = [prompt[b * bs : (b + 1) * bs] for b in range(usable)]
        start = self._local_run(keys, tokens)
        num = min(usable - start, MAX_FETCH_BLOCKS, MAX_FETCH_TOKENS // bs)  # one KVFetch's worth
        if num < MIN_FETCH_BLOCKS or num > engine.pool.num_free:
            return False
        nbytes = num * block_nbytes(engine)
        if not self._worth_it(num * bs, nbytes, hint.transport):
            self.declined += 1
            return False
        fid = fetch_id(request_id)
        self.cancel(request_id)  # a re-dispatch of the same request replaces its fetch
        local = engine.pool.lookup(keys[:start], tokens[:start])  # leading device hits
        engine.pool.take(local)
        if num > engine.pool.num_free:  # some were free: taking them left too few
            engine.pool.free(local)
            return False
        # A sequence of the blocks' tokens only (it never runs): a reservation on a decode
        # worker then counts a block at most for it to grow by.
        placeholder = SequenceState(
            request_id=fid,
            token_ids=[t for block in tokens[: len(local)] + tokens[start : start + num]
                       for t in block],
            num_prompt_tokens=(len(local) + num) * bs,
            params=SamplingParams(max_tokens=1),
        )  # fmt: skip
        placeholder.block_table = local + engine.pool.allocate(num)
        placeholder.num_computed_tokens = placeholder.num_tokens  # never scheduled
        engine.reserved[fid] = placeholder
        now = time.monotonic()
        fetch = _Fetch(
            request_id, placeholder, len(local), keys[start : start + num],
            tokens[start : start + num], start, hint.worker_id, hint.kv_address, hint.transport,
            nbytes, now, now + hint.timeout_s,
        )  # fmt: skip
        self._fetches[fid] = fetch
        message = KVFetch(
            fetch_id=fid,
            start_block=start,
            keys=fetch.keys,
            token_ids=[t for block in fetch.tokens for t in block],
            reply_address=self.reply_address,
            transport=hint.transport,  # type: ignore[arg-type]
            deadline_s=hint.timeout_s,
        )
        if not self.sender.request(hint.kv_address, encode(message)):
            self._end(fid, "could not send the fetch", unreachable=True)
            return False
        return True

    def _local_run(self, keys: list[bytes], tokens: list[list[int]]) -> int:
        """Leading blocks this engine holds itself, in its cache or its tier."""
        pool, tier = self.engine.pool, self.engine.tier
        n = 0
        for key, block in zip(keys, tokens):
            if pool.lookup([key], [block]):
                n += 1
            elif tier is not None and any(key in store for store in tier.stores):
                n += 1
            else:
                break
        return n

    def _worth_it(self, num_tokens: int, nbytes: int, transport: str) -> bool:
        """Fetching measures cheaper than computing (or a rate is not measured yet: fetching
        measures the transfer's, the engine's steps measure prefill's)."""
        rate = self.bytes_per_s.get(transport)
        per_token = self.engine.prefill_budget.costs.prefill_token_s()
        if rate is None or per_token is None:
            return True
        return nbytes / rate < num_tokens * per_token

    # ---- the answer ----------------------------------------------------------------------------

    def owns(self, transfer_id: str) -> bool:
        return transfer_id in self._fetches

    def resolve(self, header: KVHeader) -> list[int] | None:
        """Where an answer's blocks go (None: not a fetch under way, or not what was asked)."""
        fetch = self._fetches.get(header.request_id)
        if fetch is None or fetch.arrived or header.start_block != fetch.start_block:
            return None
        table = fetch.placeholder.block_table[fetch.offset :]
        if not 0 <= header.num_blocks <= len(table):
            return None
        return table[: header.num_blocks]

    def on_received(self, received: ReceivedKV) -> bool:
        """An answer the receiver handled (written only if it checked out); False when it is
        not a fetch of ours (the worker's own transfers)."""
        fid = received.header.request_id
        fetch = self._fetches.get(fid)
        if fetch is None:
            return is_fetch_id(fid)  # a late answer to a fetch that ended: already refused
        n = received.header.num_blocks
        if not received.ok or not n:
            self._end(fid, received.reason or "the peer holds none of the blocks")
            return True
        seq, bs, at = fetch.placeholder, self.engine.config.block_size, fetch.offset
        for i in range(n):  # later prompts (this request's first) find them in the cache
            self.engine.pool.register(seq.block_table[at + i], fetch.keys[i], fetch.tokens[i])
        if at + n < len(seq.block_table):  # the peer held fewer: give the rest back now
            self.engine.pool.free(seq.block_table[at + n :])
            del seq.block_table[at + n :]
        seconds = time.monotonic() - fetch.started
        if seconds > 0 and received.header.nbytes:
            rate = received.header.nbytes / seconds
            old = self.bytes_per_s.get(fetch.transport)
            self.bytes_per_s[fetch.transport] = rate if old is None else old + _EWMA * (rate - old)
        self.fetched_tokens += n * bs
        self.fetched_bytes += received.header.nbytes
        fetch.arrived = True
        del self._fetches[fid]
        self._pinned[fetch.request_id] = seq
        self._ended.append(fetch.request_id)
        return True

    def poll(self) -> list[str]:
        """Request ids whose fetch ended since the last call (arrived or not): run them now.
        Also ends overdue fetches and unpins blocks their requests have taken."""
        now = time.monotonic()
        for fid, fetch in list(self._fetches.items()):
            if now > fetch.deadline:
                self._end(fid, f"peer {fetch.peer} did not answer in time", unreachable=True)
            elif self.sender.peer_down(fetch.kv_address):  # it died: no need to wait it out
                self._end(fid, f"the connection to peer {fetch.peer} is lost", unreachable=True)
        seqs = self.engine.seqs
        for rid in list(self._pinned):
            own = seqs.get(rid)
            if own is None or own.block_table:  # it took them (or ended): they are its now
                self._unpin(rid)
        ended, self._ended = self._ended, []
        return ended

    def cancel(self, request_id: str) -> None:
        """The request was aborted: drop its fetch and blocks (a late answer is refused)."""
        fid = fetch_id(request_id)
        if fid in self._fetches:
            self._release(self._fetches.pop(fid).placeholder)
        self._unpin(request_id)

    def _unpin(self, request_id: str) -> None:
        seq = self._pinned.pop(request_id, None)
        if seq is not None:
            self._release(seq)

    def _end(self, fid: str, reason: str, unreachable: bool = False) -> None:
        """The fetch ended without blocks; `unreachable`: no answer came (the peer may be dead),
        so its socket is closed unless another fetch still waits on that peer."""
        fetch = self._fetches.pop(fid)
        self.failed += 1
        log.info("fetch of %s's prefix from %s ended without blocks (%s): computing it",
                 fetch.request_id, fetch.peer, reason)  # fmt: skip
        self._release(fetch.placeholder)
        self._ended.append(fetch.request_id)
        if unreachable and all(f.kv_address != fetch.kv_address for f in self._fetches.values()):
            self.sender.drop_peer(fetch.kv_address)

    def _release(self, placeholder: SequenceState) -> None:
        if self.engine.reserved.pop(placeholder.request_id, None) is not None:
            self.engine.block_manager.free(placeholder)

    def busy(self) -> bool:
        return bool(self._fetches or self._ended)

    def stats(self) -> dict[str, float]:
        return {
            "kv_peer_fetched_tokens_total": self.fetched_tokens,
            "kv_peer_fetched_bytes_total": self.fetched_bytes,
            "kv_peer_fetch_failures_total": self.failed,
            "kv_peer_fetch_declined_total": self.declined,
        }


def block_nbytes(engine) -> int:
    """Bytes one block of the engine's cache travels as (KV, and scales when 8-bit)."""
    runner = engine.runner
    return payload.payload_nbytes(runner.kv_cache, 1, runner.kv_scales)


def settle(result: TransferResult) -> bool:
    """Whether a sender result is the end of an answer to a peer's fetch (nothing to do: the
    blocks were copied when it was sent), rather than one of the worker's own transfers."""
    return is_fetch_id(result.request_id)
