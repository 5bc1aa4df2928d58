"""``python -m simulator.serve_validate``: the batched replay against a serving trace.

For every load (``c=N`` closed loop, ``rate=R`` open loop) and policy the trace recorded:
- the steps, in the recorded admission order: the engine's own scheduler over the trace's
  facts (``simulator.batch_replay``, driven as the recorder drove the engine:
  ``simulator.serve_sim``) must reproduce every recorded step's composition, which
  requests ran, their kinds, rows, contexts, drafters and k. An open loop met its arrivals
  in wall time, so its replay admits each arrival before the first step that the
  recording started after it (the recorded step starts), not by the modelled clock;
- their times (with the recorded compositions): each step priced by
  ``simulator.step_costs`` (the op grid's forwards, overheads fitted on recorded steps)
  against its measured seconds: the mean absolute percentage error per step, of its target
  forward and of its proposals, and the error of the load's whole time;
- the load free-running: the replay on its modelled clock, at the recorded concurrency or
  the recorded Poisson arrivals, against the served requests' measured p50 and p90 time to
  first token, inter-token latency (a request's mean after its first token) and end to end,
  and output tokens per second.
The overheads are fitted on the loads' steps: "in sample" on all of them, "out of sample"
on the other loads' only (leave one load out). Imports no torch.

Each load is priced at the machine's speed as its probes before and after it saw
(``simulator.step_costs.load_speeds``), which misses how fast the machine ran during it:
over the 310 loads of the 28 serving traces shipped on 2026-12-08, a load's recorded
steps took from 28 % less to 27 % more than their out-of-sample price (114 of them off by
more than 5 %), while no policy's mean was off by more than 2 %: the machine, not a policy
the model misprices.
So the replay is also run at each load's own pace (``LoadFidelity.at_pace``: the
out-of-sample costs, scaled by the load's reproduced steps' recorded seconds over their
price): what it misses there is the replay's own error, the rest is the machine's. It
tells the two apart; it predicts nothing, since the pace is read off the load's own steps
(docs/results.md section 41).

How close the replay can come is bounded by how well the machine repeats itself: with
``--again``, another recording of the same loads (the same arguments, recorded after) is
set against this one figure by figure, as the replay is. A figure the machine does not
repeat within 5 % cannot be validated within 5 %. Within one recording, two loops that
ran the same steps (a policy that drafted nothing beside ``kv-only``) show the same bound
with no second recording: their times are set side by side (``same_steps``).

    python -m simulator.serve_validate --trace traces/smollm2-humaneval-serve
    python -m simulator.serve_validate --trace traces/smollm2-chat-serve --again traces/smollm2-chat-serve-again
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

from profiler.arrivals import arrivals_s
from profiler.schema import StepRow, TraceError, table_to_rows
from profiler.serve_record import Load
from profiler.serve_summary import LoadLatencies, Percentiles, load_latencies, read_served, served_times
from profiler.trace_io import read_table
from rakv.cli import run_cli
from rakv.controller import Policy
from rakv.scheduler import BatchConfig, Composition
from rakv.settings import DecisionInputs
from simulator.batch_replay import BatchReplay, ReplayedStep
from simulator.costs import CostModelError
from simulator.schedule import schedule
from simulator.serve_sim import LoadRun, run_load
from simulator.session import SessionError, trace_policy
from simulator.step_costs import StepCosts, StepErrors, fit_step_costs, load_speeds, step_errors
from simulator.trace import RecordedRequest, Trace, load_trace


def recorded_table(trace: Trace, table: str, steps: dict[tuple[str, str], list[StepRow]] | None = None
                   ) -> dict[tuple[str, str], list]:
    """A serving table's rows (``steps`` in step order, ``served`` in finish order, first
    tokens at their delivery: ``profiler.serve_summary.read_served``, which reads the
    steps unless given, as this returns them) by (load, policy); a one-line TraceError
    where the trace was not recorded under load."""
    try:
        rows = (read_served(trace.path, trace.meta.config,
                            None if steps is None else [row for rows in steps.values() for row in rows])[0]
                if table == "served" else table_to_rows(table, read_table(trace.path, table)))
    except TraceError:
        rows = []
    if not rows:
        raise TraceError(f"{trace.path}: no {table} table: record it under load (profiler.record "
                         f"--serve-concurrency)")
    order = (lambda r: r.step) if table == "steps" else (lambda r: r.finish_s)
    by_load: dict[tuple[str, str], list] = {}
    for row in sorted(rows, key=lambda r: (r.load, r.policy, order(r))):
        by_load.setdefault((row.load, row.policy), []).append(row)
    return by_load


@dataclass(frozen=True)
class StepCheck:
    num_recorded: int
    num_replayed: int
    num_equal: int  # steps whose composition the replay reproduced, counted until the first difference
    first_difference: str | None  # None: every step reproduced


def compare_steps(rows: list[StepRow], replayed: list[ReplayedStep]) -> StepCheck:
    """Recorded steps against replayed ones, rows compared up to each replayed work's
    ``row_cuts``."""
    for i, (row, step) in enumerate(zip(rows, replayed)):
        got, want = step.composition, Composition.of(row)
        if len(want.rows) == len(step.row_cuts):  # the rows the trace determines, on both sides
            cut = [(g, w) if c is None else (min(g, c), min(w, c)) for g, w, c in zip(got.rows, want.rows,
                                                                                    step.row_cuts)]
            got, want = replace(got, rows=tuple(g for g, _ in cut)), replace(want, rows=tuple(w for _, w in cut))
        if got != want:
            return StepCheck(len(rows), len(replayed), i, f"step {i}: replayed {got}, recorded {want}")
    difference = None if len(rows) == len(replayed) else f"{len(replayed)} steps replayed, {len(rows)} recorded"
    return StepCheck(len(rows), len(replayed), min(len(rows), len(replayed)), difference)


@dataclass(frozen=True)
class LoadFidelity:
    load: str
    policy: str
    steps: StepCheck  # in the recorded admission order
    step_errors: StepErrors  # in sample, over the steps reproduced
    recorded: LoadLatencies  # the served requests as measured
    simulated: LoadLatencies  # free-running, overheads in sample
    simulated_out: LoadLatencies  # free-running, overheads fitted on the other loads
    again: LoadLatencies | None = None  # the same load in another recording (``--again``)
    slower: float | None = None  # the machine while the load ran against the loads' median (``load_speeds``)
    # free-running at the load's own pace: the out-of-sample costs scaled by ``pace``, its
    # reproduced steps' recorded seconds over their price (no steps reproduced: None)
    at_pace: LoadLatencies | None = None
    pace: float | None = None


TOLERANCE = 0.05  # the goal: each figure within 5 % of the measured


@dataclass(frozen=True)
class SameSteps:
    """Two loads of one recording, under two policies, that ran the same steps, step for
    step: the machine's seconds for each, so the spread no step model can follow."""

    load: str
    policies: tuple[str, str]
    num_steps: int
    seconds: tuple[float, float]  # measured, summed over the steps

    @property
    def apart(self) -> float:
        """The second's seconds over the first's, less 1."""
        return self.seconds[1] / self.seconds[0] - 1.0


