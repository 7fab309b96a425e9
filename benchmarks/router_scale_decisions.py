"""The routing choices and the prefix index of `benchmarks/router_scale.py`, measured in-process.

No router process, no HTTP: microseconds per decode choice (`Dispatcher._pick_decode`) and per
prefill choice (`PrefillPolicy.choose`) with N workers registered, for each policy, the hashing of
a prompt's block keys, and the bytes a `router.kv_index.PrefixIndex` holds per million blocks.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---- the prefix index ---------------------------------------------------------------------------


def index_bytes_per_million(num_blocks: int, num_workers: int = 8) -> float:
    """Bytes a standalone PrefixIndex holds for `num_blocks` keys, scaled to a million."""
    from common.prefix_hash import KEY_BYTES
    from common.protocol import KVEvents
    from router.kv_index import PrefixIndex

    per = num_blocks // num_workers
    batches = [[os.urandom(KEY_BYTES) for _ in range(per)] for _ in range(num_workers)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    for w, keys in enumerate(batches):
        index.apply(KVEvents(f"w{w}", 0, keys, [], reset=True))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del index
    return used / (per * num_workers) * 1e6


# ---- routing decisions alone --------------------------------------------------------------------


def decision_us(num_workers: int, routing: str, repeats: int = 300) -> float:
    """Microseconds the router's decode choice takes (`Dispatcher._pick_decode`, no HTTP) with
    `num_workers` decode workers registered and heartbeating, best of 3 rounds. Each choice is a
    new flight's first, so the prefix policy's includes hashing the 100-token prompt's block keys
    (a flight keeps them for its later choices)."""
    from common import protocol
    from common.protocol import Heartbeat, Register
    from common.sampling_params import SamplingParams
    from router.dispatch import Dispatcher, Flight
    from router.registry import Registry

    registry = Registry({"default"})
    for i in range(num_workers):
        wid = f"w{i}"
        registry.register(wid.encode(), Register(
            protocol.PROTOCOL_VERSION, "decode", wid, "default", 16, 100_000, 8192,
            "float32", "bench", kv_salt=b"salt",
        ))  # fmt: skip
        registry.on_heartbeat(Heartbeat(wid, i % 7, 0, 100_000, 100_000))
    dispatcher = Dispatcher(registry, lambda w, m: True, routing=routing)
    prompt, params = list(range(100)), SamplingParams()
    best = float("inf")
    for _ in range(3):
        flights = [Flight("r", 0, prompt, params, None) for _ in range(repeats)]  # type: ignore[arg-type]
        t0 = time.perf_counter()
        for flight in flights:
            dispatcher._pick_decode(flight)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def prefill_decision_us(num_workers: int, routing: str, repeats: int = 300) -> float:
    """Microseconds the prefill choice takes (`PrefillPolicy.choose` over the registry's live
    prefill workers, no HTTP) with `num_workers` prefill workers registered, loads spread, and a
    1,024-token prefix held in full by one worker in a hundred and in part by the others of
    them; best of 3 rounds. The prefix policy's figure includes hashing the prompt's block keys
    (`prompt_hash_us`), the rest is the choice."""
    from common import protocol
    from common.prefix_hash import block_keys
    from common.protocol import Heartbeat, KVEvents, Register
    from router.kv_index import PrefixIndex
    from router.policy import PrefillPolicy
    from router.registry import Registry

    salt = b"salt"
    registry = Registry({"default"})
    index = PrefixIndex()
    prefix = list(range(1024))
    keys = block_keys(prefix, 16, salt)
    for i in range(num_workers):
        wid = f"p{i}"
        registry.register(wid.encode(), Register(
            protocol.PROTOCOL_VERSION, "prefill", wid, "default", 16, 100_000, 8192,
            "float32", "bench", kv_salt=salt,
        ))  # fmt: skip
        registry.on_heartbeat(Heartbeat(wid, 0, 0, 100_000, 100_000, 64 * (i % 50)))
        if i % 100 == 1:
            index.apply(KVEvents(wid, 0, keys[: 64 if i % 200 == 1 else 8], [], reset=True))
    policy = PrefillPolicy(routing, index)
    live = registry.live_index("prefill")
    prompts = [prefix + [r] for r in range(repeats)]
    return _best_us(lambda: [policy.choose(live, prompt) for prompt in prompts], repeats)


def prompt_hash_us(repeats: int = 300) -> float:
    """Microseconds to hash a 1,025-token prompt's block keys (what the prefix policy does once
    per request and salt, whatever the number of workers)."""
    from common.prefix_hash import block_keys

    prompts = [list(range(1024)) + [r] for r in range(repeats)]
    return _best_us(lambda: [block_keys(prompt, 16, b"salt") for prompt in prompts], repeats)


def _best_us(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def decision_figures(num_workers: int) -> dict[str, float]:
    """Microseconds per choice at `num_workers` workers: the decode choice (colocated; round
    robin chooses decode workers as least_loaded does) and the prefill choice, per policy."""
    figures = {}
    for routing in ("least_loaded", "prefix"):
        figures[f"decision_us_{routing}"] = decision_us(num_workers, routing)
    for routing in ("least_loaded", "round_robin", "prefix"):
        figures[f"prefill_decision_us_{routing}"] = prefill_decision_us(num_workers, routing)
    figures["prompt_hash_us"] = prompt_hash_us()
    return figures
