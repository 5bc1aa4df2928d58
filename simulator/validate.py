"""``python -m simulator.validate``: the simulator against the runs a trace measured.

Per policy: whether every replayed run's rounds (drafter, k, proposed, accepted), action,
hit and output length equal the recorded ones (they must); the mean absolute percentage
error of the simulated end-to-end time and time to first token against the measured
ones (as measured, and as at the recording's usual speed: each time's streaming part
scaled by its probe's, ``simulator.costs.at_usual_speed``, where the trace holds probes); and, per
request, the Spearman correlation between the policies' simulated and
measured times (does the simulator rank the actions as the machine did?).

Runs replay under the settings the trace was recorded with (the runs ran under them).
No run's own time enters the model that predicts it: the op costs come from the ops
table, and the overhead beyond them (``simulator.costs.fit_overhead``) is fitted, for
each request, on the runs of every other request (leave one request out), or with
``--fit-on``, on other traces' runs only: a workload the fit has never seen.
Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from profiler.schema import TraceError
from rakv.drafters import DRAFT_MODEL, RunLengths
from rakv.cli import run_cli
from simulator.costs import CostModelError, fit_op_costs, fit_overhead, with_overhead
from simulator.session import SessionError, replay_runs, replayed_lengths, run_mismatch
from simulator.timing import overhead_samples
from simulator.trace import load_trace

SPLIT = "leave one request out"
SETTINGS = "as recorded"


@dataclass(frozen=True)
class PolicyFidelity:
    num_runs: int
    num_not_greedy: int  # runs whose output differed from the greedy output (none may)
    e2e_mape: float  # fraction: 0.05 is 5 %, against the times as measured
    ttft_mape: float
    e2e_mape_usual_speed: float  # against the times as at the usual speed (= e2e_mape where unprobed)
    ttft_mape_usual_speed: float
    round_mismatches: int  # runs whose replay differs from the recording in any way (run_mismatch)
    num_rounds: int
    rounds_off_min_k_mt: int  # recorded rounds whose (proposed, accepted) are not min(k, proposal_t), min(k, m_t)


@dataclass(frozen=True)
class Fidelity:
    trace: str
    split: str  # what the overhead was fitted on
    settings: str  # what the runs replayed under
    policies: dict[str, PolicyFidelity]
    spearman: float  # mean over requests run under at least 3 policies
    num_requests: int
    first_mismatch: str | None
    steadiness: Steadiness  # as measured
    probed: bool  # whether the runs and ops hold the machine's speed (probe_s)
    steadiness_usual_speed: Steadiness  # the same at the usual speed


@dataclass(frozen=True)
class Steadiness:
    """How steady the machine was while the runs were recorded: each run's measured time
    over its op costs (no overhead). The runs of one request are recorded within a minute
    or so, the requests one after another; a machine whose speed drifts moves the ratio
    between requests, and noise spreads it within one. No cost model predicts either."""
    request_median_low: float  # the lowest and highest per-request median ratio
    request_median_high: float
    within_request_spread: float  # median over requests of the ratio's 75th over its 25th percentile


def steadiness(ratios_by_request: dict[int, list[float]]) -> Steadiness:
    medians = [float(np.median(r)) for r in ratios_by_request.values()]
    spreads = [float(np.percentile(r, 75) / np.percentile(r, 25)) for r in ratios_by_request.values()]
    return Steadiness(min(medians), max(medians), float(np.median(spreads)))


def average_ranks(x) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):
        tied = x == value
        r[tied] = r[tied].mean()
    return r


def spearman(a, b) -> float:
    """Rank correlation (average ranks for ties)."""
    ra, rb = average_ranks(a), average_ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def rounds_off_min_k_mt(run, lengths: Mapping[str, RunLengths]) -> int:
    """How many of a run's recorded rounds did not accept min(proposed, m_t) of their
    drafter, or proposed other than min(k, proposal length at t) (section 2 of the
    design: none may). Only the draft model may propose fewer: it stops on low
    confidence (whether it should have is ``run_mismatch``'s check). ``lengths``: the
    request's run lengths per drafter (the store drafter's, as its replay looked them up)."""
    off = 0
    for start, drafter, k, proposed, accepted in zip(run.start_per_round, run.drafter_per_round, run.k_per_round,
                                                     run.proposed_per_round, run.accepted_per_round):
        at = lengths[drafter]
        full = min(k, at.proposed[start])
        off += (accepted != min(proposed, at.runs[start]) or proposed > full
                or (proposed < full and drafter != DRAFT_MODEL))
    return off


def validate(path: str | Path, fit_on: tuple[str | Path, ...] = ()) -> Fidelity:
    """``fit_on``: traces (of this machine) whose runs alone fit the overhead; none: this
    trace's other requests."""
    trace = load_trace(path)
    if not trace.runs:
        raise TraceError(f"{path}: the trace has no measured runs to validate against")
    trace.require_inputs()  # its runs replay under its recorded settings
    costs = fit_op_costs(trace.ops)
    elsewhere = [sample for other in fit_on for sample in _samples_of(other)]
    mismatches: dict[str, list[str]] = {}
    lengths: dict[tuple[str, int], Mapping[str, RunLengths]] = {}  # (policy, request): its run lengths
    for policy in sorted({r.policy for r in trace.runs}):
        mismatches[policy] = []
        for run, replayed in replay_runs(trace, policy):
            if m := run_mismatch(run, replayed):
                mismatches[policy].append(m)
            lengths[policy, run.request_id] = replayed_lengths(trace.by_id[run.request_id], replayed)
    runs = list(trace.runs)
    samples = {(run.policy, run.request_id): sample for run, sample in overhead_samples(trace, costs)}
    predicted: dict[tuple[str, int], tuple[float, float]] = {}
    fitted_elsewhere = fit_overhead(elsewhere) if fit_on else None  # one fit serves every request
    for request_id in sorted({r.request_id for r in runs}):
        overhead = fitted_elsewhere if fit_on else fit_overhead(
            [s for (p, rid), s in samples.items() if rid != request_id])
        for (policy, rid), s in samples.items():
            if rid == request_id:
                cost = with_overhead(s.cost, overhead, s.num_rounds, s.adaptive)
                predicted[policy, rid] = (cost.e2e_s, cost.ttft_s)
    policies = {}

    def mape(pairs) -> float:  # (predicted, measured) seconds
        return float(np.mean([abs(p - m) / m for p, m in pairs]))
    for policy in mismatches:
        mine = [r for r in runs if r.policy == policy]
        usual = [samples[policy, r.request_id] for r in mine]
        policies[policy] = PolicyFidelity(len(mine), sum(not r.identical_to_ar for r in mine),
                                          mape((predicted[policy, r.request_id][0], r.e2e_s) for r in mine),
                                          mape((predicted[policy, r.request_id][1], r.ttft_s) for r in mine),
                                          mape((predicted[policy, r.request_id][0], u.measured_e2e_s)
                                               for r, u in zip(mine, usual)),
                                          mape((predicted[policy, r.request_id][1], u.measured_ttft_s)
                                               for r, u in zip(mine, usual)),
                                          len(mismatches[policy]),
                                          sum(r.num_rounds for r in mine),
                                          sum(rounds_off_min_k_mt(r, lengths[policy, r.request_id]) for r in mine))
    correlations = []
    for request_id in sorted({r.request_id for r in runs}):
        mine = [r for r in runs if r.request_id == request_id]
        if len(mine) >= 3:
            rho = spearman([predicted[r.policy, request_id][0] for r in mine],
                           [samples[r.policy, request_id].measured_e2e_s for r in mine])
            if not np.isnan(rho):
                correlations.append(rho)
    first = next((m[0] for m in mismatches.values() if m), None)
    split = f"on {', '.join(Path(p).name for p in fit_on)} only" if fit_on else SPLIT
    ratios: dict[int, list[float]] = {}
    usual_ratios: dict[int, list[float]] = {}
    for run in runs:
        sample = samples[run.policy, run.request_id]
        ratios.setdefault(run.request_id, []).append(run.e2e_s / sample.cost.e2e_s)
        usual_ratios.setdefault(run.request_id, []).append(sample.measured_e2e_s / sample.cost.e2e_s)
    probed = costs.usual_probe_s is not None and any(r.probe_s is not None for r in runs)
    return Fidelity(Path(path).name, split, SETTINGS, policies,
                    float(np.mean(correlations)) if correlations else float("nan"),
                    len({r.request_id for r in runs}), first, steadiness(ratios), probed, steadiness(usual_ratios))


