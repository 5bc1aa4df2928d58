"""``python -m simulator.replay`` on a serving trace: each policy at each load, served by the
batching engine's replay. Imports no torch.

For every (load, policy) a fresh ``simulator.batch_replay.BatchReplay`` (the engine's own
scheduler, store model and the policy, over the trace's facts) serves the requests on the
modelled clock (``simulator.serve_sim.run_load``), each step priced by
``simulator.step_costs`` with the overheads fitted on the trace's recorded steps
(``serve_validate.fit_serving_costs``).

- Loads (``profiler.serve_record.Load``): ``c=N``, a closed loop (N in flight, the next
  submitted when one finishes, in request order); ``rate=R``, an open loop at Poisson
  arrivals from the seed's arrival stream (``profiler.arrivals.arrivals_s``: every rate
  draws the same standard exponentials, so the rates of a sweep differ in rate only). With
  neither given, the loads the trace recorded; with its requests and seed too, each
  recorded (load, policy) is priced at the machine's speed as it ran (its probe, schema
  1.5: ``step_costs.load_speeds``), as ``serve_validate`` prices it.
- Requests: the trace's serving requests (``config.serve_requests``), or ``--requests N``
  resampled with their prefix families (``simulator.schedule``). Under several seeds
  (``--seed 0,1,2``), each load is replayed under each seed's requests and arrivals, and
  the runs pooled as if served one after another (``summarize_load``): the same workload
  seen more times, where more requests of one seed would repeat its prompts more.
- Per (load, policy) a ``LoadResult``: p50/p90/p99 of TTFT, ITL (each request's mean after
  its first token) and e2e, output tok/s over the load's span (first arrival to last
  finish), goodput under an SLO (vLLM's ``benchmark_serving --goodput``: the requests that
  met every stated bound, per second of that span; None without an SLO), and the share of
  rounds that speculate by running batch size: of each step's decode and verify works (a
  prefill chunk is no round), those with k > 0, counted against the step's number of
  decode and verify works (the requests decoding together; a step that only prefills has
  none and counts nowhere).
- Per load, the best fixed policy (``rakv.choices``) by goodput, or by tok/s without an
  SLO, is marked: what a policy that adapts must beat.
- Over a sweep of several loads under an SLO (``SweepSummary``): each policy's goodput
  summed over the loads against the best single fixed policy's, the same sum for the best
  of all the policies at each load chosen in hindsight (the envelope of what was
  replayed), and the loads where an adaptive policy kept fewer requests within the SLO
  than ``kv-only``. Two references stand apart from the policies: ``foresight``
  (``simulator.foresight``: ``rakv`` knowing each round's outcome) where it was replayed,
  with the share of its gain over the best fixed policy each adaptive policy reaches; and,
  over open loops, the ceiling no policy can pass: every request within the SLO,
  each load's requests over its arrivals' span (a load's span runs from its first arrival
  to its last finish, so it is never shorter).
- With an attainment goal (``--attainment``), each policy's capacity: the highest rate at
  which it keeps that share of its requests within the SLO (``simulator.capacity``),
  bisected by further replays between the sweep's rates.

Invariants: a result is a function of the trace, the settings, the batching limits, the
loads, the requests and the seeds (every load starts from an empty store and a fresh
policy, as the recorder's fresh engine does); at the recorded settings, requests, limits
and seed, a load's replay is ``serve_validate``'s free-running one.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Sequence

from profiler.arrivals import parse_loads
from profiler.serve_record import Load, loads_of
from profiler.serve_summary import Percentiles, Slo, goodput, load_latencies, num_meeting_slo, slo_option, span_of
from rakv.choices import fixed_policy_names
from rakv.scheduler import PREFILL
from rakv.settings import DecisionInputs
from simulator.capacity import Capacity, attainment_goals, capacity_lines, check_attainment, sweep_capacities
from simulator.foresight import MEANING as FORESIGHT_MEANING, NAME as FORESIGHT, ForesightPolicy
from simulator.serve_sim import LoadRun
from simulator.serve_validate import ServingReplay, fit_serving_costs, recorded_steps
from simulator.step_costs import StepCosts, load_speeds
from simulator.trace import Trace

FIXED = frozenset(fixed_policy_names(True))
PROGRESS_MIN_REQUESTS = 5000  # replays of fewer requests than this in all show no progress bar
REFERENCES = frozenset({FORESIGHT})  # replayed beside the policies, never one of them


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


def _score(result: LoadResult) -> tuple[float, ...]:
    if result.goodput_per_s is None:
        return (result.output_tok_per_s,)
    return result.goodput_per_s, result.output_tok_per_s


def mark_best_fixed(results: list[LoadResult]) -> list[LoadResult]:
    """``results`` with, per load, the fixed policy of the highest goodput (then tok/s;
    tok/s alone without an SLO) marked; the first listed wins a tie."""
    best: dict[str, LoadResult] = {}
    for r in results:
        if r.policy in FIXED and (r.load not in best or _score(r) > _score(best[r.load])):
            best[r.load] = r
    return [replace(r, best_fixed=True) if best.get(r.load) is r else r for r in results]


@dataclass(frozen=True)
class Shortfall:
    """A load where an adaptive policy kept fewer requests within the SLO than ``kv-only``."""

    load: str
    num_meeting_slo: int
    kv_only_meeting_slo: int
    num_requests: int


@dataclass(frozen=True)
class SweepSummary:
    """Goodput summed over a sweep's loads (req/s), per policy in the order replayed."""

    num_loads: int
    goodput_per_s: dict[str, float]
    best_fixed: str  # the fixed policy of the highest sum
    envelope_per_s: float  # at each load the best policy's goodput, in hindsight, summed
    below_kv_only: dict[str, tuple[Shortfall, ...]]  # per adaptive policy, the loads where it met the SLO less often
    references_per_s: dict[str, float]  # per reference replayed (``REFERENCES``), as ``goodput_per_s``
    # every request of every load within the SLO over its arrivals' span, summed: above any
    # policy's sum; None where a load is a closed loop (its arrivals follow the policy)
    ceiling_per_s: float | None

    def over_best_fixed(self, goodput_per_s: float) -> float:
        return goodput_per_s / self.goodput_per_s[self.best_fixed] - 1.0

    def shares_of(self, reference_per_s: float, names: list[str]) -> list[tuple[str, float]]:
        """Per policy of ``names``, the share of a reference's gain over the best fixed
        policy that it reaches; none where the reference gains nothing."""
        gain = reference_per_s - self.goodput_per_s[self.best_fixed]
        if gain <= 0:
            return []
        return [(name, (self.goodput_per_s[name] - self.goodput_per_s[self.best_fixed]) / gain) for name in names]


