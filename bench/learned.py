"""The learned policy against the analytic ``rakv`` controller: the cost of one round
decision, and live speed on the CPU.

    python -m bench.learned --policy policies/smollm2                # smollm2, chat workload (20 requests)
    python -m bench.learned --policy policies/smollm2 --decide-only  # the decision time alone

- Decision: one round decision of the learned planner (its features and both heads of
  every ready drafter, then the best (drafter, k)), and the bookkeeping after a round,
  timed at every iteration of the trace's requests replayed with both drafters ready;
  goal at most 30 us (a SmolLM2 step is about 50 ms).
- Live: both policies run the workload through their own engines in lockstep (each
  request under both before the next), 1 torch thread; tokens per second of each, and
  whether every output is identical (both are greedy). Goal: learned at least as fast.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from rakv.cli import add_precision_arguments

GOAL_DECIDE_US = 30.0


def decide_us(policy_path: Path, trace_path: Path) -> tuple[float, float]:
    """(median microseconds of one round decision, of the bookkeeping after an iteration),
    over the trace's requests replayed five times with every drafter of the pair ready."""
    from rakv.acceptance import replay_request
    from rakv.cost_model import Action, RequestFeatures
    from rakv.drafters import DRAFT_MODEL
    from rakv.learned import LearnedPolicy, load_policy
    from rakv.settings import Settings
    from simulator.timing import load_timing
    from simulator.trace import load_trace
    trace = load_trace(trace_path)
    inputs = load_timing(None, trace).decision_inputs(trace, Settings())
    policy = LearnedPolicy(load_policy(policy_path), inputs.timings)
    action = Action(0, 1, DRAFT_MODEL) if inputs.draft_sizes is not None else Action(0, 0)
    plans, observes = [], []

    def timed(method, into):
        def call(*args):
            start = time.perf_counter()
            result = method(*args)
            into.append(time.perf_counter() - start)
            return result
        return call

    for request in trace.requests * 5:
        n = len(request.prompt_ids)
        features = RequestFeatures(n, request.max_new_tokens, 0, 0, False, prompt_ids=request.token_ids[:n])
        planner = policy.planner(features, action)
        planner.plan, planner.observe = timed(planner.plan, plans), timed(planner.observe, observes)
        replay_request(planner, request.lengths, min(len(request.output_ids), request.max_new_tokens),
                       request.max_new_tokens)
    return statistics.median(plans) * 1e6, statistics.median(observes) * 1e6


def live(policy_path: Path, pair_name: str, workload: str, num_requests: int, max_new_tokens: int,
         linear_kernels: str = "auto", weights_mode: str = "fp32") -> dict:
    import torch
    torch.set_num_threads(1)
    from profiler.record import prompt_ids
    from profiler.workloads import load_workload
    from rakv.calibrate import load_or_calibrate
    from rakv.controller import ControllerConfig
    from rakv.engine import Engine
    from rakv.models import load_pair
    from rakv.policies import LEARNED, resolve_policy
    pair = load_pair(pair_name, linear_kernels=linear_kernels, weights_mode=weights_mode)
    timings = load_or_calibrate(pair)
    names = {"rakv": "rakv", "learned": f"{LEARNED}={policy_path}"}  # row name -> policy name
    engines = {row: Engine(pair, resolve_policy(name, timings, ControllerConfig(), pair.target_fingerprint,
                                                pair.draft_fingerprint, pair_name, strict=True))
               for row, name in names.items()}
    tokens = {name: 0 for name in engines}
    seconds = {name: 0.0 for name in engines}
    done: dict[int, SimpleNamespace] = {}  # by request id: prompt_ids and output_ids, as a recording keeps them
    mismatches = 0
    requests = load_workload(workload, num_requests).requests
    for request in requests:
        prompt = prompt_ids(pair, request, max_new_tokens, done)  # a revision turn continues an earlier answer
        for name, engine in engines.items():
            result = engine.generate(prompt, max_new_tokens)
            tokens[name] += len(result.output_ids)
            seconds[name] += result.e2e_s
            if request.request_id in done:
                mismatches += list(result.output_ids) != done[request.request_id].output_ids
            done.setdefault(request.request_id, SimpleNamespace(prompt_ids=prompt, output_ids=list(result.output_ids)))
        print(f"  request {request.request_id}: " + ", ".join(f"{n} {tokens[n] / seconds[n]:.2f} tok/s" for n in engines),
              file=sys.stderr)
    return {"tokens_per_s": {n: tokens[n] / seconds[n] for n in engines}, "mismatches": mismatches,
            "num_requests": len(requests)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learned", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", type=Path, required=True)
    p.add_argument("--trace", type=Path, default=Path("traces/smollm2-chat"), help="requests to time decisions on")
    p.add_argument("--pair", default="smollm2")
    add_precision_arguments(p)
    p.add_argument("--workload", default="chat")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--decide-only", action="store_true")
    args = p.parse_args(argv)
    plan_us, observe_us = decide_us(args.policy, args.trace)
    print(f"one round decision: {plan_us:.1f} us (median; goal {GOAL_DECIDE_US:.0f}); the bookkeeping after a "
          f"round or shadow check: {observe_us:.1f} us")
    if not args.decide_only:
        result = live(args.policy, args.pair, args.workload, args.requests, args.max_new_tokens, args.linear_kernels,
                      args.weights)
        speeds = result["tokens_per_s"]
        print(f"live, {result['num_requests']} requests of {args.workload}, {args.max_new_tokens} new tokens: "
              + ", ".join(f"{n} {v:.2f} tok/s" for n, v in speeds.items())
              + f"; learned / rakv = {speeds['learned'] / speeds['rakv']:.3f}; output mismatches {result['mismatches']}")
        return 1 if result["mismatches"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
