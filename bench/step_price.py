"""How the planners' price of a step (``rakv.step_load.step_price_s``, the ITL pace's
clock) compares with what the recorded steps took: per serving trace, the median of
price / measured seconds over its plain steps (decodes and rounds) and over its steps
with a prefill chunk; beside the latter, the price a chunk had when its rows were priced
on the rounds' rows curve (``ModelTimings.rows_extra_s`` extended past the longest
round measured), as before chunks were priced by the prefill's own line. And the
target's rows curve as served: of the steps with one request in them and no draft model
(a plain step, or a round of prompt lookup or the store drafter), per number of rows,
the median measured and priced seconds; the planners price a round under load by what
its rows add (``rakv.step_load``), so this is the shape they need right.

    python -m bench.step_price                                  # every Qwen serving trace
    python -m bench.step_price --trace traces/qwen-coder-chat-serve --json

Imports no torch; reads the traces only (seconds, no GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1] / "traces"
MIN_STEPS = 5  # a row count with fewer one-request steps is left out of the rows table


def rows_curve_price_s(step, timings) -> float:
    """A step's price with every row on the rows curve, chunks' included (the rule before)."""
    num_context = max(n + rows for n, rows in zip(step.num_cached, step.rows))
    return timings.target.step_s(num_context) + timings.target.rows_extra_s(sum(step.rows))


def ratios(trace) -> dict:
    """Median price / measured over the trace's recorded steps, by kind of step."""
    from rakv.drafters import DRAFT_MODEL
    from rakv.scheduler import PREFILL, Composition
    from rakv.step_load import step_price_s
    from simulator.serve_validate import recorded_table
    timings = trace.require_inputs().timings
    plain, chunk, chunk_before = [], [], []
    alone: dict[int, list[tuple[float, float]]] = defaultdict(list)  # rows -> (measured, priced) of one request
    for rows in recorded_table(trace, "steps").values():
        for row in rows:
            step = Composition.of(row)
            if not row.seconds > 0 or not step.rows:
                continue
            price_s = step_price_s(step, timings)
            if PREFILL in step.kinds:
                chunk.append(price_s / row.seconds)
                chunk_before.append(rows_curve_price_s(step, timings) / row.seconds)
                continue
            plain.append(price_s / row.seconds)
            if len(step.rows) == 1 and not (step.drafters[0] == DRAFT_MODEL and step.ks[0]):
                alone[step.rows[0]].append((row.seconds, price_s))
    median = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    by_rows = [{"rows": n, "num": len(pairs), "measured_s": round(statistics.median(m for m, _ in pairs), 4),
                "priced_s": round(statistics.median(p for _, p in pairs), 4)}
               for n, pairs in sorted(alone.items()) if len(pairs) >= MIN_STEPS]
    return {"trace": trace.path.name, "num_plain": len(plain), "plain": median(plain), "num_chunk": len(chunk),
            "chunk": median(chunk), "chunk_on_rows_curve": median(chunk_before), "by_rows": by_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_price", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, action="append", default=None,
                   help="a serving trace directory; repeatable (default: every traces/qwen-coder-*-serve*)")
    p.add_argument("--json", action="store_true", help="print one JSON object per trace")
    args = p.parse_args(argv)
    from profiler.schema import TraceError
    from simulator.trace import load_trace
    paths = args.trace or sorted(TRACES.glob("qwen-coder-*-serve*"))
    try:
        rows = [ratios(load_trace(path)) for path in paths]
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print("| trace | plain steps | price / measured | steps with a chunk | price / measured | on the rows curve |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trace']} | {r['num_plain']} | {r['plain']} | {r['num_chunk']} | {r['chunk']} | "
              f"{r['chunk_on_rows_curve']} |")
    print("\none request's steps without a draft model, by rows: median measured / priced ms (steps)\n")
    counts = sorted({b["rows"] for r in rows for b in r["by_rows"]})  # every row count some trace has
    print("| trace \\ rows | " + " | ".join(str(n) for n in counts) + " |")
    print("|---" * (len(counts) + 1) + "|")
    for r in rows:
        cells = {b["rows"]: f"{1e3 * b['measured_s']:.1f} / {1e3 * b['priced_s']:.1f} ({b['num']})"
                 for b in r["by_rows"]}
        print(f"| {r['trace']} | " + " | ".join(cells.get(n, "") for n in counts) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