def sweep_summary(results: list[LoadResult]) -> SweepSummary | None:
    """The sweep's summary; None for one load, without an SLO or without a fixed policy."""
    loads = list(dict.fromkeys(r.load for r in results))
    if len(loads) < 2 or any(r.goodput_per_s is None for r in results):
        return None
    totals: dict[str, float] = defaultdict(float)
    best_at: dict[str, float] = defaultdict(float)
    ceiling_at: dict[str, float] = {}
    for r in results:
        totals[r.policy] += r.goodput_per_s
        if r.policy not in REFERENCES:
            best_at[r.load] = max(best_at[r.load], r.goodput_per_s)
        if r.arrivals_span_s > 0:
            ceiling_at[r.load] = r.num_requests / r.arrivals_span_s
    open_loops = all(load.startswith("rate=") for load in loads) and len(ceiling_at) == len(loads)
    fixed = [name for name in totals if name in FIXED]
    if not fixed:
        return None
    kv_only = {r.load: r.num_meeting_slo for r in results if r.policy == "kv-only"}
    below: dict[str, list[Shortfall]] = defaultdict(list)
    for r in results:
        if r.policy not in FIXED | REFERENCES and r.load in kv_only and r.num_meeting_slo < kv_only[r.load]:
            below[r.policy].append(Shortfall(r.load, r.num_meeting_slo, kv_only[r.load], r.num_requests))
    references = {name: totals.pop(name) for name in list(totals) if name in REFERENCES}
    return SweepSummary(len(loads), dict(totals), max(fixed, key=totals.__getitem__), sum(best_at.values()),
                        {name: tuple(found) for name, found in below.items()}, references,
                        sum(ceiling_at.values()) if open_loops else None)


def summary_lines(summary: SweepSummary) -> list[str]:
    best = summary.best_fixed
    adaptive = [name for name in summary.goodput_per_s if name not in FIXED]
    over = "".join(f"; {name} {summary.goodput_per_s[name]:.3f} "
                   f"({100 * summary.over_best_fixed(summary.goodput_per_s[name]):+.1f} %)" for name in adaptive)
    envelope = summary.envelope_per_s
    lines = [f"Over the sweep, goodput summed over its {summary.num_loads} loads (req/s): the best single fixed "
             f"policy {best} {summary.goodput_per_s[best]:.3f}{over}; the best of the policies replayed at each "
             f"load, in hindsight, {envelope:.3f} ({100 * summary.over_best_fixed(envelope):+.1f} %)"]
    if "kv-only" in summary.goodput_per_s and adaptive:
        below = "; ".join(f"{name} at " + ", ".join(f"{s.load} ({s.num_meeting_slo} of {s.num_requests} against "
                                                    f"{s.kv_only_meeting_slo})" for s in summary.below_kv_only[name])
                          for name in adaptive if summary.below_kv_only.get(name))
        lines.append(f"Adaptive policies within the SLO less often than kv-only: {below or 'none'}")
    over = summary.over_best_fixed
    references = [f"{name} ({FORESIGHT_MEANING}) {per_s:.3f} ({100 * over(per_s):+.1f} %"
                  + "".join(f"; {a} {100 * s:.0f} % of its gain" for a, s in summary.shares_of(per_s, adaptive))
                  + ")" for name, per_s in summary.references_per_s.items()]
    if summary.ceiling_per_s is not None:
        references.append(f"every request within the SLO, each load's requests over its arrivals' span (no policy "
                          f"passes it) {summary.ceiling_per_s:.3f} ({100 * over(summary.ceiling_per_s):+.1f} %)")
    if references:
        lines.append(f"References, not policies: {'; '.join(references)}")
    return lines