def same_steps(steps: dict[tuple[str, str], list[StepRow]]) -> list[SameSteps]:
    """Every pair of (load, policy) at one load whose recorded steps ran the same
    compositions (a plain work's drafter is only its planner's label, so it is left out)."""
    def composed(row: StepRow) -> Composition:
        composition = Composition.of(row)
        return replace(composition, drafters=tuple(d if k else "" for d, k in zip(composition.drafters,
                                                                                   composition.ks)))
    keys = sorted(steps)
    ran = {key: [composed(row) for row in steps[key]] for key in keys}
    return [SameSteps(a[0], (a[1], b[1]), len(ran[a]), (sum(r.seconds for r in steps[a]),
                                                       sum(r.seconds for r in steps[b])))
            for i, a in enumerate(keys) for b in keys[i + 1:] if a[0] == b[0] and ran[a] == ran[b]]


def figures(latencies: LoadLatencies) -> tuple[float, ...]:
    """The figures a load is validated on: p50 and p90 of TTFT, ITL and e2e, and output tok/s."""
    return (latencies.ttft.p50_s, latencies.ttft.p90_s, latencies.itl.p50_s, latencies.itl.p90_s,
            latencies.e2e.p50_s, latencies.e2e.p90_s, latencies.output_tok_per_s)


