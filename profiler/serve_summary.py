"""``python -m profiler.serve_summary --trace DIR``: what a serving trace measured, as tables.
Imports no torch.

Per (load, policy) of the served and steps tables: output tok/s (every output token over
the span from the first arrival to the last finish), TTFT and e2e medians, the steps and
their mean requests and rows, outputs equal to greedy, preemptions. Then the batched
forwards of the ops table (op ``batch``): each shape's median, and in one-row steps (one
request, one row, at the same context).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from profiler.schema import ServedRow, StepRow, TraceError, table_to_rows
from profiler.trace_io import read_meta, read_table
from rakv.cli import run_cli


@dataclass(frozen=True)
class Latencies:
    """A load's (p50, p90) seconds of time to first token, inter-token latency (each
    request's mean after its first token) and end to end, and its output tokens per second
    over the span from the first arrival to the last finish."""

    ttft_s: tuple[float, float]
    itl_s: tuple[float, float]
    e2e_s: tuple[float, float]
    output_tok_per_s: float


def latencies(times: list[tuple[float, float, float, int]]) -> Latencies:
    """(arrival, first token, finish, output tokens) per request -> the load's Latencies:
    of served rows as measured, and of a simulated load (``simulator.serve_sim``) alike."""
    def p50_p90(values) -> tuple[float, float]:
        return float(np.percentile(values, 50)), float(np.percentile(values, 90))
    itl = [(f - t) / (n - 1) for _, t, f, n in times if n > 1]
    span_s = max(f for _, _, f, _ in times) - min(a for a, _, _, _ in times)
    return Latencies(p50_p90([t - a for a, t, _, _ in times]), p50_p90(itl or [0.0]),
                     p50_p90([f - a for a, _, f, _ in times]),
                     sum(n for *_, n in times) / span_s if span_s > 0 else 0.0)


def served_times(rows: list[ServedRow]) -> list[tuple[float, float, float, int]]:
    """Served rows as ``latencies`` takes them."""
    return [(r.arrival_s, r.first_token_s, r.finish_s, len(r.output_ids)) for r in rows]


@dataclass(frozen=True)
class LoadSummary:
    load: str
    policy: str
    output_tok_per_s: float
    ttft_p50_s: float
    e2e_p50_s: float
    num_steps: int
    mean_requests_per_step: float
    mean_rows_per_step: float
    num_identical: int
    num_requests: int
    num_preemptions: int


def _load_order(label: str) -> tuple[str, float]:
    kind, _, value = label.partition("=")
    return kind, float(value)


def summarize_loads(served: list[ServedRow], steps: list[StepRow]) -> list[LoadSummary]:
    """One summary per (load, policy), concurrency before rate, each by its number."""
    requests, ran = defaultdict(list), defaultdict(list)
    for row in served:
        requests[row.load, row.policy].append(row)
    for step in steps:
        ran[step.load, step.policy].append(step)
    summaries = []
    for (load, policy), rows in sorted(requests.items(), key=lambda kv: (_load_order(kv[0][0]), kv[0][1])):
        measured = latencies(served_times(rows))
        its_steps = ran[load, policy]
        num_steps = max(len(its_steps), 1)
        summaries.append(LoadSummary(
            load, policy, measured.output_tok_per_s, measured.ttft_s[0], measured.e2e_s[0], len(its_steps),
            sum(len(s.request_ids) for s in its_steps) / num_steps, sum(sum(s.rows) for s in its_steps) / num_steps,
            sum(r.identical_to_ar for r in rows), len(rows), sum(r.num_preemptions for r in rows)))
    return summaries


def batched_medians_s(ops) -> dict[tuple[str, int, int, int], float]:
    """(model, requests, rows each, context) -> the median seconds of that batched forward."""
    seconds = defaultdict(list)
    for row in ops:
        if row.op == "batch":
            seconds[row.model, row.num_requests, row.num_new_tokens, row.num_cached_tokens].append(row.seconds)
    return {shape: statistics.median(values) for shape, values in seconds.items()}


def run(args) -> int:
    trace = args.trace
    meta = read_meta(trace)
    served = table_to_rows("served", read_table(trace, "served"))
    if not served:
        raise TraceError(f"{trace}: no served requests (record with --serve-concurrency or --serve-rate)")
    steps = table_to_rows("steps", read_table(trace, "steps"))
    print(f"{trace}: {meta.models.get('pair')} in {meta.models.get('weights')}, {len(served)} served requests, "
          f"{len(steps)} steps")
    print("| load | policy | out tok/s | TTFT p50 (ms) | e2e p50 (s) | steps | requests / step | rows / step "
          "| equal to greedy | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summarize_loads(served, steps):
        print(f"| {s.load} | {s.policy} | {s.output_tok_per_s:.2f} | {s.ttft_p50_s * 1e3:.0f} | {s.e2e_p50_s:.2f} | "
              f"{s.num_steps} | {s.mean_requests_per_step:.2f} | {s.mean_rows_per_step:.1f} | "
              f"{s.num_identical} of {s.num_requests} | {s.num_preemptions} |")
    medians = batched_medians_s(table_to_rows("ops", read_table(trace, "ops")))
    if medians:
        print("\n| model | context | requests x rows | ms | in one-row steps |")
        print("|---|---|---|---|---|")
        for (model, num_requests, rows, context), seconds in sorted(medians.items()):
            one = medians.get((model, 1, 1, context))
            steps_text = f"{seconds / one:.2f}" if one else "-"
            print(f"| {model} | {context} | {num_requests} x {rows} | {seconds * 1e3:.1f} | {steps_text} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.serve_summary",
                                description="Tables of a serving trace: each load's throughput and latency, and "
                                            "the batched forwards' costs.")
    p.add_argument("--trace", type=Path, required=True, help="a trace directory recorded with --serve-*")
    return run_cli(run, p.parse_args(argv), (TraceError, OSError))


if __name__ == "__main__":
    sys.exit(main())
