"""benchmarks/vs_llamacpp.py's report: rounds combined, the table, the targets judged.

`combine_rounds` makes one system's rounds into one result: per phase, the median over rounds of
each figure the table shows, the figures of every round beside it (`per_round`), errors summed.
`report_rows` puts each (phase, metric) in a row: each system's figure and % of its limit, and
pdserve / llama-server ratios, the median of the rounds' own ratios where both systems ran the
same rounds (each round measures the systems one after the other within minutes, so a host that
drifts moves both figures of a round together; one round is the plain ratio). `targets` judges
the issue's targets on those rows; `print_report` prints it all.
"""

from __future__ import annotations

import statistics

SYSTEMS = {"llama": "llama-server", "colocated": "colocated", "disagg": "1P1D"}
FIGURES = ("output_token_throughput", "itl_p50_ms", "ttft_p50_ms")  # what the table shows


def combine_rounds(per_round: list[dict]) -> dict:
    """One system's results of several rounds ({phase: summary} each, in round order) as one:
    per phase, round 1's summary with each of FIGURES replaced by its median over the rounds that
    have it, `per_round` {figure: [value or None per round]}, `errors` summed over the rounds and
    `first_errors` from every round."""
    out: dict = {}
    for phase in dict.fromkeys(p for r in per_round for p in r):
        summaries = [r.get(phase) for r in per_round]
        first = next(s for s in summaries if s is not None)
        combined = {k: v for k, v in first.items() if k != "raw"}
        combined["per_round"] = {}
        for key in FIGURES:
            values = [None if s is None else s.get(key) for s in summaries]
            combined["per_round"][key] = values
            present = [v for v in values if v is not None]
            combined[key] = statistics.median(present) if present else None
        combined["errors"] = sum(s.get("errors", 0) for s in summaries if s is not None)
        combined["first_errors"] = [e for s in summaries if s for e in s.get("first_errors", [])]
        combined["raw"] = [s.get("raw") for s in summaries if s is not None]
        out[phase] = combined
    return out


def round_ratios(a: list | None, b: list | None) -> list[float]:
    """a / b in each round that measured both (two systems' `per_round` figures); empty where
    the systems did not run the same rounds."""
    if not a or not b or len(a) != len(b):
        return []
    return [x / y for x, y in zip(a, b) if x is not None and y]


def cell(value: float | None, spec: str, pct: float | None = None) -> str:
    if value is None:
        return "-"
    return spec.format(value) + (f" ({pct:.0f}%)" if pct is not None else "")


def report_rows(results: dict, floors: dict, args) -> list[dict]:
    """One row per (phase, metric): each system's value, the limit, % of limit, ratios."""
    n = args.concurrency
    step_n, step_1 = floors["step_n"], floors["step_1"]
    specs = [
        ("s1", "output tok/s", "output_token_throughput", floors["ceiling_1_tok_s"], "rate",
         "ceiling"),
        ("s1", "ITL p50 ms", "itl_p50_ms", step_1["limit_ms"], "time",
         f"batch-1 step limit ({'/'.join(step_1['dtypes'])})"),
        ("s1", "TTFT p50 ms", "ttft_p50_ms", floors["prefill_1_ms"], "time", "prefill floor"),
        (f"s{n}", "output tok/s", "output_token_throughput", floors["ceiling_n_tok_s"], "rate",
         "ceiling"),
        (f"s{n}", "ITL p50 ms", "itl_p50_ms", step_n["limit_ms"], "time",
         f"batch-{n} step limit ({'/'.join(step_n['dtypes'])})"),
        (f"s{n}", "TTFT p50 ms", "ttft_p50_ms", floors["prefill_1_ms"], "time",
         "one prompt's prefill floor"),
    ]  # fmt: skip
    rows = []
    for phase, metric, key, limit, kind, limit_name in specs:
        row = {"phase": phase, "metric": metric, "key": key, "limit": limit,
               "limit_name": limit_name}  # fmt: skip
        for name, res in results.items():
            v = res.get(phase, {}).get(key)
            row[name] = v
            row[f"{name}_rounds"] = res.get(phase, {}).get("per_round", {}).get(key)
            if v:
                row[f"{name}_pct_of_limit"] = 100 * (v / limit if kind == "rate" else limit / v)
        ref = row.get("llama")
        for name in results:
            if name != "llama" and ref and row.get(name) is not None:
                ratios = round_ratios(row[f"{name}_rounds"], row["llama_rounds"])
                row[f"{name}_vs_llama"] = statistics.median(ratios) if ratios else row[name] / ref
                if len(ratios) > 1:
                    row[f"{name}_vs_llama_rounds"] = ratios
        rows.append(row)
    return rows


