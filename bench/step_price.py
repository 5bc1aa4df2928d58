"""How the planners' price of a step (``rakv.step_load.step_price_s``, the ITL pace's
clock) compares with what the recorded steps took: per serving trace, the median of
price / measured seconds over its plain steps (decodes and rounds) and over its steps
with a prefill chunk; beside the latter, the price a chunk had when its rows were priced
on the rounds' rows curve (``ModelTimings.rows_extra_s`` extended past the longest
round measured), as before chunks were priced by the prefill's own line.

    python -m bench.step_price                                  # every Qwen serving trace
    python -m bench.step_price --trace traces/qwen-coder-chat-serve --json

Imports no torch; reads the traces only (seconds, no GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1] / "traces"


def rows_curve_price_s(step, timings) -> float:
    """A step's price with every row on the rows curve, chunks' included (the rule before)."""
    num_context = max(n + rows for n, rows in zip(step.num_cached, step.rows))
    return timings.target.step_s(num_context) + timings.target.rows_extra_s(sum(step.rows))


def ratios(trace) -> dict:
    """Median price / measured over the trace's recorded steps, by kind of step."""
    from rakv.scheduler import PREFILL, Composition
    from rakv.step_load import step_price_s
    from simulator.serve_validate import recorded_table
    timings = trace.require_inputs().timings
    plain, chunk, chunk_before = [], [], []
    for rows in recorded_table(trace, "steps").values():
        for row in rows:
            step = Composition.of(row)
            if not row.seconds > 0 or not step.rows:
                continue
            if PREFILL in step.kinds:
                chunk.append(step_price_s(step, timings) / row.seconds)
                chunk_before.append(rows_curve_price_s(step, timings) / row.seconds)
            else:
                plain.append(step_price_s(step, timings) / row.seconds)
    median = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return {"trace": trace.path.name, "num_plain": len(plain), "plain": median(plain), "num_chunk": len(chunk),
            "chunk": median(chunk), "chunk_on_rows_curve": median(chunk_before)}


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
