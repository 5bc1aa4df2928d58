"""Continuous batching against the batch-1 engine, in process: output tok/s at each
concurrency, and whether every output equals the batch-1 one.

    python -m bench.batch                                   # smollm2, auto weights, ar and rakv, code prompts
    python -m bench.batch --pair qwen-coder --concurrency 1,2,4,8 --policy ar,rakv
    python -m bench.batch --workload prose --num-prompts 16 --max-new-tokens 64

One torch thread. For each policy: the prompts run one after another through
``Engine.generate`` (batch 1), then through ``BatchEngine`` with all of them submitted at
once and ``max_num_seqs`` = C for each concurrency C. A configuration's tok/s is its
output tokens over its wall time, prefills included; each engine starts with an empty
store, so no run reuses another's prompts. The configurations of a policy run back to
back on the same loaded pair (not interleaved per prompt: a batch needs its whole
queue), so a busy machine moves them unevenly: say the load beside every figure.
"""
from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv):
    from rakv.cli import add_precision_arguments
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", help="pair to load (default: smollm2)")
    add_precision_arguments(p)
    p.add_argument("--policy", default="ar,rakv", help="comma-separated policies (default: ar,rakv)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated max_num_seqs values (default: 1,2,4,8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="rows per step (default: 256)")
    p.add_argument("--workload", default="humaneval", help="profiler workload of the prompts (default: humaneval)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default: 32)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="change one setting of the policies, e.g. planner.load_aware=false; repeatable")
    return p.parse_args(argv)


def run(args) -> int:
    import torch
    torch.set_num_threads(1)
    from rakv.batch_engine import BatchEngine
    from rakv.calibrate import load_or_calibrate
    from rakv.controller import make_policy
    from rakv.engine import Engine
    from rakv.models import load_pair
    from rakv.scheduler import BatchConfig
    from rakv.settings import Settings, override
    settings = Settings()
    for assignment in args.assignments:
        settings = override(settings, assignment)
    from profiler.workloads import load_workload
    pair = load_pair(args.pair, weights_mode=args.weights, linear_kernels=args.linear_kernels)
    from rakv import kernels
    print(f"pair {pair.name}, weights {pair.weights}, kernel path {kernels.path_here()}, torch threads 1",
          file=sys.stderr)
    workload = load_workload(args.workload, args.num_prompts, max_new_tokens=args.max_new_tokens)
    prompts = [pair.encode(item.prompt) for item in workload.requests]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    timings = None
    print(f"| policy | engine | tok/s | x batch 1 | outputs equal | preemptions |")
    for name in args.policy.split(","):
        if name == "rakv" and timings is None:
            timings = load_or_calibrate(pair)
        start = time.perf_counter()
        engine = Engine(pair, make_policy(name, timings, settings.controller))
        want = [engine.generate(p, args.max_new_tokens).output_ids for p in prompts]
        base = sum(map(len, want)) / (time.perf_counter() - start)
        print(f"| {name} | batch 1 | {base:.2f} | 1.00 | - | - |", flush=True)
        for c in concurrencies:
            engine = BatchEngine(pair, make_policy(name, timings, settings.controller),
                                 batch=BatchConfig(max_num_seqs=c, max_num_batched_tokens=args.max_num_batched_tokens))
            start = time.perf_counter()
            got = [r.output_ids for r in engine.run([(p, args.max_new_tokens) for p in prompts])]
            rate = sum(map(len, got)) / (time.perf_counter() - start)
            equal = sum(a == b for a, b in zip(got, want))
            print(f"| {name} | batched, C = {c} | {rate:.2f} | {rate / base:.2f} | {equal} of {len(want)} | "
                  f"{engine.stats().num_preemptions} |", flush=True)
    return 0


def main(argv=None) -> int:
    from rakv.cli import run_cli
    from rakv.engine import RequestError
    from rakv.models import PairError
    return run_cli(run, parse_args(argv), (ValueError, PairError, RequestError, OSError))


if __name__ == "__main__":
    sys.exit(main())