def num_within(got: LoadLatencies, want: LoadLatencies, tolerance: float = TOLERANCE) -> int:
    """How many of ``got``'s figures are within ``tolerance`` of ``want``'s (a figure of
    0, an ITL where every request made one token, only by equal)."""
    return sum(abs(g / w - 1.0) <= tolerance if w > 0 else g == w for g, w in zip(figures(got), figures(want)))


def own_pace(costs: StepCosts, rows: Sequence[StepRow], replayed: Sequence[ReplayedStep]) -> float | None:
    """How much longer a load's steps took than ``costs`` price them: the recorded seconds
    of ``rows`` over the price of their compositions (``replayed``, the same steps, give
    the draft catch-up rows); None where there are none."""
    priced_s = sum(costs.seconds(Composition.of(row), step.draft_rows) for row, step in zip(rows, replayed))
    return sum(row.seconds for row in rows) / priced_s if priced_s > 0 else None


def recorded_steps(trace: Trace) -> dict[tuple[str, str], list[StepRow]]:
    """The trace's recorded steps by (load, policy) (``recorded_table``); none where it has none."""
    try:
        return recorded_table(trace, "steps")
    except TraceError:
        return {}


def fit_serving_costs(trace: Trace, steps: dict | None = None, leave_out: str | None = None,
                      replayed: dict | None = None) -> StepCosts:
    """Step costs from the trace's op grid, the overheads fitted on its loads' recorded
    steps (``steps``: ``recorded_steps(trace)``, read here when None), all of
    them or all but load ``leave_out``'s, each with its draft catch-up rows, which a
    recorded step does not hold: its replay's (``replayed``: ``replayed_steps``, replayed
    here when None; of a load that the replay did not reproduce, the steps before the
    first difference). A trace with the serving grid but no steps: the grid alone, no
    overhead."""
    if steps is None:
        steps = recorded_steps(trace)
    keys = [key for key in steps if key[0] != leave_out]
    if replayed is None:
        replayed = replayed_steps(trace, {key: steps[key] for key in keys})
    speeds = load_speeds(steps)  # fitted at the loads' usual speed (``simulator.step_costs``)
    fitted: list[tuple[StepRow, ReplayedStep, float]] = []
    for key in keys:
        num_equal = compare_steps(steps[key], replayed[key]).num_equal
        fitted += [(row, step, speeds.get(key, 1.0)) for row, step in zip(steps[key], replayed[key][:num_equal])]
    return fit_step_costs(trace.ops, [Composition.of(row) for row, _, _ in fitted],
                          [row.seconds / speed for row, _, speed in fitted], [step.draft_rows for _, step, _ in fitted],
                          [row.forward_s / speed for row, _, speed in fitted])


def replayed_steps(trace: Trace, steps: dict[tuple[str, str], list[StepRow]]) -> dict[tuple[str, str], list]:
    """Per recorded (load, policy) of ``steps``, the replay's steps (``ReplayedStep``) in
    the recorded admission order: a closed loop's own, an open loop's arrivals admitted
    at its recorded steps' starts."""
    serving = ServingReplay(trace)
    return {key: serving.replay(*key, None, [row.start_s for row in rows]).steps for key, rows in steps.items()}