TARGETS = {  # (phase, metric) -> (text, the most or least pdserve / llama-server may be)
    ("sN", "output tok/s"): (">= 3x llama-server", 3.0),
    ("sN", "TTFT p50 ms"): ("<= llama-server", 1.0),
    ("s1", "ITL p50 ms"): ("<= 0.5x llama-server; <= 1.5x its limit", 0.5),
}
STEP_LIMIT_TARGET = 1.5  # the batch-1 step over its limit: served (1-stream ITL p50), in-process


def target_key(row: dict) -> tuple[str, str]:
    return ("s1" if row["phase"] == "s1" else "sN", row["metric"])


def _needs(row: dict, goal: float) -> str:
    """What a target asks for, against the limit: a rate as % of its ceiling, a time as % of
    its limit (over 100%: beyond the machine's limit, out of reach)."""
    pct = 100 * (goal / row["limit"] if row["metric"] == "output tok/s" else row["limit"] / goal)
    spec = "{:.1f}" if row["metric"] == "output tok/s" else "{:.2f}"
    return f"needs {spec.format(goal)} = {pct:.0f}% of the limit"


def _over(pairs: list[tuple[float, float]]) -> str:
    """(time, its limit) pairs as "a / b ms, ..." """
    return ", ".join(f"{v:.2f} / {lim:.2f} ms" for v, lim in pairs)


def targets(rows: list[dict], args, floors: dict | None = None) -> list[dict]:
    """Each target for each pdserve system: the figure it is judged on, met or not, and what
    meeting it would take as a fraction of the machine's limit. The batch-1 step is judged twice:
    as served (the 1-stream ITL p50; with rounds, each round's against the limit measured just
    before that system's turn, `floors`' step_1 limit_ms_rounds[system]) and as the engine's own
    step in-process (its engine_pairs: each timing against the limit measured just before it;
    else engine_ms against limit_ms), each the median of its ratios."""
    out = []
    step_1 = (floors or {}).get("step_1", {})
    engine_ms, pairs = step_1.get("engine_ms"), step_1.get("engine_pairs")
    x = None
    if pairs:  # each timing against the limit measured just before it
        x = statistics.median([ms / limit for ms, limit in pairs])
        shown = (f"{x:.2f}x (median of {len(pairs)} timings, each against its limit measured "
                 f"just before it: {_over(pairs)})")  # fmt: skip
    elif engine_ms is not None:
        x = engine_ms / step_1["limit_ms"]
        shown = f"{x:.2f}x ({engine_ms:.2f} / {step_1['limit_ms']:.2f} ms)"
    if x is not None:
        out.append({"system": "engine (in-process)", "target": "batch-1 step <= 1.5x its limit",
                    "value": x, "met": x <= STEP_LIMIT_TARGET, "shown": shown})  # fmt: skip
    round_limits = step_1.get("limit_ms_rounds") or {}
    pdserve = [s for s in args.systems if s != "llama"]
    for row in rows:
        if target_key(row) not in TARGETS:
            continue
        text, bound = TARGETS[target_key(row)]
        higher = row["metric"] == "output tok/s"
        what = f"{row['phase'][1:]} stream(s) {row['metric']} {text.split(';')[0]}"
        for name in pdserve:
            ratio = row.get(f"{name}_vs_llama")
            met = None if ratio is None else (ratio >= bound if higher else ratio <= bound)
            shown = "-" if ratio is None else f"{ratio:.2f}x llama-server"
            rounds = row.get(f"{name}_vs_llama_rounds")
            if rounds:
                shown += f" (median of rounds {', '.join(f'{r:.2f}x' for r in rounds)})"
            if ratio is not None and row.get("llama"):
                shown += f" ({_needs(row, bound * row['llama'])})"
            out.append({"system": SYSTEMS[name], "target": what, "value": ratio, "met": met,
                        "shown": shown})  # fmt: skip
        if target_key(row) != ("s1", "ITL p50 ms"):
            continue
        for name in pdserve:
            v, per_round = row.get(name), row.get(f"{name}_rounds") or []
            limits = round_limits.get(name) or []
            if len(per_round) == len(limits) > 0 and None not in per_round:
                # each round's ITL against the limit measured just before its turn
                pairs = list(zip(per_round, limits))
                x = statistics.median([v / lim for v, lim in pairs])
                shown = f"{x:.2f}x (median of rounds: {_over(pairs)})"
            else:
                x = None if v is None else v / row["limit"]
                shown = "-" if x is None else f"{x:.2f}x ({v:.2f} / {row['limit']:.2f} ms)"
            out.append({
                "system": SYSTEMS[name], "target": "batch-1 step <= 1.5x its limit", "value": x,
                "met": None if x is None else x <= STEP_LIMIT_TARGET, "shown": shown,
            })  # fmt: skip
    return out


