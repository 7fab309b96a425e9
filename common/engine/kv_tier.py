"""The KV tier below an engine's device cache: blocks the prefix cache evicts are kept in host RAM
(`--kv-offload-memory`) and/or files in a local directory (`--kv-offload-dir`, bounded by
`--kv-offload-disk`) instead of being lost, and reloaded when a later prompt starts with them.

Owns the policy: the block pool calls `offload` with each cached block it is about to reuse (its
bytes are still intact); the block is copied to RAM, and what RAM drops goes to disk (with no RAM
tier, straight to disk). The block manager calls `reload` for the blocks of a prompt the device
cache misses: the leading run found in the tiers is read (RAM, else disk; a damaged file is a
miss), copied into newly allocated device blocks and registered there, when the measured cost of
the reload (bytes / each tier's measured rate) is below the measured prefill cost of those tokens
(the engine reports each step's time; before a rate is measured, the tier reloads, which measures
it). A reload is byte-exact (`kv_tier_store.BlockIO`), 8-bit scales included.

Every block is found by its prefix key, so a peer can read blocks out by key (`read_block`).
Workers report which keys each tier holds (`drain_events`, `keys`) beside the device cache's
events. Built by the engine through `attach`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from common.config import EngineConfig, parse_size
from common.engine.kv_tier_disk import DiskStore
from common.engine.kv_tier_store import BlockIO, RamStore, ReloadCosts

if TYPE_CHECKING:
    from common.engine.block_manager import BlockManager
    from common.engine.block_pool import BlockPool
    from common.engine.scheduler import ScheduledSeq
    from common.model.model_runner import ModelRunner

# Tier names as the KV events and metrics use them: "cpu" is host RAM, as vLLM names its tier.
TIERS = ("cpu", "disk")


class KVTier:
    """Host-RAM and disk stores of evicted blocks, and the reload decision."""

    def __init__(
        self,
        io: BlockIO,
        block_size: int,
        ram_bytes: int = 0,
        disk_dir: str = "",
        disk_bytes: int = 0,
    ) -> None:
        self.io = io
        self.block_size = block_size
        self.ram = RamStore(ram_bytes, name="cpu") if ram_bytes > 0 else None
        self.disk = DiskStore(disk_dir, disk_bytes, io.block_nbytes) if disk_dir else None
        self.costs = ReloadCosts()
        self.query_tokens = 0  # prompt tokens looked up with this tier present, once per request
        self.hit_tokens = 0  # of those, reloaded instead of computed (counted as queries are)
        self.declined_blocks = 0  # found, but prefill measured cheaper than reloading
        self.track_events = False
        self._ram_events: dict[bytes, bool] = {}

    @property
    def stores(self) -> list[RamStore | DiskStore]:
        return [s for s in (self.ram, self.disk) if s is not None]

    def offload(self, block_id: int, key: bytes, tokens: Sequence[int]) -> None:
        """Keep an evicted block (the pool calls this before the block is reused)."""
        if self.ram is not None:
            if key in self.ram:
                self.ram.get(key, tokens)  # most recently used again
                return
            if self.disk is not None and key in self.disk:
                return  # already one tier down: no need to copy it again
            dropped = self.ram.put(key, tokens, self.io.read(block_id))
            if key in self.ram:  # not when a block is bigger than the whole tier
                self._record(key, True)
            for old_key, entry in dropped:
                self._record(old_key, False)
                if self.disk is not None:
                    self.disk.put(old_key, entry.tokens, entry.data)
        elif self.disk is not None and key not in self.disk:
            self.disk.put(key, tokens, self.io.read(block_id))

    def _record(self, key: bytes, stored: bool) -> None:
        if self.track_events:
            self._ram_events.pop(key, None)
            self._ram_events[key] = stored

    def _find(self, key: bytes) -> RamStore | DiskStore | None:
        """The tier holding `key` (RAM first), counting lookups, hits and misses on the way (a
        hit whose read then fails becomes a miss)."""
        for store in self.stores:
            store.counters.lookups += 1
            if key in store:
                store.counters.hits += 1
                return store
            store.counters.misses += 1
        return None

    def reload(
        self, pool: BlockPool, keys: Sequence[bytes], token_blocks: Sequence[Sequence[int]]
    ) -> list[int]:
        """Device blocks holding the leading blocks of `keys` read back from the tier (allocated
        from `pool`, registered under their keys: the caller owns one reference to each); []
        when none is held, none is free, or prefill measures cheaper."""
        found: list[tuple[bytes, Sequence[int], RamStore | DiskStore]] = []
        for key, tokens in zip(keys[: pool.num_free], token_blocks):
            if pool.is_cached(key):
                break  # the device cache has it: the caller takes it from there
            store = self._find(key)
            if store is None:
                break
            found.append((key, tokens, store))
        if not found:
            return []
        if not self._worth_it(found):
            # the disk part may be what costs too much: the RAM blocks before it alone?
            ram_run = next((i for i, f in enumerate(found) if f[2] is not self.ram), len(found))
            if not ram_run or not self._worth_it(found[:ram_run]):
                self.declined_blocks += len(found)
                return []
            self.declined_blocks += len(found) - ram_run
            found = found[:ram_run]
        return self._load(pool, found)

    def _worth_it(self, found: list) -> bool:
        nbytes = {name: 0 for name in TIERS}
        for _, _, store in found:
            nbytes[store.name] += self.io.block_nbytes
        if nbytes["disk"]:  # a disk block is read, then copied in like a RAM one
            nbytes["cpu"] += nbytes["disk"]
        return self.costs.favours_reload(len(found) * self.block_size, nbytes)

    def _load(self, pool: BlockPool, found: list) -> list[int]:
        """Read the blocks (stopping at the first unreadable one), then copy them in."""
        datas: list[torch.Tensor] = []
        disk_s = 0.0
        for key, tokens, store in found:
            start = time.perf_counter()
            data = store.get(key, tokens)
            if store is self.disk:
                disk_s += time.perf_counter() - start
            if data is None:  # a damaged file, or another prefix under the same key
                store.counters.hits -= 1
                store.counters.misses += 1
                break
            datas.append(data)
        if not datas:
            return []
        # Allocating may evict cached device blocks into the tier and push these out of RAM:
        # `datas` holds their bytes whatever the stores do meanwhile.
        block_ids = pool.allocate(len(datas))
        start = time.perf_counter()
        for block_id, data, (key, tokens, _) in zip(block_ids, datas, found):
            self.io.write(block_id, data)
            pool.register(block_id, key, tokens)
        copy_s = time.perf_counter() - start
        nbytes = len(datas) * self.io.block_nbytes
        self.costs.record_load("cpu", nbytes, copy_s)
        num_disk = sum(1 for _, _, store in found[: len(datas)] if store is self.disk)
        if num_disk:
            self.costs.record_load("disk", num_disk * self.io.block_nbytes, disk_s)
        return block_ids

    def read_block(self, key: bytes) -> tuple[tuple[int, ...], torch.Tensor] | None:
        """(tokens, bytes) of a block the tier holds, for a peer that fetches it by key."""
        for store in self.stores:
            found = store.read(key)
            if found is not None:
                return found
        return None

    def drain_events(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        """Per tier: keys stored and keys dropped since the last drain (disjoint)."""
        events: dict[str, tuple[list[bytes], list[bytes]]] = {}
        if self.ram is not None:
            ram, self._ram_events = self._ram_events, {}
            events["cpu"] = ([k for k, s in ram.items() if s], [k for k, s in ram.items() if not s])
        if self.disk is not None:
            events["disk"] = self.disk.drain_events()
        return events

    def keys(self) -> dict[str, list[bytes]]:
        """Every key each tier holds (a full resync of the routers' index)."""
        return {store.name: store.keys() for store in self.stores}

    def flush(self) -> None:
        """Wait for the disk writer (tests, shutdown)."""
        if self.disk is not None:
            self.disk.flush()

    def check(self) -> list[str]:
        return [e for store in self.stores for e in store.check()]

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, float]:
        """Counters and gauges, named as vLLM's offloading metrics where it has them."""
        out: dict[str, float] = {
            "external_prefix_cache_queries_total": self.query_tokens,
            "external_prefix_cache_hits_total": self.hit_tokens,
            "kv_offload_reloads_declined_total": self.declined_blocks,
        }
        for store in self.stores:
            c, p = store.counters, f"kv_offload_{store.name}_"
            out.update({
                p + "block_lookup_total": c.lookups,
                p + "block_hit_total": c.hits,
                p + "block_miss_total": c.misses,
                p + "block_store_total": c.stores,
                p + "block_eviction_total": c.evictions,
                p + "stores_skipped_total": c.stores_skipped,
                p + "usage_bytes": store.used_bytes,
                p + "capacity_bytes": store.capacity_bytes,
            })  # fmt: skip
        if self.disk is not None:
            out["kv_offload_disk_corrupt_total"] = self.disk.counters.corrupt
            out["kv_offload_disk_write_errors_total"] = self.disk.counters.write_errors
        return out


def prefill_tokens(batch: list[ScheduledSeq]) -> int:
    """Tokens a step computes in prefill: all its new tokens but a decode row's one (call before
    the step advances the sequences)."""
    total = 0
    for item in batch:
        seq = item.seq
        decoding = seq.num_output_tokens > 0 and (
            seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens
        )
        total += item.num_new_tokens - (1 if decoding else 0)
    return total


def attach(
    config: EngineConfig, runner: ModelRunner, pool: BlockPool, manager: BlockManager
) -> KVTier | None:
    """The tier `config` asks for, hooked into the pool (evictions) and the manager (reloads);
    None when both stores are off (0) or prefix caching is."""
    ram_bytes = parse_size(config.kv_offload_memory)
    disk_bytes = parse_size(config.kv_offload_disk) if config.kv_offload_dir else 0
    if not config.enable_prefix_caching or (ram_bytes <= 0 and disk_bytes <= 0):
        return None
    io = BlockIO(runner.kv_cache, runner.kv_scales)
    tier = KVTier(io, pool.block_size, ram_bytes, config.kv_offload_dir if disk_bytes else "",
                  disk_bytes)  # fmt: skip
    pool.on_evict = tier.offload
    manager.tier = tier
    return tier
