"""One policy at one load, as the batched replay served it: a ``LoadResult``. Imports no torch.

A ``LoadResult`` holds the p50/p90/p99 of TTFT, ITL (each request's mean after its first
token) and e2e; output tok/s over the load's span (first arrival to last finish); goodput
under an SLO (vLLM's ``benchmark_serving --goodput``: the requests that met every stated
bound, per second of that span; None without an SLO); and the share of rounds that
speculate by running batch size: of each step's decode and verify works (a prefill chunk
is no round), those with k > 0, counted against the step's number of decode and verify
works (the requests decoding together; a step that only prefills has none and counts
nowhere).

Under several seeds a load's runs are pooled as if served one after another
(``summarize_load``): percentiles over all their requests, counts summed, the rates per
second over their spans summed. Several seeds are the same workload seen more times,
where more requests of one seed would repeat its prompts more.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from profiler.serve_summary import Percentiles, Slo, goodput, load_latencies, span_of
from rakv.scheduler import PREFILL
from simulator.serve_sim import LoadRun


@dataclass(frozen=True)
class SpeculationAt:
    """The rounds of steps with ``batch_size`` decode and verify works: how many, and how
    many of them speculated (k > 0)."""

    batch_size: int
    num_rounds: int
    num_speculating: int

    @property
    def share(self) -> float:
        return self.num_speculating / self.num_rounds if self.num_rounds else 0.0


def speculation_by_batch(steps: Iterable) -> tuple[SpeculationAt, ...]:
    """``ReplayedStep``s (anything with a ``composition``) -> SpeculationAt per running
    batch size, smallest first."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for step in steps:
        c = step.composition
        ks = [k for kind, k in zip(c.kinds, c.ks) if kind != PREFILL]
        if ks:
            entry = counts[len(ks)]
            entry[0] += len(ks)
            entry[1] += sum(k > 0 for k in ks)
    return tuple(SpeculationAt(b, n, s) for b, (n, s) in sorted(counts.items()))


@dataclass(frozen=True)
class LoadResult:
    """One policy at one load, simulated; times in seconds from the load's start."""

    load: str  # c=N or rate=R
    policy: str
    num_requests: int
    num_steps: int
    span_s: float  # first arrival to last finish
    num_output_tokens: int
    output_tok_per_s: float
    ttft: Percentiles
    itl: Percentiles  # of each request's mean inter-token latency after its first token
    e2e: Percentiles
    slo: str | None  # the SLO stated (``Slo.describe``), None: none
    num_meeting_slo: int | None
    goodput_per_s: float | None  # num_meeting_slo / span_s
    share_speculating: float  # of every decode and verify work
    speculation: tuple[SpeculationAt, ...]  # by running batch size
    num_reused: int = 0  # requests that reused stored KV (as ``profiler.serve_summary`` counts them live)
    best_fixed: bool = False  # the best fixed policy at its load (``mark_best_fixed``)
    arrivals_span_s: float = 0.0  # first arrival to last: at a rate, the same for every policy


def summarize_load(load: str, policy: str, runs: Sequence[LoadRun], slo: Slo | None) -> LoadResult:
    """One policy at one load; ``runs``: one per seed, pooled as if served one after
    another: percentiles over all their requests, their spans (and their arrivals' spans)
    summed, and the rates per second over the summed span."""
    per_run = [run.times() for run in runs]
    times = [t for found in per_run for t in found]
    stats = load_latencies(times)
    span_s = sum(map(span_of, per_run))
    steps = [step for run in runs for step in run.steps]
    speculation = speculation_by_batch(steps)
    num_rounds = sum(at.num_rounds for at in speculation)
    good, good_per_s = goodput(times, slo, span_s)
    return LoadResult(
        load, policy, len(times), len(steps), span_s, stats.num_output_tokens,
        stats.num_output_tokens / span_s if span_s > 0 else 0.0,
        stats.ttft, stats.itl, stats.e2e, None if good is None else slo.describe(), good,
        good_per_s,
        sum(at.num_speculating for at in speculation) / num_rounds if num_rounds else 0.0, speculation,
        sum(r.num_reused_tokens > 0 for run in runs for r in run.requests),
        arrivals_span_s=sum(max(a for a, *_ in found) - min(a for a, *_ in found) for found in per_run))