def progress_bar(total: int, desc: str, unit: str = "req", num_requests: int | None = None):
    """A progress bar on stderr (tqdm's) over ``total`` units of work that replays
    ``num_requests`` requests (default: ``total``); None for fewer than
    ``PROGRESS_MIN_REQUESTS``."""
    if (total if num_requests is None else num_requests) < PROGRESS_MIN_REQUESTS:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def replay_loads(servings: Sequence[ServingReplay], costs: StepCosts, names: list[str], loads: list[Load],
                 slo: Slo | None = None, speeds: dict[tuple[str, str], float] | None = None) -> list[LoadResult]:
    """Every named policy at every load, in that order (load by load), under each of
    ``servings`` (one per seed), pooled (``summarize_load``); ``foresight`` under the
    replay's controller settings, as ``rakv``. ``speeds``: per recorded (load, policy), the
    machine's speed as it ran (``step_costs.load_speeds``), which prices its replay as
    ``serve_validate`` prices it; any other at the usual speed. A progress bar for long work."""
    bar = progress_bar(len(loads) * len(names) * sum(len(serving.requests) for serving in servings), "replay")

    def run(load: Load, name: str, serving: ServingReplay) -> LoadRun:
        speed = (speeds or {}).get((load.label, name), 1.0)
        found = serving.run(load, fresh(serving, name), replace(costs, speed=speed))
        if bar is not None:
            bar.update(len(found.requests))
        return found
    results = [summarize_load(load.label, name, [run(load, name, serving) for serving in servings], slo)
               for load in loads for name in names]
    if bar is not None:
        bar.close()
    return mark_best_fixed(results)


def fresh(serving: ServingReplay, name: str):
    """A policy's name, or for ``foresight`` a fresh reference under the replay's
    controller settings, as ``rakv``'s (one per load)."""
    return ForesightPolicy(serving.inputs.timings, serving.inputs.controller) if name == FORESIGHT else name


def capacities(servings: Sequence[ServingReplay], costs: StepCosts, results: list[LoadResult], slo: Slo,
               goals: Sequence[float]) -> list[Capacity]:
    """Each policy's capacity at each of ``goals`` (``simulator.capacity``), goal by goal,
    bisected by replaying it at rates between the sweep's, under each of ``servings``,
    pooled."""
    # shown where the sweep's was: a bisection replays about as many requests as its sweep did
    bar = progress_bar(len(goals) * len({r.policy for r in results}), "capacity", "policy",
                       len(results) * sum(len(serving.requests) for serving in servings))

    def attainment_at(name: str, rate_per_s: float) -> float:
        runs = [serving.run(Load(rate_per_s=rate_per_s), fresh(serving, name), costs) for serving in servings]
        return sum(num_meeting_slo(run.times(), slo) for run in runs) / sum(len(run.requests) for run in runs)
    found = [capacity for goal in goals
             for capacity in sweep_capacities(results, goal, attainment_at, done=None if bar is None else bar.update)]
    if bar is not None:
        bar.close()
    return found


def has_serving_grid(trace: Trace) -> bool:
    """Whether the trace can be replayed under load: batched forwards in its ops, or steps."""
    return any(op.op == "batch" for op in trace.ops) or bool(recorded_steps(trace))



def loads_given(trace: Trace, concurrency: str | None, rates: str | None) -> list[Load]:
    """``--concurrency`` and ``--arrival-rate`` (comma lists), else the loads the trace recorded."""
    if concurrency is None and rates is None:
        config = trace.meta.config
        loads = loads_of(tuple(config.get("serve_concurrency") or ()), tuple(config.get("serve_rate") or ()))
        if not loads:
            raise ValueError(f"{trace.path}: the trace records no loads; give --concurrency or --arrival-rate")
        return loads
    return loads_of(parse_loads(concurrency, "--concurrency", True) if concurrency is not None else (),
                    parse_loads(rates, "--arrival-rate", False) if rates is not None else ())


