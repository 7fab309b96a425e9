"""In-process memory probe for `benchmarks/soak.py`: loaded by every pdserve process it starts.

`benchmarks/soak.py` puts this directory on the children's PYTHONPATH, so Python imports this
file at startup (the `site` module's sitecustomize hook). It does nothing unless
PDSERVE_SOAK_PROBE_DIR is set; then a daemon thread writes, every PDSERVE_SOAK_PROBE_S seconds,
`<dir>/<pid>.json` with glibc's heap view (mallinfo2: bytes in use, bytes held in arenas and in
mmapped chunks) and, with PDSERVE_SOAK_TRACEMALLOC=1, tracemalloc's traced bytes. The soak asks
for more by creating `<dir>/<pid>.<cmd>`: `mark` (remember a tracemalloc snapshot and the object
counts by type), `diff` (write `<pid>.diff.json`: the top growth in both since the mark), `trim`
(glibc `malloc_trim(0)`, to tell memory that is free but held from memory in use). Nothing here
reads the network; only files the soak itself writes in its own temporary directory.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import time
from collections import Counter


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


def _type_counts() -> Counter:
    return Counter(type(o).__name__ for o in gc.get_objects())


def _loop(out_dir: str, period_s: float, trace: bool) -> None:
    import tracemalloc

    libc = _libc()
    pid = os.getpid()
    base = os.path.join(out_dir, str(pid))
    mark_snapshot = None
    mark_counts: Counter = Counter()
    while True:
        doc: dict = {"t": time.time()}
        if libc is not None:
            m = libc.mallinfo2()
            # uordblks: in use in arenas; hblkhd: in mmapped chunks; arena: held from the OS
            doc.update(heap_in_use=m.uordblks + m.hblkhd, heap_held=m.arena + m.hblkhd,
                       heap_free=m.fordblks)  # fmt: skip
        if trace and tracemalloc.is_tracing():
            doc["traced"] = tracemalloc.get_traced_memory()[0]
        tmp = base + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, base + ".json")
        for cmd in ("mark", "diff", "trim"):
            if not os.path.exists(f"{base}.{cmd}"):
                continue
            os.unlink(f"{base}.{cmd}")
            if cmd == "trim" and libc is not None:
                libc.malloc_trim(0)
            elif cmd == "mark":
                mark_snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
                mark_counts = _type_counts()
            elif cmd == "diff":
                grown = _type_counts()  # before the diff below makes objects of its own
                grown.subtract(mark_counts)
                result: dict = {"objects": [[k, v] for k, v in grown.most_common(12) if v > 0]}
                if mark_snapshot is not None:
                    stats = tracemalloc.take_snapshot().compare_to(mark_snapshot, "lineno")
                    result["tracemalloc"] = [
                        [str(s.traceback[0]), s.size_diff, s.count_diff] for s in stats[:12]
                    ]
                    del stats
                with open(base + ".diff.json.tmp", "w") as f:
                    json.dump(result, f)
                os.replace(base + ".diff.json.tmp", base + ".diff.json")
        time.sleep(period_s)


def _start() -> None:
    out_dir = os.environ.get("PDSERVE_SOAK_PROBE_DIR")
    if not out_dir:
        return
    trace = os.environ.get("PDSERVE_SOAK_TRACEMALLOC") == "1"
    if trace:
        import tracemalloc

        tracemalloc.start(1)  # one frame: the allocating line, the cheapest useful view
    period_s = float(os.environ.get("PDSERVE_SOAK_PROBE_S", "2"))
    threading.Thread(
        target=_loop, args=(out_dir, period_s, trace), name="soak-probe", daemon=True
    ).start()


_start()
