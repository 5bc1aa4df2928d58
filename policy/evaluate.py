"""``python -m policy.evaluate``: a learned policy on its held-out test requests, next to
the analytic ``rakv`` controller, the best fixed policy and the oracle.

    python -m policy.evaluate --policy policies/smollm2 --trace traces/smollm2-chat [--json]

The trace's requests are labelled as in training (``policy.dataset``, with the policy's
controller settings and resampling) and those of the families the policy's sidecar names
as its test split are scored: Spearman between predicted and true cost rankings, mean and 95th
percentile regret, k-accuracy, choice accuracy and the MAPE of predicted costs
(``policy.model.metrics``). Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from policy.model import Metrics, analytic_scores, fixed_scores, metrics, model_scores
from policy.train import groups_of
from profiler.schema import TraceError
from rakv.cli import run_cli
from rakv.learned import PolicyFileError, load_policy
from simulator.costs import CostModelError
from simulator.session import SessionError
from simulator.timing import load_timing
from simulator.trace import load_trace


def evaluate(policy_path: Path, trace_path: Path, timing_path: Path | None = None) -> dict[str, Metrics]:
    policy = load_policy(policy_path)
    trace = load_trace(trace_path)
    timing = load_timing(timing_path or trace_path, trace)
    split = policy.sidecar["split"]
    test_families = set(split["test_families"])
    groups = [g for g in groups_of(trace, timing, policy.controller, split["resample"], split["seed"])
              if g.family in test_families]
    if not groups:
        raise PolicyFileError(f"{policy_path}: none of its test requests is in {trace_path} "
                              f"(it was trained on {', '.join(policy.sidecar['split']['traces'])})")
    fixed = [i for i, c in enumerate(groups[0].choices) if not c.adaptive]
    best_fixed = min(fixed, key=lambda i: sum(g.cost_s[i] for g in groups))
    return {
        "learned": metrics(groups, *model_scores(policy.kind, policy.booster, groups)),
        "rakv": metrics(groups, *analytic_scores(groups), chosen_per_group=[g.analytic_choice for g in groups]),
        f"best fixed {groups[0].choices[best_fixed]}": metrics(groups, fixed_scores(groups, best_fixed)),
        "oracle": metrics(groups, [g.cost_s for g in groups], [g.cost_s for g in groups]),
    }


def markdown(results: dict[str, Metrics], trace: str) -> str:
    lines = [f"{trace}: {next(iter(results.values())).num_requests} held-out requests", "",
             "| chooser | Spearman | mean regret | p95 regret | k-accuracy | choice accuracy | MAPE |",
             "|---|---|---|---|---|---|---|"]
    for name, m in results.items():
        mape = "" if m.mape is None else f"{100 * m.mape:.1f}%"
        lines.append(f"| {name} | {m.spearman:.3f} | {100 * m.mean_regret:.3f}% | {100 * m.p95_regret:.2f}% "
                     f"| {100 * m.k_accuracy:.1f}% | {100 * m.action_accuracy:.1f}% | {mape} |")
    return "\n".join(lines)


def _json_safe(values: dict) -> dict:
    return {k: None if isinstance(v, float) and np.isnan(v) else v for k, v in values.items()}


def run(args: argparse.Namespace) -> int:
    results = evaluate(args.policy, args.trace, args.timing)
    if args.json:
        plain = {k: _json_safe(asdict(v)) for k, v in results.items()}
        print(json.dumps({**plain.pop("learned"), "baselines": plain}))
    else:
        print(markdown(results, args.trace.name))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m policy.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", type=Path, required=True, help="policy directory (model.txt, policy.json)")
    p.add_argument("--trace", type=Path, required=True, help="a trace the policy was trained on")
    p.add_argument("--timing", type=Path, default=None, help="timing trace, for a trace with no ops table")
    p.add_argument("--json", action="store_true", help="print one JSON object: the learned policy's metrics and "
                                                      "its baselines'")
    return run_cli(run, p.parse_args(argv), (ValueError, TraceError, CostModelError, SessionError, OSError))


if __name__ == "__main__":
    sys.exit(main())