class ServingReplay:
    """A serving trace's loads, replayed as it recorded them (its requests, token cap,
    batching limits, settings, learned policy files and arrival seed), or with any of those
    given instead."""

    def __init__(self, trace: Trace, inputs: DecisionInputs | None = None, num_requests: int | None = None,
                 seed: int | None = None, *, strict: bool = False, recorded_policies: bool | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 itl_target_s: float | None = None, ttft_target_s: float | None = None,
                 max_num_prefills: int | None = None):
        """``num_requests``: the trace's requests resampled with their prefix families
        (``simulator.schedule``, from ``seed``) instead of the ones it served (its first
        ``serve_requests``, or the ``serve_resample`` it drew from its seed). The
        batching limits and the ITL and TTFT targets: the recording's where None (a
        target of 0: none; a recording made before ``max_num_prefills`` existed
        prefilled as many requests a step as rows and seats allowed: ``max_num_seqs``).
        ``recorded_policies``: a learned policy the trace served decides with the
        trace's copy of its files (``simulator.session.trace_policy``), not the shipped
        one; None: where the settings are the recording's (``inputs`` None)."""
        config = trace.meta.config
        self.trace = trace
        self.inputs = trace.require_inputs() if inputs is None else inputs
        self.recorded_policies = inputs is None if recorded_policies is None else recorded_policies

        def target(given: float | None, key: str) -> float | None:
            value = config.get(key) if given is None else given  # recorded since it was added; before, none
            return float(value) if value else None
        num_seqs = int(config["max_num_seqs"] if max_num_seqs is None else max_num_seqs)
        if max_num_prefills is None:  # recorded since it was added; before, as many as the seats
            max_num_prefills = int(config.get("max_num_prefills") or num_seqs)
        self.batch = BatchConfig(num_seqs, int(config["max_num_batched_tokens"] if max_num_batched_tokens is None
                                               else max_num_batched_tokens),
                                 itl_target_s=target(itl_target_s, "itl_target"),
                                 ttft_target_s=target(ttft_target_s, "ttft_target"), max_num_prefills=max_num_prefills)
        self.max_new = int(config["max_new_tokens"])
        recorded_seed = int(config.get("seed") or 0)
        self.seed = recorded_seed if seed is None else seed
        self.requests: list[RecordedRequest]
        if num_requests is not None:
            self.requests = [arrival.request for arrival in schedule(trace, num_requests, None, self.seed)]
        elif config.get("serve_resample"):  # the requests the recording drew, from its seed
            self.requests = [arrival.request for arrival in schedule(trace, int(config["serve_resample"]), None,
                                                                     recorded_seed)]
        else:
            self.requests = list(trace.requests[:int(config.get("serve_requests") or len(trace.requests))])
        self.strict = strict

    def fresh(self, policy: str | Policy) -> BatchReplay:
        """An empty replay under ``policy``, or the policy of that name (a fresh one: a
        ``Policy`` given is carried on as it is, so give each replay its own)."""
        if isinstance(policy, str):
            policy = trace_policy(policy, self.trace, self.inputs, self.strict, self.recorded_policies)
        return BatchReplay(policy, self.inputs, self.batch, self.trace.target_namespace, self.trace.draft_namespace)

    def replay(self, load: str, policy_name: str, costs: StepCosts | None,
               step_starts_s: Sequence[float] | None = None) -> LoadRun:
        """The ``load`` labelled ``c=N`` or ``rate=R`` (as ``profiler.serve_record.Load``)."""
        return self.run(Load.of_label(load), policy_name, costs, step_starts_s)

    def run(self, load: Load, policy: str | Policy, costs: StepCosts | None,
            step_starts_s: Sequence[float] | None = None) -> LoadRun:
        """The requests under ``load`` and ``policy`` (``fresh``'s): a closed loop, or an
        open one at the seed's Poisson arrivals (``profiler.arrivals``, as the recorder drew
        them), admitted by the modelled clock or at ``step_starts_s`` (``run_load``'s)."""
        replay = self.fresh(policy)
        if load.concurrency is not None:
            return run_load(replay, self.requests, self.max_new, costs, concurrency=load.concurrency)
        arrivals = arrivals_s(len(self.requests), load.rate_per_s, self.seed)
        return run_load(replay, self.requests, self.max_new, costs, arrivals_s=arrivals, step_starts_s=step_starts_s)


