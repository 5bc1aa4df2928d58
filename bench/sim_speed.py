"""How fast the simulator replays: requests simulated per second, per policy, for a
workload resampled to 10,000 requests, the time to load the trace and fit the cost model,
and the peak memory of the process.

    python -m bench.sim_speed                       # traces/smollm2-sharegpt, 10,000 requests
    python -m bench.sim_speed --trace traces/smollm2-chat --requests 2000 --json

Goals (issue: the simulator): at least 10,000 requests/s for every policy, ``rakv``
included (the oracle, which replays all 26 of its actions for every request, and the
learned policy, when one is shipped for the trace's pair, are reported beside them); fit
in at most 30 s; at most 300 MB. Each policy is timed over the same resampled arrivals,
one after another, in this process, ``--repeat`` times from a fresh session and an empty
cost memo; the best time is reported, as ``timeit`` does, since on a shared machine
the slower repetitions measure the other work.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

GOAL_REQUESTS_PER_S = 10_000
GOAL_FIT_S = 30.0
GOAL_PEAK_RSS_MB = 300.0
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "smollm2-sharegpt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--oracle-requests", type=int, default=1_000, help="the oracle is timed on this many (default: 1000)")
    p.add_argument("--repeat", type=int, default=3, help="time each policy this many times, report the best "
                   "(default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    start = time.perf_counter()
    from simulator.replay import ORACLES, make_session, policy_names, simulate
    from simulator.schedule import schedule
    from simulator.timing import load_timing
    from simulator.trace import load_trace
    trace = load_trace(args.trace)
    timing = load_timing(args.trace, trace)
    fit_s = time.perf_counter() - start
    from rakv.settings import Settings
    inputs = timing.decision_inputs(trace, Settings())  # today's settings, as a replay runs by default

    names = policy_names("all", trace, inputs)  # the fixed policies, rakv, learned if shipped, the oracle
    rates = {}
    for name in names:
        arrivals = schedule(trace, args.oracle_requests if name in ORACLES else args.requests, None, seed=0)
        best_s = float("inf")
        for _ in range(max(args.repeat, 1)):
            session = make_session(name, trace, inputs, timing)
            timing.costs.decode_memo.clear()  # each repetition fills it as one replay would
            begin = time.perf_counter()
            simulate(arrivals, session, timing)
            best_s = min(best_s, time.perf_counter() - begin)
        rates[name] = len(arrivals) / best_s
        print(f"{name:16} {rates[name]:9.0f} requests/s", file=sys.stderr)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"trace": args.trace.name, "requests": args.requests, "repeat": args.repeat, "requests_per_s": rates,
              "fit_s": fit_s, "peak_rss_mb": peak_rss_mb}
    if args.json:
        print(json.dumps(result))
    else:
        slowest = min((r, n) for n, r in rates.items() if n not in ("learned", *ORACLES))
        print(f"{args.trace.name}, {args.requests} resampled requests: slowest policy {slowest[1]} at "
              f"{slowest[0]:.0f} requests/s (goal {GOAL_REQUESTS_PER_S}); oracle {rates['oracle']:.0f} requests/s; "
              f"fit {fit_s:.2f} s (goal {GOAL_FIT_S:.0f}); peak RSS {peak_rss_mb:.0f} MB (goal {GOAL_PEAK_RSS_MB:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