def print_report(machine: str, load: dict, limits, floors: dict, rows, goals, results, args):
    n = args.concurrency
    print(f"machine: {machine}; load average {load['start']} at start, {load['end']} at end\n")
    print(limits.describe() + "\n")
    s1, sn = floors["step_1"], floors["step_n"]
    print(
        f"work: {args.prompt_len}-token prompts (random ids) -> {args.output_len} tokens "
        f"(ignore_eos, greedy), `pdserve bench`'s client; {args.threads} threads per system in "
        f"all; pdserve computes in activations of {floors['act_dtype']}\n"
        f"floors: batch-1 decode step read {s1['read_ms']:.2f} ms / compute {s1['compute_ms']:.2f}"
        f" ms ({'/'.join(s1['dtypes'])}); batch-{n} step read {sn['read_ms']:.2f} / compute "
        f"{sn['compute_ms']:.2f} ms ({'/'.join(sn['dtypes'])}); one prompt's prefill "
        f"{floors['prefill_1_ms']:.1f} ms; the engine's own batch-1 step, in this process: "
        f"{s1['engine_ms']:.2f} ms\n"
        f"cores' floors (common.bench.limits: reading and computing on the same cores): batch-1 "
        f"step {s1['cores_ms']:.2f} ms, batch-{n} step {sn['cores_ms']:.2f} ms, {n} streams' "
        f"ceiling {floors['cores_ceiling_n_tok_s']:.1f} tok/s\n"
    )
    names = list(results)
    others = [s for s in names if s != "llama"]
    head = ["streams", "metric", *(SYSTEMS[s] for s in names), "limit"]
    head += [f"{SYSTEMS[s]} / llama-server" for s in others if "llama" in names] + ["target"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * (len(head) - 3) + "---|")
    for row in rows:
        streams = row["phase"][1:]
        spec = "{:.1f}" if row["metric"] == "output tok/s" else "{:.2f}"
        cells = [streams, row["metric"]]
        cells += [cell(row.get(s), spec, row.get(f"{s}_pct_of_limit")) for s in names]
        cells.append(f"{spec.format(row['limit'])} ({row['limit_name']})")
        if "llama" in names:
            cells += [cell(row.get(f"{s}_vs_llama"), "{:.2f}x") for s in others]
        cells.append(TARGETS.get(target_key(row), ("",))[0])
        print("| " + " | ".join(cells) + " |")
    print(
        "\n(%): a time's limit / the time, a rate / its ceiling; 100% = the machine's limit. "
        "Ratios: pdserve / llama-server in this run."
    )
    rounds = getattr(args, "rounds", 1)
    if rounds > 1:
        print(
            f"{rounds} rounds, the systems measured one after the other in each (the order "
            "rotated a place each round): each figure is the median of its rounds, each ratio "
            "the median of the rounds' own ratios. Per round:"
        )
        for name, limits in (floors["step_1"].get("limit_ms_rounds") or {}).items():
            shown = " / ".join(f"{v:.2f}" for v in limits)
            print(f"- batch-1 step limit, the read bandwidth measured just before "
                  f"{SYSTEMS[name]}'s turn: {shown}")  # fmt: skip
        for row in rows:
            for name in names:
                values = row.get(f"{name}_rounds")
                if values:
                    shown = " / ".join("-" if v is None else f"{v:.2f}" for v in values)
                    print(f"- {row['phase'][1:]} stream(s) {row['metric']}, {SYSTEMS[name]}: "
                          f"{shown}")  # fmt: skip
    if goals:
        print()
        for g in goals:
            met = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
            print(f"- {g['system']}: {g['target']}: {g['shown']}: {met}")
    for name, res in results.items():
        if "kv_sent_mb" in res:
            note = "" if res["kv_sent_mb"] else " (none: prompts were NOT prefilled remotely)"
            print(f"\n{SYSTEMS[name]}: KV sent prefill -> decode {res['kv_sent_mb']:.1f} MB{note}")
        for phase, s in res.items():
            if isinstance(s, dict) and (s["errors"] or s["first_errors"]):
                print(f"\n{SYSTEMS[name]} {phase}: {s['errors']} errors: {s['first_errors']}")