def check_targets(itl_target: float | None, ttft_target: float | None) -> None:
    """``--itl-target`` and ``--ttft-target`` as ``ServingReplay`` takes them: None (the
    recording's), 0 (none) or above; else a one-line ValueError."""
    for option, value in (("--itl-target", itl_target), ("--ttft-target", ttft_target)):
        if value is not None and value < 0:
            raise ValueError(f"{option} must be 0 (none) or above, got {value:g}")


def validate_serving(trace: Trace, again: Trace | None = None,
                     steps: dict[tuple[str, str], list[StepRow]] | None = None) -> list[LoadFidelity]:
    """Every recorded (load, policy) replayed; ``again``: another recording of the same
    loads, each set beside this one's. ``steps``: ``recorded_table(trace, "steps")``, read
    here when None."""
    if steps is None:
        steps = recorded_table(trace, "steps")
    served = recorded_table(trace, "served", steps)
    served_again = {}
    if again is not None:
        served_again = recorded_table(again, "served")
        missing = [f"{load} {policy}" for load, policy in steps if (load, policy) not in served_again]
        if missing:
            raise TraceError(f"{again.path}: no recording of {', '.join(missing)}: --again needs the same loads "
                             f"and policies")
    loads = ServingReplay(trace)
    replayed = replayed_steps(trace, steps)
    everything = fit_serving_costs(trace, steps, replayed=replayed)
    load_names = sorted({load for load, _ in steps})
    leave_out = {load: fit_serving_costs(trace, steps, load, replayed) if len(load_names) > 1 else everything
                 for load in load_names}
    speeds = load_speeds(steps)
    results = []
    for (load, policy), rows in steps.items():
        speed = speeds.get((load, policy), 1.0)  # each load priced at the machine's speed as it ran
        at_speed = replace(everything, speed=speed)
        recorded = load_latencies(served_times(served[load, policy]))
        out_of_sample = replace(leave_out[load], speed=speed)
        run = loads.replay(load, policy, at_speed)
        run_out = loads.replay(load, policy, out_of_sample)
        check = compare_steps(rows, replayed[load, policy])
        reproduced, reproduced_steps = rows[:check.num_equal], replayed[load, policy][:check.num_equal]
        errors = step_errors(at_speed, [Composition.of(row) for row in reproduced], reproduced,
                             [step.draft_rows for step in reproduced_steps])
        pace = own_pace(out_of_sample, reproduced, reproduced_steps)
        at_pace = None if pace is None else load_latencies(
            loads.replay(load, policy, replace(out_of_sample, speed=speed * pace)).times())
        results.append(LoadFidelity(load, policy, check, errors, recorded, load_latencies(run.times()),
                                    load_latencies(run_out.times()),
                                    load_latencies(served_times(served_again[load, policy])) if again else None,
                                    speeds[load, policy] - 1.0 if (load, policy) in speeds else None,
                                    at_pace, pace))
    return results


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _error(got: float, want: float) -> str:
    return f"{100.0 * (got / want - 1.0):+.1f}" if want > 0 else "-"


def _p50_p90_error(got: Percentiles, want: Percentiles) -> str:
    return f"{_error(got.p50_s, want.p50_s)} / {_error(got.p90_s, want.p90_s)}"


