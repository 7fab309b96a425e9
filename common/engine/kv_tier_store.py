"""The pieces of the KV tier below the device cache: one block's bytes, the host-RAM store, and the
measured costs that decide between reloading a prefix and computing it again.

`BlockIO` copies one block of the paged cache (every layer's K and V, then an 8-bit cache's
float32 scales) to a flat uint8 host tensor and back, byte for byte: a block reloaded from any tier
is the block that was evicted. `RamStore` keeps such tensors keyed by prefix key (with the block's
tokens, compared on every read like the block pool does), least recently used first out, never
holding more than its byte budget. `ReloadCosts` keeps the measured rates: the engine's prefill
seconds per token, and the bytes per second of each tier's reloads. Used by `common.engine.kv_tier`
(which owns the policy); `common.engine.kv_tier_disk` is the directory store beside `RamStore`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.kernels import kv_quant

SCALE_DTYPE = torch.float32  # an 8-bit cache's scales, one per (token, KV head)


class BlockIO:
    """Byte-exact copies of single blocks between a paged cache and flat host tensors.

    The cache is [layers, 2, blocks, block_size, kv heads, head_dim] (scales: the same without
    head_dim); a block's bytes are its KV rows of every layer, K then V, followed by its scales:
    the layout of a one-block kvtransfer payload, and the bytes its per-block CRC-32 covers.
    """

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
        storage = kv_quant.storage(kv_cache)  # float8 as uint8: index ops have no float8 kernels
        assert storage.is_contiguous(), "the KV cache must be one contiguous tensor"
        layers, two, num_blocks = storage.shape[:3]
        self.num_blocks = num_blocks
        self.kv_rows = storage.view(layers * two, num_blocks, -1)
        self.scale_rows = (
            None if kv_scales is None else kv_scales.view(layers * two, num_blocks, -1)
        )
        self.kv_nbytes = self.kv_rows[:, 0].numel() * storage.element_size()
        scale_nbytes = 0 if self.scale_rows is None else self.scale_rows[:, 0].numel() * 4
        self.block_nbytes = self.kv_nbytes + scale_nbytes

    def _views(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        kv = data[: self.kv_nbytes].view(self.kv_rows.dtype).view(self.kv_rows.shape[0], -1)
        if self.scale_rows is None:
            return kv, None
        scales = data[self.kv_nbytes :].view(SCALE_DTYPE).view(self.scale_rows.shape[0], -1)
        return kv, scales

    def read(self, block_id: int) -> torch.Tensor:
        """A new contiguous uint8 CPU tensor holding the block's bytes."""
        data = torch.empty(self.block_nbytes, dtype=torch.uint8)
        kv, scales = self._views(data)
        kv.copy_(self.kv_rows[:, block_id])
        if scales is not None:
            scales.copy_(self.scale_rows[:, block_id])
        return data

    def write(self, block_id: int, data: torch.Tensor) -> None:
        """Put bytes from `read` (of this layout) back into a block."""
        if data.numel() != self.block_nbytes:
            raise ValueError(f"a block is {self.block_nbytes} bytes, got {data.numel()}")
        kv, scales = self._views(data)
        self.kv_rows[:, block_id].copy_(kv)
        if scales is not None:
            self.scale_rows[:, block_id].copy_(scales)


@dataclass
class TierCounters:
    """What one tier did, in blocks (bytes where named); the metrics are built from these."""

    lookups: int = 0  # blocks looked up (after the device cache missed them)
    hits: int = 0
    misses: int = 0  # not held, or held but unreadable (corrupt, partial, tokens differ)
    stores: int = 0  # blocks written into the tier
    evictions: int = 0  # blocks dropped to keep within the byte budget
    stores_skipped: int = 0  # blocks not stored: queue full, write error, too big
    corrupt: int = 0  # reads refused by the checksum, size or header check
    write_errors: int = 0  # writes that failed (a full disk, a read-only directory)


@dataclass
class TierEntry:
    """A block held in RAM: its tokens (compared on every read) and its bytes."""

    tokens: tuple[int, ...]
    data: torch.Tensor