def _samples_of(path: str | Path) -> list:
    other = load_trace(path)
    if not other.runs:
        raise TraceError(f"{path}: the trace has no measured runs to fit on")
    return [sample for _, sample in overhead_samples(other, fit_op_costs(other.ops))]


def markdown(fidelity: Fidelity) -> str:
    usual = fidelity.probed  # columns at the usual speed only where the trace holds probes
    lines = [f"{fidelity.trace}: {fidelity.num_requests} requests, settings {fidelity.settings}, overhead fitted "
             f"{fidelity.split}; action-ranking Spearman {fidelity.spearman:.3f}"
             + ("; times also as at the recording's usual speed (their streaming part scaled by their probes)"
                if usual else ""), "",
             "| policy | runs | runs not greedy | e2e MAPE | TTFT MAPE | "
             + ("e2e MAPE, usual speed | TTFT MAPE, usual speed | " if usual else "")
             + "replay mismatches | rounds | rounds off min(k, m_t) |",
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if usual else "")]
    for name, p in fidelity.policies.items():
        lines.append(f"| {name} | {p.num_runs} | {p.num_not_greedy} | {100 * p.e2e_mape:.1f}% | "
                     f"{100 * p.ttft_mape:.1f}% | "
                     + (f"{100 * p.e2e_mape_usual_speed:.1f}% | {100 * p.ttft_mape_usual_speed:.1f}% | "
                        if usual else "")
                     + f"{p.round_mismatches} | {p.num_rounds} | {p.rounds_off_min_k_mt} |")
    lines.append("")
    for label, steady in [("", fidelity.steadiness)] + ([(" at the usual speed", fidelity.steadiness_usual_speed)]
                                                        if usual else []):
        lines.append(f"machine steadiness{label} (measured time over op costs): per-request median "
                     f"{steady.request_median_low:.2f}-{steady.request_median_high:.2f}, within a request "
                     f"{steady.within_request_spread:.2f}x (75th/25th percentile); a drifting or noisy machine "
                     f"widens both, and no cost model follows it")
    if fidelity.first_mismatch:
        lines += ["", f"first mismatch: {fidelity.first_mismatch}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    fidelity = validate(args.trace, tuple(args.fit_on))
    print(json.dumps(asdict(fidelity)) if args.json else markdown(fidelity))
    return 1 if any(p.round_mismatches or p.rounds_off_min_k_mt or p.num_not_greedy
                    for p in fidelity.policies.values()) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m simulator.validate",
        description="Compare simulated with measured runs of a trace, per policy. Exit status 1 if any run differs "
                    "from greedy or any replayed round from the recorded one.")
    p.add_argument("--trace", type=Path, required=True, help="trace directory with a runs table")
    p.add_argument("--fit-on", nargs="+", type=Path, default=(), metavar="TRACE",
                   help="fit the overhead on these traces' runs only (recorded on the same machine), not on the "
                        "trace's own: an out-of-sample check")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return run_cli(run, p.parse_args(argv), (ValueError, TraceError, CostModelError, SessionError, OSError))


if __name__ == "__main__":
    sys.exit(main())