def markdown(trace: Trace, rows: list[LoadFidelity], again: Trace | None = None,
             same: Sequence[SameSteps] = ()) -> str:
    lines = [f"{trace.path.name}: the steps of each load replayed through the engine's scheduler in the recorded "
             f"admission order (an open loop's arrivals at its recorded step starts), and priced from the op grid "
             f"(overheads fitted on the loads' steps)",
             "| load | policy | steps reproduced | step MAPE % | forward MAPE % | proposals MAPE % "
             "| load's time error % | the machine, slower % | its steps, slower % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        e = row.step_errors
        lines.append(f"| {row.load} | {row.policy} | {row.steps.num_equal} of {row.steps.num_recorded} | "
                     f"{_pct(e.step_mape)} | {_pct(e.forward_mape)} | {_pct(e.propose_mape)} | "
                     f"{_signed(e.total_error)} | {_signed(None if row.slower is None else 100 * row.slower)} | "
                     f"{_signed(None if row.pace is None else 100 * (row.pace - 1.0))} |")
    lines += ["", "Free-running at the recorded load, against the served requests: error % of p50 / p90 "
                  "(out of sample: the overheads fitted on the other loads; at its pace: out of sample, at the "
                  "load's own pace)",
              "| load | policy | TTFT | ITL | e2e | output tok/s | out of sample: TTFT | ITL | e2e | tok/s "
              "| at its pace: TTFT | ITL | e2e | tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for sim in (row.simulated, row.simulated_out, row.at_pace):
            rec = row.recorded
            cells += ["-"] * 4 if sim is None else [
                _p50_p90_error(sim.ttft, rec.ttft), _p50_p90_error(sim.itl, rec.itl),
                _p50_p90_error(sim.e2e, rec.e2e), _error(sim.output_tok_per_s, rec.output_tok_per_s)]
        lines.append(f"| {row.load} | {row.policy} | " + " | ".join(cells) + " |")
    num_figures = len(rows) * len(figures(rows[0].recorded)) if rows else 0

    def within(field: str) -> int:  # figures of every load within the tolerance: "simulated", ...
        return sum(num_within(getattr(r, field), r.recorded) for r in rows if getattr(r, field) is not None)

    summary = (f"Within {TOLERANCE * 100:.0f} % of the served requests' figures: the replay {within('simulated')} of "
               f"{num_figures} in sample, {within('simulated_out')} out of sample; out of sample at each load's own "
               f"pace (its steps' seconds over their price, \"its steps, slower\": the machine as it ran, not a "
               f"prediction) {within('at_pace')}")
    if again is not None:
        lines += ["", f"{again.path.name}, the same loads recorded again, against this recording: error % of "
                      f"p50 / p90", "| load | policy | TTFT | ITL | e2e | output tok/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.load} | {r.policy} | {_p50_p90_error(r.again.ttft, r.recorded.ttft)} | "
                  f"{_p50_p90_error(r.again.itl, r.recorded.itl)} | {_p50_p90_error(r.again.e2e, r.recorded.e2e)} | "
                  f"{_error(r.again.output_tok_per_s, r.recorded.output_tok_per_s)} |" for r in rows]
        summary += f"; the recording made again {within('again')}"
    lines += ["", summary + "."]
    if same:
        lines += ["", "Loads that ran the same steps under two policies, step for step: how far apart the machine "
                      "ran them (no step model can follow that)",
                  "| load | policies | steps | seconds | apart % |", "|---|---|---|---|---|"]
        lines += [f"| {s.load} | {s.policies[0]}, {s.policies[1]} | {s.num_steps} | {s.seconds[0]:.2f}, "
                  f"{s.seconds[1]:.2f} | {100 * s.apart:+.1f} |" for s in same]
    for row in rows:
        if row.steps.first_difference is not None:
            lines.append(f"{row.load} {row.policy}: {row.steps.first_difference}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    again = load_trace(args.again) if args.again is not None else None
    steps = recorded_table(trace, "steps")
    rows = validate_serving(trace, again, steps)
    print(json.dumps([asdict(r) for r in rows]) if args.json else markdown(trace, rows, again, same_steps(steps)))
    return 1 if any(r.steps.first_difference is not None for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.serve_validate",
        description="Replay a serving trace's loads through the engine's own scheduler: every "
                    "step's composition against the recorded one (exit status 1 where one differs), each "
                    "step's modelled time against its measured seconds, and each load free-running against "
                    "its served requests' latencies and throughput.")
    parser.add_argument("--trace", type=Path, required=True,
                        help="a serving trace directory (recorded with profiler.record --serve-concurrency)")
    parser.add_argument("--again", type=Path, default=None,
                        help="another recording of the same loads (the same profiler.record arguments, recorded "
                             "after): each figure set beside this one's, the floor the replay's errors stand on")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    return run_cli(run, parser.parse_args(argv), (ValueError, TraceError, SessionError, CostModelError, OSError))


if __name__ == "__main__":
    sys.exit(main())