def markdown(results: list[LoadResult], title: str) -> str:
    with_slo = any(r.goodput_per_s is not None for r in results)
    lines = [title, "",
             "| load | policy | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 (s) | e2e p50 / p99 (s) | tok/s "
             + ("| goodput (req/s) " if with_slo else "") + "| reused the store | share speculating | by batch size |",
             "|---|---|---|---|---|---" + ("|---" if with_slo else "") + "|---|---|---|"]
    for r in results:
        goodput_text = (f"| {r.goodput_per_s:.3f} ({r.num_meeting_slo} of {r.num_requests}) " if with_slo else "")
        by_batch = " ".join(f"{at.batch_size}:{at.share:.2f}" for at in r.speculation) or "-"
        lines.append(f"| {r.load} | {r.policy}{' *' if r.best_fixed else ''} "
                     f"| {r.ttft.p50_s:.3f} / {r.ttft.p90_s:.3f} / {r.ttft.p99_s:.3f} "
                     f"| {r.itl.p50_s:.4f} / {r.itl.p90_s:.4f} | {r.e2e.p50_s:.2f} / {r.e2e.p99_s:.2f} "
                     f"| {r.output_tok_per_s:.2f} {goodput_text}| {r.num_reused} of {r.num_requests} "
                     f"| {r.share_speculating:.2f} | {by_batch} |")
    lines.append("")
    if any(r.best_fixed for r in results):
        slo = next(r.slo for r in results if r.slo is not None) if with_slo else None
        lines.append(f"* the best fixed policy at its load by {f'goodput ({slo})' if slo else 'output tok/s'}")
    lines.append("share speculating: of the rounds (decode and verify works), those with k > 0; by batch size: "
                 "the same by the number of rounds in their step")
    if any(r.policy in REFERENCES for r in results):
        lines.append(f"{FORESIGHT}: {FORESIGHT_MEANING} (simulator.foresight), a reference, not a policy an "
                     f"engine can run")
    summary = sweep_summary(results)
    if summary is not None:
        lines += [""] + summary_lines(summary)
    return "\n".join(lines)


def _requests_line(servings: Sequence[ServingReplay]) -> str:
    """How many requests each load served: under several seeds, each seed's, pooled."""
    if len(servings) == 1:
        return f"{len(servings[0].requests)} requests"
    seeds = ", ".join(str(serving.seed) for serving in servings)
    return f"{len(servings[0].requests)} requests under each of seeds {seeds}, pooled"


def _seconds(target_s: float | None) -> str:
    return "none" if target_s is None else f"{target_s:g} s"


def serve_loads(args, trace: Trace, inputs: DecisionInputs, names: list[str], title: str) -> int:
    """``simulator.replay``'s batched mode: ``names`` (checked, no oracle) at the loads
    ``args`` gives, decided with ``inputs``; prints a table or JSON lines, writes plots."""
    slo = slo_option(args.slo)
    loads = loads_given(trace, args.concurrency, args.arrival_rate)
    goals = attainment_goals(args.attainment) if args.attainment is not None else ()
    if goals:
        check_attainment(slo, [load.rate_per_s for load in loads])
    servings = [ServingReplay(trace, inputs, args.requests, seed, strict=args.strict,
                              recorded_policies=args.as_recorded, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, itl_target_s=args.itl_target,
                              ttft_target_s=args.ttft_target)
                for seed in args.seed or (None,)]  # --seed's list (``parse_seeds``): each load replayed under each
    # the trace's own loads, requests and arrivals: each recorded (load, policy) at the machine's speed as it ran;
    # with --attainment every load at the usual speed, as the rates its capacities are bisected at
    recorded = all(given is None for given in (args.concurrency, args.arrival_rate, args.requests, args.seed,
                                               args.attainment))
    steps = recorded_steps(trace)  # read once: the costs' overheads are fitted on them too
    costs = fit_serving_costs(trace, steps)
    results = replay_loads(servings, costs, names, loads, slo, load_speeds(steps) if recorded else {})
    found = capacities(servings, costs, results, slo, goals) if goals else []
    if args.json:
        for r in results + found:
            print(json.dumps(asdict(r)))
    else:
        serving, batch = servings[0], servings[0].batch
        print(markdown(results, f"{title}\n{_requests_line(servings)}, up to {serving.max_new} new tokens "
                                f"each; max_num_seqs {batch.max_num_seqs}, max_num_batched_tokens "
                                f"{batch.max_num_batched_tokens}; ITL target {_seconds(batch.itl_target_s)}; "
                                f"TTFT target {_seconds(batch.ttft_target_s)}; steps priced from the serving grid"))
        if found:
            print("\n".join([""] + capacity_lines(found, FIXED, REFERENCES)))
    if args.plot is not None:
        from simulator.plots import write_load_plots
        for path in write_load_plots(args.plot, results, trace.path.name, found):
            print(f"wrote {path}", file=sys.stderr)
    return 0
