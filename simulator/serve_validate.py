"""``python -m simulator.serve_validate``: the batched replay against a serving trace.

For every closed-loop load (``c=N``) and policy the trace recorded:
- the steps: the engine's own scheduler over the trace's facts
  (``simulator.batch_replay``) must reproduce every recorded step's composition, which
  requests ran, their kinds, rows, contexts, drafters and k;
- their times: each recorded step priced by ``simulator.step_costs`` (the op grid's
  forwards, the overheads fitted on recorded steps), against its measured seconds: the mean
  absolute percentage error per step, of its target forward and of its proposals, and the
  error of the load's whole time. In sample, the overheads are fitted on every closed-loop
  load's steps; out of sample, on the other loads' only (leave one load out): a load the
  fit never saw.

An open-loop load (``rate=R``) met its arrivals in wall time, so its steps are not a
function of the facts; it is left out. Imports no torch.

    python -m simulator.serve_validate --trace traces/smollm2-humaneval-serve
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from profiler.schema import TraceError
from rakv.cli import run_cli
from rakv.scheduler import Composition
from simulator.batch_replay import check_trace, recorded_steps
from simulator.costs import CostModelError
from simulator.session import SessionError
from simulator.step_costs import StepErrors, fit_step_costs, step_errors
from simulator.trace import Trace, load_trace


@dataclass(frozen=True)
class LoadFidelity:
    load: str
    policy: str
    num_steps: int
    num_equal: int  # steps whose composition the replay reproduced (until the first difference)
    first_difference: str | None
    in_sample: StepErrors
    out_of_sample: StepErrors  # overheads fitted on the trace's other loads


def validate_serving(trace: Trace) -> list[LoadFidelity]:
    checks = {(c.load, c.policy): c for c in check_trace(trace)}
    steps = {key: rows for key, rows in recorded_steps(trace).items() if key in checks}
    compositions = {key: [Composition.of(row) for row in rows] for key, rows in steps.items()}

    def fitted(keys):
        return fit_step_costs(trace.ops, [c for key in keys for c in compositions[key]],
                              [row.seconds for key in keys for row in steps[key]])

    everything = fitted(list(steps))
    loads = sorted({load for load, _ in steps})
    others = {load: fitted([key for key in steps if key[0] != load]) for load in loads}
    return [LoadFidelity(load, policy, len(rows), checks[load, policy].num_equal,
                         checks[load, policy].first_difference,
                         step_errors(everything, compositions[load, policy], rows),
                         step_errors(others[load] if len(loads) > 1 else everything, compositions[load, policy], rows))
            for (load, policy), rows in steps.items()]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(trace: Trace, rows: list[LoadFidelity]) -> str:
    lines = [f"{trace.path.name}: closed-loop loads replayed through the engine's scheduler; step times priced "
             f"from the op grid, overheads fitted in sample (every load) and out of sample (the other loads)",
             "| load | policy | steps reproduced | step MAPE % | forward MAPE % | proposals MAPE % "
             "| total time error % | out of sample: step MAPE % | total time error % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        i, o = row.in_sample, row.out_of_sample
        lines.append(f"| {row.load} | {row.policy} | {row.num_equal} of {row.num_steps} | {_pct(i.step_mape)} | "
                     f"{_pct(i.forward_mape)} | {_pct(i.propose_mape)} | {i.total_error:+.1f} | "
                     f"{_pct(o.step_mape)} | {o.total_error:+.1f} |")
    for row in rows:
        if row.first_difference is not None:
            lines.append(f"{row.load} {row.policy}: {row.first_difference}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    rows = validate_serving(trace)
    print(json.dumps([asdict(r) for r in rows]) if args.json else markdown(trace, rows))
    return 1 if any(r.first_difference is not None for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.serve_validate",
        description="Replay a serving trace's closed-loop loads through the engine's own scheduler: every "
                    "step's composition against the recorded one (exit status 1 where one differs), and each "
                    "step's modelled time against its measured seconds.")
    parser.add_argument("--trace", type=Path, required=True,
                        help="a serving trace directory (recorded with profiler.record --serve-concurrency)")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    return run_cli(run, parser.parse_args(argv), (ValueError, TraceError, SessionError, CostModelError, OSError))


if __name__ == "__main__":
    sys.exit(main())
