"""``rakv`` replayed under the settings a trace recorded and under today's decision defaults.

    python -m bench.replay_defaults                  # the Qwen traces, packed-kernel timing
    python -m bench.replay_defaults --trace traces/smollm2-chat --timing traces/smollm2-chat

A trace replays the decisions it recorded, with the controller settings of its decision
inputs (settings it predates take their ``ABSENT_MEANS``). This replays the same
requests again with today's defaults for the settings that need nothing the trace may
lack (``ready_draft_over_plain``, ``min_gain``; confidence stops, for one, need the
draft's probabilities, which older traces do not hold), beside ``ar``, ``spec-k4`` and
the oracle: what a change of defaults does to a recorded workload, in seconds.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import replace
from pathlib import Path

QWEN_TRACES = ("traces/qwen-coder-humaneval", "traces/qwen-coder-sharegpt")


def compare(trace_path: Path, timing_path: Path) -> str:
    from rakv.controller import ControllerConfig
    from simulator.replay import make_session, schedule, simulate, summarize
    from simulator.timing import load_timing
    from simulator.trace import load_trace
    trace = load_trace(trace_path)
    timing = load_timing(timing_path, trace)
    recorded = timing.decision_inputs(trace)
    defaults, kept = ControllerConfig(), recorded.controller
    today = replace(recorded, controller=replace(kept, ready_draft_over_plain=defaults.ready_draft_over_plain,
                                                 rounds=replace(kept.rounds, min_gain=defaults.rounds.min_gain)))
    arrivals = schedule(trace, None, None, 0)
    cells = []
    for label, name, inputs in (("ar", "ar", recorded), ("spec-k4", "spec-k4", recorded),
                                ("oracle", "oracle", recorded), ("rakv recorded", "rakv", recorded),
                                ("rakv today", "rakv", today)):
        summary = summarize(name, simulate(arrivals, make_session(name, trace, inputs, timing), timing), None)
        cells.append(f"{label} {summary.tokens_per_s:.2f}")
    return f"{trace_path.name} (timing {timing_path.name}), tok/s: " + ", ".join(cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay_defaults", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, action="append", help="acceptance trace (repeatable; default: the Qwen ones)")
    p.add_argument("--timing", type=Path, default=Path("traces/qwen-coder-ops-onednn"),
                   help="timing trace (default: traces/qwen-coder-ops-onednn)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # the clipping warning of traces that hold 8-token run lengths
    try:
        for trace in args.trace or [Path(t) for t in QWEN_TRACES]:
            print(compare(trace, args.timing), flush=True)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
