"""Peers' prefix fetches answered: the serving half of `kvtransfer.peer_fetch`.

A worker that holds blocks another worker asks for (`KVFetch`, taken off its receiver) answers
with the leading run of them it holds, in its cache or its KV tier, pushed through its `KVSender`
to the asker's receiver; 0 blocks when it holds none, so that the asker need not wait for its
timeout. An answer can be thousands of blocks (hundreds of MB), so `FetchServer` copies it into
its payload in slices (`KVSender.stage`, then `send_staged` once full), and the worker's own steps
run between slices; an otherwise idle worker does not wait between them
(`common.runtime.worker_kv.WorkerKV.serving_peers`). A turn copies `SERVE_BYTES_PER_TURN`, and
more, a slice of that size at a time, while its copying has taken under `SERVE_SHARE` of the time
the worker spent on its own work since its previous turn. A prefill worker's turn can be one
multi-second prompt step: at 8 MB a turn a 20 MB answer would take three of them, past the
asker's timeout (the asker then computes the prefix anyway), where this way it goes out after
one, and the worker's own work is slowed by about `SERVE_SHARE` at most.
Meanwhile the answer's cache blocks are pinned (a placeholder sequence in `engine.held`, so the
block books count them) and its RAM-tier blocks referenced; disk-tier blocks are read when their
slice is copied. The worker (`common.runtime.worker_kv`) calls `add` for each fetch and `step`
once a turn.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common.engine.sequence import SequenceState
from common.protocol import KVFetch, KVHeader
from common.sampling_params import SamplingParams
from kvtransfer import payload
from kvtransfer.peer_fetch import block_nbytes
from kvtransfer.sender import KVSender

log = logging.getLogger(__name__)

SERVE_ID_PREFIX = "peer-serve/"  # the placeholder (in engine.held) of an answer's cache blocks
SERVE_BYTES_PER_TURN = 8 << 20  # KV a worker copies and checksums for peers per turn, at least
SERVE_SHARE = 0.25  # ... and more while copying takes under this share of its own time
MAX_QUEUED_FETCHES = 64  # peers' fetches waiting for their answer; more are answered empty
# How long a sent answer's payload outlives its asker's wait: the asker reads it between its own
# steps (seconds long on a busy CPU) and uses it if it came in time; a late one it refuses at
# once, which frees the payload. This only bounds the payload of an asker that never replies.
ANSWER_GRACE_S = 10.0


@dataclass
class _Answer:
    """An answer being copied into its payload, a slice a turn."""

    fetch: KVFetch
    header: KVHeader
    # In payload order: a pinned cache block id, a RAM-tier block's bytes, or the key of a
    # disk-tier block (read when its slice is copied).
    sources: list[int | torch.Tensor | bytes]
    placeholder: SequenceState | None  # holds the cache blocks (in engine.held), if any
    buffer: memoryview
    until: float  # monotonic: when the asker stops waiting (no use copying after that)
    filled: int = 0
    checksums: list[int] = field(default_factory=list)


class FetchServer:
    """The serving side of peer fetches for one worker's engine (see the module docstring):
    `add` what the receiver took, `step` once a worker turn."""

    def __init__(self, engine, sender: KVSender) -> None:
        self.engine = engine
        self.sender = sender
        self.bytes_per_turn = SERVE_BYTES_PER_TURN
        self.share = SERVE_SHARE  # 0: one slice of `bytes_per_turn` a turn
        self._turn_ended: float | None = None  # when the previous `step` returned
        self._queue: deque[tuple[KVFetch, float]] = deque()  # (fetch, when it came)
        self._active: _Answer | None = None
        self.served_blocks = 0  # blocks of answers sent
        self.given_up = 0  # answers not sent: the asker's deadline passed, or a tier block went

    def add(self, fetch: KVFetch) -> None:
        if len(self._queue) >= MAX_QUEUED_FETCHES:  # answered at once: the asker computes
            self._answer_empty(fetch)
        else:
            self._queue.append((fetch, time.monotonic()))

    def busy(self) -> bool:
        return self._active is not None or bool(self._queue)

    def step(self) -> int:
        """Copy a slice of KV into the answers, oldest first, and send those now full; returns
        the blocks sent. Called once a worker turn. A slice is `bytes_per_turn` (one block at
        least), then more, `bytes_per_turn` at a time, while its copying has taken less than
        `share` of the worker's own time since the previous call."""
        started = time.perf_counter()
        own_s = started - self._turn_ended if self._turn_ended is not None else 0.0
        try:
            return self._step(started + self.share * own_s)
        finally:
            self._turn_ended = time.perf_counter()

    def _step(self, extra_until: float) -> int:
        """Copy one slice, then more while perf_counter() is before `extra_until`."""
        per_slice = max(1, self.bytes_per_turn // block_nbytes(self.engine))
        budget = per_slice
        sent = 0
        while True:
            if budget <= 0:
                if time.perf_counter() >= extra_until:
                    break
                budget = per_slice  # time left: another slice
            if self._active is None:
                if not self._queue:
                    break
                fetch, came = self._queue.popleft()
                if time.monotonic() - came > fetch.deadline_s:  # the asker stopped waiting
                    self.given_up += 1
                    continue
                self._active = self._begin(fetch, came + fetch.deadline_s)
                continue
            answer = self._active
            if time.monotonic() > answer.until or not self.sender.is_pending(
                answer.header.request_id
            ):  # the asker stopped waiting
                self.given_up += 1
                self.sender.abort(answer.header.request_id)
                self._close(answer)
                continue
            num = min(budget, len(answer.sources) - answer.filled)
            budget -= num
            if not self._fill(answer, num):
                self.given_up += 1
                self.sender.abort(answer.header.request_id)
                self._close(answer)
                self._answer_empty(answer.fetch)  # so that the asker computes at once
                continue
            if answer.filled == len(answer.sources):
                self.sender.send_staged(answer.header.request_id, answer.checksums)
                sent += answer.filled
                self._close(answer)  # its blocks were copied: they may be reused now
        self.served_blocks += sent
        return sent

    def _begin(self, fetch: KVFetch, until: float) -> _Answer | None:
        """Look up the leading run of `fetch`'s blocks held here, pin it and stage its answer
        (a 0-block answer is sent at once); None when nothing is left to copy. `until`: when
        its asker stops waiting (monotonic)."""
        engine = self.engine
        bs = engine.config.block_size
        tier = engine.tier
        ram = None if tier is None else tier.ram
        disk = None if tier is None else tier.disk
        sources: list[int | torch.Tensor | bytes] = []
        tokens_of_hits: list[int] = []
        if len(fetch.token_ids) == len(fetch.keys) * bs:  # else a different block size: none
            for i, key in enumerate(fetch.keys):
                tokens = fetch.token_ids[i * bs : (i + 1) * bs]
                hit = engine.pool.lookup([key], [tokens])
                if hit:
                    sources.append(hit[0])
                    tokens_of_hits += tokens
                    continue
                found = ram.read(key) if ram is not None else None
                if found is not None and found[0] == tuple(tokens):
                    sources.append(found[1])
                elif disk is not None and key in disk:
                    sources.append(key)  # its tokens are compared when it is read
                else:
                    break
        header = self._header(fetch, len(sources))
        if self.sender.is_pending(header.request_id):  # a retry of a fetch still answered
            log.warning("fetch %s is already being answered", fetch.fetch_id)
            return None
        placeholder = None
        hits = [s for s in sources if isinstance(s, int)]
        pid = SERVE_ID_PREFIX + fetch.fetch_id
        if hits:
            engine.pool.take(hits)
            placeholder = SequenceState(
                request_id=pid,
                token_ids=tokens_of_hits,
                num_prompt_tokens=len(tokens_of_hits),
                params=SamplingParams(max_tokens=1),
            )
            placeholder.block_table = hits
            placeholder.num_computed_tokens = placeholder.num_tokens
            engine.held[pid] = placeholder
        try:
            wait_s = max(until - time.monotonic(), 0.0)
            buffer = self.sender.stage(fetch.reply_address, header, wait_s + ANSWER_GRACE_S)
        except ValueError as exc:  # not our layout's header: a bug, not the peer's
            log.warning("could not answer fetch %s: %s", fetch.fetch_id, exc)
            buffer = None
        answer = _Answer(fetch, header, sources, placeholder, buffer or memoryview(b""), until)
        if buffer is None or not sources:  # it failed at once, or an empty answer: done
            if buffer is not None:
                self.sender.send_staged(header.request_id, [])
            self._close(answer)
            return None
        return answer

    def _fill(self, answer: _Answer, num: int) -> bool:
        """Copy the next `num` blocks into the answer's payload; False when a disk-tier block is
        gone or not what was asked (the payload's size is fixed: the answer is given up)."""
        engine, bs = self.engine, self.engine.config.block_size
        first = answer.filled
        part: list[int | torch.Tensor] = []
        for i in range(first, first + num):
            source = answer.sources[i]
            if isinstance(source, bytes):
                found = engine.tier.disk.read(source)
                tokens = tuple(answer.fetch.token_ids[i * bs : (i + 1) * bs])
                if found is None or found[0] != tokens:
                    log.warning("fetch %s: a disk-tier block went: answering none",
                                answer.fetch.fetch_id)  # fmt: skip
                    return False
                source = found[1]
            part.append(source)
        runner = engine.runner
        n = len(answer.sources)
        payload.assemble_payload(runner.kv_cache, runner.kv_scales, part, out=answer.buffer,
                                 first=first, num_blocks=n)  # fmt: skip
        answer.checksums += payload.block_checksums(
            answer.buffer, runner.kv_cache, runner.kv_scales, n, range(first, first + num)
        )
        answer.filled += num
        return True

    def _close(self, answer: _Answer) -> None:
        """Unpin an answer's cache blocks (sent, or given up), let go of its payload view (an shm
        segment stays mapped while a view of it lives) and forget it."""
        if self._active is answer:
            self._active = None
        try:
            answer.buffer.release()
        except BufferError:  # a zero-copy send still holds it: it goes when that is done
            pass
        if answer.placeholder is not None:
            if self.engine.held.pop(answer.placeholder.request_id, None) is not None:
                self.engine.block_manager.free(answer.placeholder)
            answer.placeholder = None

    def _answer_empty(self, fetch: KVFetch) -> None:
        header = self._header(fetch, 0)
        try:
            if self.sender.stage(fetch.reply_address, header, fetch.deadline_s) is not None:
                self.sender.send_staged(header.request_id, [])
        except ValueError as exc:  # an id already in flight: that answer ends the asker's wait
            log.warning("could not answer fetch %s: %s", fetch.fetch_id, exc)

    def _header(self, fetch: KVFetch, num_blocks: int) -> KVHeader:
        return KVHeader(
            request_id=fetch.fetch_id,
            start_block=fetch.start_block,
            num_blocks=num_blocks,
            nbytes=0,
            transport=fetch.transport,
            first_token_id=0,  # not a prompt's handoff: no token goes with the blocks
            **payload.kv_layout(self.engine.runner.kv_cache),  # type: ignore[arg-type]
        )

    def close(self) -> None:
        """Unpin whatever is being answered (the worker is closing)."""
        if self._active is not None:
            self._close(self._active)
        self._queue.clear()
