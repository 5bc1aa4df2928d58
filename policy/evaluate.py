"""``python -m policy.evaluate``: a learned policy on its held-out families of a trace,
replayed beside the analytic ``rakv`` controller, the oracle and the round oracle.

    python -m policy.evaluate --policy policies/smollm2 --trace traces/smollm2-chat [--json]

Reported (``Evaluation``):
- ``tokens_per_s`` of ``learned``, ``rakv``, ``oracle`` and ``round-oracle``: output tokens
  per second of service over the held-out requests, replayed in recorded order under
  today's settings (a learned policy under its own controller settings);
- ``headroom_captured`` = (learned - rakv) / (round-oracle - rakv), and
  ``causal_headroom_captured`` = (learned - rakv) / (causal bound - rakv), the causal
  bound (``simulator.causal_bound``) being ``rakv`` with the stop rule and threshold that do
  best on these very requests, a reference a planner without foresight can reach;
- per drafter, the AUC and Brier score of the m >= 1 prediction at the round starts of
  those requests, beside the same for the request's EWMA estimate (``ewma_auc``);
- ``paper_actions``: the paper's 12 actions (r in {0, 1}, k in {0, 1, 2, 4, 6, 8}, the
  draft model) ranked per request by the analytic cost model that makes the learned
  policy's request-level choice, against their replayed costs: Spearman, mean regret,
  action accuracy, k accuracy, the MAPE of the predicted costs, and how much dearer the
  runner-up is than the cheapest (``bench.paper_bound`` prices the same with each request's
  own acceptance, known in hindsight).
Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from policy.paper_actions import PaperMetrics, paper_metrics
from policy.round_data import collect, first_target
from profiler.schema import TraceError
from rakv.cli import run_cli
from rakv.learned import LearnedPolicy, PolicyFile, PolicyFileError, load_policy
from rakv.learned_rounds import ROUND_FEATURES
from rakv.settings import DecisionInputs, Settings
from simulator.causal_bound import CausalBound, causal_bound
from simulator.costs import CostModelError
from simulator.replay import make_session, simulate
from simulator.schedule import schedule
from simulator.session import Session, SessionError
from simulator.timing import Timing, load_timing
from simulator.trace import Trace, load_trace
from simulator.validate import average_ranks

CHOOSERS = ("learned", "rakv", "oracle", "round-oracle")


@dataclass(frozen=True)
class Prediction:
    """How well P(m >= 1) is predicted at a drafter's round starts."""

    num_rows: int
    auc: float | None
    brier: float
    ewma_auc: float | None  # the request's EWMA estimate as the prediction
    ewma_brier: float


@dataclass(frozen=True)
class Evaluation:
    trace: str
    num_requests: int
    tokens_per_s: dict[str, float]
    headroom_captured: float | None  # None where the round oracle is no faster than rakv
    causal: CausalBound
    causal_headroom_captured: float | None  # None where the causal bound is no faster than rakv
    prediction: dict[str, Prediction]
    paper_actions: PaperMetrics | None  # None for a pair without a draft model


def subset(trace: Trace, families: set[str]) -> Trace:
    """The trace's requests of these families (group ids), in recorded order."""
    kept = tuple(r for r in trace.requests if r.group_id in families)
    return replace(trace, requests=kept, by_id={r.request_id: r for r in kept})


def service_tokens_per_s(trace: Trace, timing: Timing, session: Session) -> float:
    """Output tokens per second of service of ``session`` over the trace's requests."""
    served = simulate(schedule(trace), session, timing)
    return sum(s.num_output_tokens for s in served) / sum(s.service_s for s in served)


