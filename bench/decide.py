"""The controller's decision overhead: ``CostModelPolicy.decide`` per call on seeded
random requests, and the engine's ``decide_s`` (prefix lookup plus decision) per request
(section 5 of ``python -m bench.engine``, which passes the ``rakv`` run's ``decide_s``).

    python -m bench.decide --pair tiny

On its own it times ``decide`` only (the pair gives the calibrated timings it prices with).
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass

from bench.harness import Checks, bench_main, bench_parser, check_at_least_one, configure_torch, report


@dataclass(frozen=True)
class DecideSection:
    calls: int
    decide_us_per_call: float
    engine_decide_us_median: float
    engine_decide_requests: int


def bench_decide(timings, num_calls: int, engine_decide_s: list[float]) -> DecideSection:
    from rakv.controller import CostModelPolicy
    from rakv.cost_model import RequestFeatures
    rng = random.Random(0)
    features = []
    for _ in range(num_calls):
        n = rng.randint(1, 4000)
        hit = rng.choice((0, rng.randint(0, n), n))
        features.append(RequestFeatures(
            num_prompt_tokens=n, num_new_tokens=rng.randint(1, 512), target_hit_tokens=hit,
            draft_hit_tokens=rng.choice((0, hit)), exact_repeat=hit == n and rng.random() < 0.5,
            acceptance=rng.random()))
    policy = CostModelPolicy(timings)
    for f in features[:100]:  # warm-up
        policy.decide(f)
    start = time.perf_counter()
    for f in features:
        policy.decide(f)
    per_call_us = (time.perf_counter() - start) / num_calls * 1e6
    median_us = statistics.median(engine_decide_s) * 1e6 if engine_decide_s else float("nan")
    return DecideSection(num_calls, per_call_us, median_us, len(engine_decide_s))


def format_decide(dcs: DecideSection) -> list[str]:
    lines = ["5. Controller decision overhead",
             f"   CostModelPolicy.decide: {dcs.decide_us_per_call:.1f} us per call over {dcs.calls} calls (goal <= 100 us)"]
    if dcs.engine_decide_requests:  # none when run on its own
        lines.append(f"   engine decide_s (lookup + decide), median over {dcs.engine_decide_requests} rakv requests: "
                     f"{dcs.engine_decide_us_median:.1f} us")
    return lines


def run(args) -> int:
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    configure_torch(args.threads)
    print(f"loading {args.pair}", file=sys.stderr)
    timings = load_or_calibrate(load_pair(args.pair, linear_kernels=args.linear_kernels, weights_mode=args.weights))
    return report(format_decide(bench_decide(timings, args.decide_calls, [])), Checks())


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.decide", "Time CostModelPolicy.decide per call on seeded random requests.",
                     quick=False)
    p.add_argument("--decide-calls", type=int, default=10_000, help="policy.decide calls timed (default: 10000)")
    args = p.parse_args(argv)
    check_at_least_one(p, args, "decide_calls", "threads")
    return bench_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
