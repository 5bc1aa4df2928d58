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
  the runs pooled (``simulator.load_result.summarize_load``).
- Per (load, policy) a ``simulator.load_result.LoadResult``: latency percentiles, tok/s,
  goodput under an SLO, and the share of rounds that speculate by running batch size.
- Per load the best fixed policy is marked, and a sweep under an SLO ends with each
  policy's goodput summed against the best single fixed policy's
  (``simulator.sweep_summary``).
- With an attainment goal (``--attainment``), each policy's capacity: the highest rate at
  which it keeps that share of its requests within the SLO (``simulator.capacity``),
  bisected by further replays between the sweep's rates.
- Two references may stand beside the policies: ``foresight`` (``simulator.foresight``)
  and ``causal-bound`` (``simulator.causal_bound``: ``rakv`` under the settings of
  ``LOAD_GRID`` that serve the sweep best, found by replaying it under each first).

Invariants: a result is a function of the trace, the settings, the batching limits, the
loads, the requests and the seeds (every load starts from an empty store and a fresh
policy, as the recorder's fresh engine does); at the recorded settings, requests, limits
and seed, a load's replay is ``serve_validate``'s free-running one.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from typing import Sequence

from profiler.arrivals import parse_loads
from profiler.serve_record import Load, loads_of
from profiler.serve_summary import Slo, num_meeting_slo, slo_option
from rakv.controller import ControllerConfig, CostModelPolicy
from rakv.settings import DecisionInputs, Settings
from simulator.causal_bound import (LOAD_GRID, MEANING as CAUSAL_MEANING, NAME as CAUSAL, CausalBound, causal_bound,
                                   num_settings, tuned)
from simulator.capacity import Capacity, attainment_goals, capacity_lines, check_attainment, sweep_capacities
from simulator.foresight import MEANING as FORESIGHT_MEANING, NAME as FORESIGHT, ForesightPolicy
from simulator.load_result import LoadResult, summarize_load
from simulator.serve_sim import LoadRun
from simulator.serve_validate import ServingReplay, fit_serving_costs, recorded_steps
from simulator.step_costs import StepCosts, load_speeds
from simulator.sweep_summary import FIXED, REFERENCES, mark_best_fixed, summary_lines, sweep_summary
from simulator.trace import Trace

PROGRESS_MIN_REQUESTS = 5000  # replays of fewer requests than this in all show no progress bar


def progress_bar(total: int, desc: str, unit: str = "req", num_requests: int | None = None):
    """A progress bar on stderr (tqdm's) over ``total`` units of work that replays
    ``num_requests`` requests (default: ``total``); None for fewer than
    ``PROGRESS_MIN_REQUESTS``."""
    if (total if num_requests is None else num_requests) < PROGRESS_MIN_REQUESTS:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def replay_loads(servings: Sequence[ServingReplay], costs: StepCosts, names: list[str], loads: list[Load],
                 slo: Slo | None = None, speeds: dict[tuple[str, str], float] | None = None,
                 causal: ControllerConfig | None = None, progress: bool = True) -> list[LoadResult]:
    """Every named policy at every load, in that order (load by load), under each of
    ``servings`` (one per seed), pooled (``summarize_load``); the references as ``fresh``
    makes them. ``speeds``: per recorded (load, policy), the machine's speed as it ran
    (``step_costs.load_speeds``), which prices its replay as ``serve_validate`` prices it;
    any other at the usual speed. A progress bar for long work, unless not ``progress``."""
    total = len(loads) * len(names) * sum(len(serving.requests) for serving in servings)
    bar = progress_bar(total, "replay") if progress else None

    def run(load: Load, name: str, serving: ServingReplay) -> LoadRun:
        speed = (speeds or {}).get((load.label, name), 1.0)
        found = serving.run(load, fresh(serving, name, causal), replace(costs, speed=speed))
        if bar is not None:
            bar.update(len(found.requests))
        return found
    results = [summarize_load(load.label, name, [run(load, name, serving) for serving in servings], slo)
               for load in loads for name in names]
    if bar is not None:
        bar.close()
    return mark_best_fixed(results)


def fresh(serving: ServingReplay, name: str, causal: ControllerConfig | None = None):
    """A policy's name, or a fresh reference (one per load): ``foresight`` under the
    replay's controller settings, as ``rakv``'s; the causal bound ``rakv``'s policy under
    ``causal``, its tuned controller settings."""
    if name == FORESIGHT:
        return ForesightPolicy(serving.inputs.timings, serving.inputs.controller)
    if name == CAUSAL:
        if causal is None:
            raise ValueError(f"{CAUSAL} needs its tuned settings (tune_causal)")
        return CostModelPolicy(serving.inputs.timings, causal, name=CAUSAL)
    return name


def sweep_score(results: list[LoadResult]) -> float:
    """What the causal bound is tuned by: goodput summed over the loads (output tok/s
    without an SLO)."""
    return sum(r.output_tok_per_s if r.goodput_per_s is None else r.goodput_per_s for r in results)


def tune_causal(servings: Sequence[ServingReplay], costs: StepCosts, loads: list[Load], slo: Slo | None,
                inputs: DecisionInputs, speeds: dict[tuple[str, str], float] | None = None
                ) -> tuple[CausalBound, ControllerConfig]:
    """The causal bound under load (``simulator.causal_bound``), and its controller
    settings: ``rakv``'s policy under the replay's settings and under each of
    ``LOAD_GRID``'s, every load replayed under each of ``servings``, pooled, scored by
    ``sweep_score``. A progress bar for long work."""
    total = num_settings(LOAD_GRID)
    bar = progress_bar(total, "causal bound", "setting", total * len(loads) * sum(len(s.requests) for s in servings))

    def score_under(settings: Settings) -> float:
        return sweep_score(replay_loads(servings, costs, [CAUSAL], loads, slo, speeds, settings.controller,
                                        progress=False))
    base = Settings(inputs.engine, inputs.controller)
    found = causal_bound(score_under, base, grid=LOAD_GRID, done=None if bar is None else bar.update)
    if bar is not None:
        bar.close()
    return found, tuned(base, found.assignments).controller


def capacities(servings: Sequence[ServingReplay], costs: StepCosts, results: list[LoadResult], slo: Slo,
               goals: Sequence[float], causal: ControllerConfig | None = None) -> list[Capacity]:
    """Each policy's capacity at each of ``goals`` (``simulator.capacity``), goal by goal,
    bisected by replaying it at rates between the sweep's, under each of ``servings``,
    pooled."""
    # shown where the sweep's was: a bisection replays about as many requests as its sweep did
    bar = progress_bar(len(goals) * len({r.policy for r in results}), "capacity", "policy",
                       len(results) * sum(len(serving.requests) for serving in servings))

    def attainment_at(name: str, rate_per_s: float) -> float:
        runs = [serving.run(Load(rate_per_s=rate_per_s), fresh(serving, name, causal), costs) for serving in servings]
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


def markdown(results: list[LoadResult], title: str, bound: CausalBound | None = None) -> str:
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
    if any(r.policy == FORESIGHT for r in results):
        lines.append(f"{FORESIGHT}: {FORESIGHT_MEANING} (simulator.foresight), a reference, not a policy an "
                     f"engine can run")
    if bound is not None:
        settings = ", ".join(bound.assignments) or "the replay's own"
        score = "the goodput" if with_slo else "output tok/s"
        lines.append(f"{CAUSAL}: {CAUSAL_MEANING} ({settings}, the best of {bound.num_tried} settings by {score} "
                     f"summed over the loads; simulator.causal_bound), a reference for planners that cannot see a "
                     f"round's outcome")
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
                              ttft_target_s=args.ttft_target, max_num_prefills=args.max_num_prefills)
                for seed in args.seed or (None,)]  # --seed's list (``parse_seeds``): each load replayed under each
    # the trace's own loads, requests and arrivals: each recorded (load, policy) at the machine's speed as it ran;
    # with --attainment every load at the usual speed, as the rates its capacities are bisected at
    recorded = all(given is None for given in (args.concurrency, args.arrival_rate, args.requests, args.seed,
                                               args.attainment))
    steps = recorded_steps(trace)  # read once: the costs' overheads are fitted on them too
    costs = fit_serving_costs(trace, steps)
    speeds = load_speeds(steps) if recorded else {}
    bound, causal = tune_causal(servings, costs, loads, slo, inputs, speeds) if CAUSAL in names else (None, None)
    results = replay_loads(servings, costs, names, loads, slo, speeds, causal)
    found = capacities(servings, costs, results, slo, goals, causal) if goals else []
    if args.json:
        for r in results + found + ([bound] if bound is not None else []):
            print(json.dumps(asdict(r)))
    else:
        serving, batch = servings[0], servings[0].batch
        print(markdown(results, f"{title}\n{_requests_line(servings)}, up to {serving.max_new} new tokens "
                                f"each; max_num_seqs {batch.max_num_seqs}, max_num_batched_tokens "
                                f"{batch.max_num_batched_tokens}, max_num_prefills {batch.max_num_prefills}; "
                                f"ITL target {_seconds(batch.itl_target_s)}; TTFT target "
                                f"{_seconds(batch.ttft_target_s)}; steps priced from the serving grid",
                       bound))
        if found:
            print("\n".join([""] + capacity_lines(found, FIXED, REFERENCES)))
    if args.plot is not None:
        from simulator.plots import write_load_plots
        for path in write_load_plots(args.plot, results, trace.path.name, found):
            print(f"wrote {path}", file=sys.stderr)
    return 0
