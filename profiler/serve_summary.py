"""``python -m profiler.serve_summary --trace DIR [--slo ttft=S,itl=S]``: what a serving
trace measured, as tables. Imports no torch.

Per (load, policy) of the served and steps tables: output tok/s (every output token over
the span from the first arrival to the last finish), TTFT and e2e medians, the steps and
their mean requests and rows, outputs equal to greedy, preemptions, and with an SLO the
measured goodput (as ``simulator.replay --slo`` reports the replayed one). Then the batched
forwards of the ops table (op ``batch``): each shape's median, and in one-row steps (one
request, one row, at the same context).

A load's statistics are defined here once, for measured and simulated loads alike
(``simulator.serve_validate``, ``simulator.load_result``): percentiles (numpy's linear
interpolation, as ``vllm bench serve``; ``bench.serve`` takes them and the SLO from here),
a request's ITL as its mean after its first token (vLLM's TPOT), and an SLO (``Slo``:
per-request bounds on TTFT, that mean ITL and e2e; a one-token request has no ITL to
exceed), whose goodput is the requests meeting every bound per second of the load's span.
"""
from __future__ import annotations

import argparse
import bisect
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from profiler.schema import META_FIRST_TOKEN_AT, ServedRow, StepRow, TraceError, table_to_rows
from profiler.serve_record import Load
from profiler.trace_io import read_meta, read_table
from rakv.cli import run_cli


SLO_KEYS = ("ttft", "itl", "e2e")


@dataclass(frozen=True)
class Percentiles:
    """p50, p90 and p99 of a sample and its mean; NaN for an empty sample."""

    p50_s: float
    p90_s: float
    p99_s: float
    mean_s: float


def percentiles(values) -> Percentiles:
    values = np.asarray(list(values), dtype=float)
    if values.size == 0:
        return Percentiles(math.nan, math.nan, math.nan, math.nan)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])  # linear interpolation (numpy's default)
    return Percentiles(float(p50), float(p90), float(p99), float(values.mean()))


@dataclass(frozen=True)
class Slo:
    """Per-request bounds in seconds; None: not stated (always met)."""

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    @property
    def stated(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.itl_s, self.e2e_s))

    def describe(self) -> str:
        parts = [f"{key}<={value:g}s" for key, value in zip(SLO_KEYS, (self.ttft_s, self.itl_s, self.e2e_s))
                 if value is not None]
        return ", ".join(parts) or "none"

    def met(self, ttft_s: float | None, itl_s: float | None, e2e_s: float | None) -> bool:
        """Whether a completed request's times meet every stated bound (``itl_s``: its mean
        inter-token latency, None for a one-token request: nothing to exceed)."""
        checks = ((self.ttft_s, ttft_s), (self.itl_s, itl_s), (self.e2e_s, e2e_s))
        return all(bound is None or value is None or value <= bound for bound, value in checks)


def slo_option(text: str | None) -> Slo | None:
    """``--slo``'s value (None: not given) as ``parse_slo`` reads it; a one-line ValueError
    naming the option otherwise."""
    if text is None:
        return None
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise ValueError(f"--slo: {exc}") from None