@dataclass
class RamStore:
    """Blocks in host RAM, keyed by prefix key, LRU within `capacity_bytes`."""

    capacity_bytes: int
    name: str = "ram"
    used_bytes: int = 0
    counters: TierCounters = field(default_factory=TierCounters)
    _entries: OrderedDict[bytes, TierEntry] = field(default_factory=OrderedDict)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def put(
        self, key: bytes, tokens: Sequence[int], data: torch.Tensor
    ) -> list[tuple[bytes, TierEntry]]:
        """Store a block; returns what fell out to make room, as (key, entry) pairs, oldest first
        (the caller may hand them to a lower tier). A block already held is only refreshed."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return []
        size = data.numel()
        if size > self.capacity_bytes:
            self.counters.stores_skipped += 1
            return []
        dropped = []
        while self.used_bytes + size > self.capacity_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.used_bytes -= old.data.numel()
            self.counters.evictions += 1
            dropped.append((old_key, old))
        self._entries[key] = TierEntry(tuple(tokens), data)
        self.used_bytes += size
        self.counters.stores += 1
        return dropped

    def get(self, key: bytes, tokens: Sequence[int]) -> torch.Tensor | None:
        """The block's bytes if held under `key` with these tokens (then most recently used)."""
        entry = self._entries.get(key)
        if entry is None or entry.tokens != tuple(tokens):
            return None
        self._entries.move_to_end(key)
        return entry.data

    def read(self, key: bytes) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """(tokens, bytes) of a held block, without touching its LRU place (a peer's fetch)."""
        entry = self._entries.get(key)
        return None if entry is None else (entry.tokens, entry.data)

    def check(self) -> list[str]:
        used = sum(e.data.numel() for e in self._entries.values())
        errors = []
        if used != self.used_bytes:
            errors.append(f"{self.name} tier: {used} bytes held, {self.used_bytes} counted")
        if used > self.capacity_bytes:
            errors.append(f"{self.name} tier: {used} bytes held over a {self.capacity_bytes} bound")
        return errors


# An estimate's weight for each new measurement: a few calls settle it, a busy moment fades.
_EWMA = 0.3
MIN_PREFILL_TOKENS = 16  # steps with fewer prefill tokens say little about prefill's cost


class ReloadCosts:
    """Measured rates: prefill seconds per token, reload bytes per second per tier."""

    def __init__(self) -> None:
        self.prefill_s_per_token: float | None = None
        self.bytes_per_s: dict[str, float] = {}
        self._loads: list[tuple[float, float]] = []  # (when, seconds) of reloads since a step

    def record_load(self, tier: str, nbytes: int, seconds: float) -> None:
        self._loads.append((time.perf_counter(), seconds))
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self.bytes_per_s.get(tier)
        self.bytes_per_s[tier] = rate if old is None else old + _EWMA * (rate - old)

    def record_step(self, num_prefill_tokens: int, num_tokens: int, start_s: float) -> None:
        """One engine step, from `start_s` (perf_counter) to now: prefill-dominated steps update
        the prefill rate, less the reloads done while scheduling it."""
        end_s = time.perf_counter()
        seconds = end_s - start_s - sum(s for when, s in self._loads if when >= start_s)
        self._loads.clear()
        if num_prefill_tokens < MIN_PREFILL_TOKENS or 2 * num_prefill_tokens < num_tokens:
            return
        if seconds <= 0:
            return
        rate = seconds / num_tokens
        old = self.prefill_s_per_token
        self.prefill_s_per_token = rate if old is None else old + _EWMA * (rate - old)

    def reload_s(self, nbytes_by_tier: dict[str, int]) -> float | None:
        """Estimated seconds to reload these bytes; None while a tier's rate is unmeasured."""
        total = 0.0
        for tier, nbytes in nbytes_by_tier.items():
            if not nbytes:
                continue
            rate = self.bytes_per_s.get(tier)
            if rate is None:
                return None
            total += nbytes / rate
        return total

    def favours_reload(self, num_tokens: int, nbytes_by_tier: dict[str, int]) -> bool:
        """Reload when it measures cheaper than prefilling `num_tokens`, or when either cost is
        not measured yet (a reload then measures its tier's rate)."""
        reload_s = self.reload_s(nbytes_by_tier)
        if reload_s is None or self.prefill_s_per_token is None:
            return True
        return reload_s < num_tokens * self.prefill_s_per_token