def session_of(name: str, policy_file: PolicyFile | None, trace: Trace, timing: Timing,
               inputs: DecisionInputs) -> Session:
    """A replay session of ``name``, as ``simulator.replay`` makes it; ``learned`` is
    ``policy_file``, which may be a trial's, held in memory."""
    if name == "learned":
        return Session(LearnedPolicy(policy_file, inputs.timings), inputs, trace.target_namespace,
                       trace.draft_namespace)
    return make_session(name, trace, inputs, timing)


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """The probability that a positive outscores a negative (ties half), or None without both."""
    positives, negatives = label.sum(), len(label) - label.sum()
    if not positives or not negatives:
        return None
    ranks = average_ranks(score) + 1  # from 1: the Mann-Whitney U of the positives
    return float((ranks[label == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def predictions(policy_file: PolicyFile, trace: Trace, inputs: DecisionInputs) -> dict[str, Prediction]:
    """Per drafter with a head, at the learned planner's round starts over ``trace``."""
    rows = collect(trace, inputs, policy_file.controller, float(policy_file.sidecar["draft_prior"]),
                   policy_file.model)
    estimate = ROUND_FEATURES.index("estimate")
    found = {}
    for drafter, r in rows.items():
        if drafter not in policy_file.model.heads or not len(r.run):
            continue
        label = first_target(r)
        p = np.array([policy_file.model.predict(drafter, row)[0] for row in r.x])
        ewma = r.x[:, estimate]
        found[drafter] = Prediction(len(label), auc(p, label), float(np.mean((p - label) ** 2)), auc(ewma, label),
                                    float(np.mean((ewma - label) ** 2)))
    return found


def evaluate_trace(policy_file: PolicyFile, trace: Trace, timing: Timing, families: set[str]) -> Evaluation:
    """``policy_file`` over the trace's requests of ``families`` (see the module docstring)."""
    held_out = subset(trace, families)
    if not held_out.requests:
        raise PolicyFileError(f"{policy_file.path}: none of its test families is in {trace.path}")
    inputs = timing.decision_inputs(held_out, Settings())
    rates = {name: service_tokens_per_s(held_out, timing, session_of(name, policy_file, held_out, timing, inputs))
             for name in CHOOSERS}
    causal = causal_bound(lambda settings: service_tokens_per_s(
        held_out, timing, session_of("rakv", None, held_out, timing, timing.decision_inputs(held_out, settings))),
        base_score=rates["rakv"])  # rakv under today's settings, replayed above
    paper = paper_metrics(held_out, timing, inputs) if inputs.draft_sizes is not None else None
    return Evaluation(trace.path.name, len(held_out.requests), rates,
                      captured(rates["learned"], rates["rakv"], rates["round-oracle"]), causal,
                      captured(rates["learned"], rates["rakv"], causal.score),
                      predictions(policy_file, held_out, inputs), paper)


def captured(rate: float, baseline: float, bound: float) -> float | None:
    """The share of the gap from ``baseline`` to ``bound`` that ``rate`` closes (None: no gap)."""
    return (rate - baseline) / (bound - baseline) if bound > baseline else None


def share(value: float | None) -> str:
    """A ``captured`` share as text."""
    return "n/a (no headroom)" if value is None else f"{value:.2f}"


def evaluate(policy_path: Path, trace_path: Path, timing_path: Path | None = None) -> Evaluation:
    policy_file = load_policy(policy_path)
    trace = load_trace(trace_path)
    return evaluate_trace(policy_file, trace, load_timing(timing_path, trace),
                          set(policy_file.sidecar["split"]["test_families"]))


def markdown(e: Evaluation) -> str:
    lines = [f"{e.trace}: {e.num_requests} held-out requests", "",
             "| chooser | tok/s (service) | vs rakv |", "|---|---|---|"]
    lines += [f"| {name} | {rate:.2f} | {rate / e.tokens_per_s['rakv'] - 1:+.1%} |"
              for name, rate in e.tokens_per_s.items()]
    tuned = ", ".join(e.causal.assignments) or "today's settings"
    lines += [f"| causal bound: rakv tuned in hindsight ({tuned}) | {e.causal.score:.2f} | "
              f"{e.causal.score / e.tokens_per_s['rakv'] - 1:+.1%} |"]
    lines += ["", f"headroom captured: {share(e.headroom_captured)} of the round oracle's, "
              f"{share(e.causal_headroom_captured)} of the causal bound's ({e.causal.num_tried} settings tried)", "",
              "| drafter | rows | AUC m>=1 | Brier | EWMA AUC | EWMA Brier |", "|---|---|---|---|---|---|"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines += [f"| {d} | {p.num_rows} | {fmt(p.auc)} | {p.brier:.3f} | {fmt(p.ewma_auc)} | {p.ewma_brier:.3f} |"
              for d, p in e.prediction.items()]
    if e.paper_actions is not None:
        p = e.paper_actions
        lines += ["", "paper's 12 actions (analytic request-level ranking): "
                  f"Spearman {p.spearman:.3f}, mean regret {p.mean_regret:.2%}, action accuracy "
                  f"{p.action_accuracy:.1%}, k accuracy {p.k_accuracy:.1%}, MAPE {p.mape:.1%}, "
                  f"the runner-up {p.runner_up_gap:.1%} dearer than the cheapest (median)"]
    return "\n".join(lines)


def _json_safe(value):
    if isinstance(value, float) and np.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def run(args: argparse.Namespace) -> int:
    result = evaluate(args.policy, args.trace, args.timing)
    print(json.dumps(_json_safe(asdict(result))) if args.json else markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m policy.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", type=Path, required=True, help="policy directory (policy.json and the round models)")
    p.add_argument("--trace", type=Path, required=True, help="a trace the policy was trained on")
    p.add_argument("--timing", type=Path, default=None,
                   help="timing trace (default: the trace's own ops, else the timing trace its metadata names)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return run_cli(run, p.parse_args(argv), (ValueError, TraceError, CostModelError, SessionError, OSError))


if __name__ == "__main__":
    sys.exit(main())