def parse_slo(text: str) -> Slo:
    """``ttft=0.5,itl=0.1,e2e=4`` (seconds, any subset) as an ``Slo``; a one-line ValueError
    naming the bad part otherwise."""
    bounds: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in SLO_KEYS:
            raise ValueError(f"expected KEY=SECONDS with KEY one of {', '.join(SLO_KEYS)}, got {part!r}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"{key.strip()}: {value!r} is not a number of seconds") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"{key.strip()}: the bound must be a positive number of seconds, got {value!r}")
        bounds[f"{key.strip()}_s"] = seconds
    return Slo(**bounds)


@dataclass(frozen=True)
class LoadLatencies:
    """A load's percentiles of time to first token, inter-token latency (each request's
    mean after its first token) and end to end; the span from its first arrival to its
    last finish, and its output tokens over that span."""

    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    span_s: float
    num_output_tokens: int
    output_tok_per_s: float


def mean_itl_s(first_token_s: float, finish_s: float, num_output_tokens: int) -> float | None:
    """A request's mean inter-token latency after its first token; None with one token."""
    return (finish_s - first_token_s) / (num_output_tokens - 1) if num_output_tokens > 1 else None


def num_meeting_slo(times: list[tuple[float, float, float, int]], slo: Slo) -> int:
    """How many requests ((arrival, first token, finish, output tokens) each) met every
    bound ``slo`` states: goodput's numerator."""
    return sum(slo.met(t - a, mean_itl_s(t, f, n), f - a) for a, t, f, n in times)


def goodput(times: list[tuple[float, float, float, int]], slo: Slo | None,
            span_s: float) -> tuple[int | None, float | None]:
    """(the requests meeting every bound ``slo`` states, their number per second of
    ``span_s``); (None, None) where no SLO is stated."""
    if slo is None or not slo.stated:
        return None, None
    num = num_meeting_slo(times, slo)
    return num, num / span_s if span_s > 0 else 0.0


def span_of(times: list[tuple[float, float, float, int]]) -> float:
    """Seconds from the first arrival to the last finish of (arrival, first token, finish,
    output tokens) per request."""
    return max(f for _, _, f, _ in times) - min(a for a, _, _, _ in times)


def load_latencies(times: list[tuple[float, float, float, int]]) -> LoadLatencies:
    """(arrival, first token, finish, output tokens) per request -> the load's
    LoadLatencies: of served rows as measured, and of a simulated load
    (``simulator.serve_sim``) alike. A load whose requests all made one token has an ITL
    of 0."""
    itl = [mean_itl_s(t, f, n) for _, t, f, n in times if n > 1]
    span_s = span_of(times)
    num_output = sum(n for *_, n in times)
    return LoadLatencies(percentiles([t - a for a, t, _, _ in times]), percentiles(itl or [0.0]),
                         percentiles([f - a for a, _, f, _ in times]), span_s, num_output,
                         num_output / span_s if span_s > 0 else 0.0)


def served_times(rows: list[ServedRow]) -> list[tuple[float, float, float, int]]:
    """Served rows as ``load_latencies`` takes them."""
    return [(r.arrival_s, r.first_token_s, r.finish_s, len(r.output_ids)) for r in rows]


def delivered(served: list[ServedRow], steps: list[StepRow]) -> list[ServedRow]:
    """Served rows of a recording that timed a first token when it was made (no
    ``META_FIRST_TOKEN_AT`` in its config), each first token moved to the end of the
    recorded step that delivered it: the last of its load and policy to start at or
    before it was made (a step starts before its admissions), never past the request's
    finish, which that step also timed. The engine streams a step's tokens when the step
    ends, and an exact repeat's first token, made at its admission, was timed before that
    step ran: its TTFT was short by a step."""
    runs: dict[tuple[str, str], list[StepRow]] = defaultdict(list)
    for step in sorted(steps, key=lambda s: (s.load, s.policy, s.step)):
        runs[step.load, step.policy].append(step)
    starts_s = {key: [s.start_s for s in run] for key, run in runs.items()}
    moved = []
    for row in served:
        key = (row.load, row.policy)
        i = bisect.bisect_right(starts_s.get(key, []), row.first_token_s) - 1
        end_s = runs[key][i].start_s + runs[key][i].seconds if i >= 0 else row.first_token_s
        moved.append(replace(row, first_token_s=min(max(end_s, row.first_token_s), row.finish_s)))
    return moved


def read_served(trace_dir: Path, config: dict, steps: list[StepRow] | None = None
                ) -> tuple[list[ServedRow], list[StepRow]]:
    """A serving trace's served rows, first tokens at their delivery (``delivered``, for
    a recording made before the engine timed them so), and its steps (``steps``: those
    already read, else read here)."""
    served = table_to_rows("served", read_table(trace_dir, "served"))
    if steps is None:
        steps = table_to_rows("steps", read_table(trace_dir, "steps"))
    if config.get(META_FIRST_TOKEN_AT) != "delivery":
        served = delivered(served, steps)
    return served, steps


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
    num_reused: int  # requests that reused stored KV (the store's hits under load)
    num_meeting_slo: int | None  # None: no SLO stated
    goodput_per_s: float | None  # num_meeting_slo / the load's span


def _load_order(label: str) -> tuple[bool, float]:
    """Closed loops before open ones, each by its number."""
    load = Load.of_label(label)
    return load.concurrency is None, load.value


def summarize_loads(served: list[ServedRow], steps: list[StepRow], slo: Slo | None = None) -> list[LoadSummary]:
    """One summary per (load, policy), concurrency before rate, each by its number; its
    goodput under ``slo`` where one is stated."""
    requests, ran = defaultdict(list), defaultdict(list)
    for row in served:
        requests[row.load, row.policy].append(row)
    for step in steps:
        ran[step.load, step.policy].append(step)
    summaries = []
    for (load, policy), rows in sorted(requests.items(), key=lambda kv: (_load_order(kv[0][0]), kv[0][1])):
        times = served_times(rows)
        measured = load_latencies(times)
        its_steps = ran[load, policy]
        num_steps = max(len(its_steps), 1)
        summaries.append(LoadSummary(
            load, policy, measured.output_tok_per_s, measured.ttft.p50_s, measured.e2e.p50_s, len(its_steps),
            sum(len(s.request_ids) for s in its_steps) / num_steps, sum(sum(s.rows) for s in its_steps) / num_steps,
            sum(r.identical_to_ar for r in rows), len(rows), sum(r.num_preemptions for r in rows),
            sum(r.reused_tokens > 0 for r in rows), *goodput(times, slo, measured.span_s)))
    return summaries


def batched_medians_s(ops) -> dict[tuple[str, int, int, int], float]:
    """(model, requests, rows each, context) -> the median seconds of that batched forward."""
    seconds = defaultdict(list)
    for row in ops:
        if row.op == "batch":
            seconds[row.model, row.num_requests, row.num_new_tokens, row.num_cached_tokens].append(row.seconds)
    return {shape: statistics.median(values) for shape, values in seconds.items()}


def run(args) -> int:
    slo = slo_option(args.slo)
    trace = args.trace
    meta = read_meta(trace)
    served, steps = read_served(trace, meta.config)
    if not served:
        raise TraceError(f"{trace}: no served requests (record with --serve-concurrency or --serve-rate)")
    print(f"{trace}: {meta.models.get('pair')} in {meta.models.get('weights')}, {len(served)} served requests, "
          f"{len(steps)} steps")
    with_slo = slo is not None and slo.stated
    print("| load | policy | out tok/s | TTFT p50 (ms) | e2e p50 (s) | steps | requests / step | rows / step "
          "| equal to greedy | preemptions | reused the store |" + (f" goodput (req/s, {slo.describe()}) |"
                                                                  if with_slo else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_slo else ""))
    for s in summarize_loads(served, steps, slo):
        goodput_text = f" {s.goodput_per_s:.3f} ({s.num_meeting_slo} of {s.num_requests}) |" if with_slo else ""
        print(f"| {s.load} | {s.policy} | {s.output_tok_per_s:.2f} | {s.ttft_p50_s * 1e3:.0f} | {s.e2e_p50_s:.2f} | "
              f"{s.num_steps} | {s.mean_requests_per_step:.2f} | {s.mean_rows_per_step:.1f} | "
              f"{s.num_identical} of {s.num_requests} | {s.num_preemptions} | {s.num_reused} of {s.num_requests} |"
              f"{goodput_text}")
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
    p.add_argument("--slo", default=None, metavar="ttft=S,itl=S,e2e=S",
                   help="bounds in seconds, any subset: also each load's measured goodput, the requests meeting "
                        "every bound per second of its span (itl: a request's mean inter-token latency)")
    return run_cli(run, p.parse_args(argv), (TraceError, OSError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
