"""The paper's controller metrics, like for like: per request, its 12 actions (r in {0, 1},
k in {0, 1, 2, 4, 6, 8}, drafting with the draft model) ranked by a predicted cost,
against the cost each has when replayed. Imports no torch.

The requests are served in recorded order by the oracle (``simulator.oracle``), so the
store and the running acceptance estimates evolve as the best choices make them; before
each request the analytic cost model (``rakv.controller.CostModelPolicy.priced``, which
makes the request-level choice of ``rakv`` and of the learned policy) prices the 12, and
the oracle replays and prices them exactly (exact acceptance, the simulator's costs).
``known_acceptance`` prices each request with an acceptance of its own instead of the
running estimate: ``bench.paper_bound`` gives it the request's own, known in hindsight.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rakv.choices import R_CHOICES, K_CHOICES
from rakv.cost_model import Action
from rakv.drafters import DRAFT_MODEL
from rakv.settings import DecisionInputs
from simulator.oracle import Oracle
from simulator.schedule import schedule
from simulator.timing import Timing
from simulator.trace import RecordedRequest, Trace
from simulator.validate import spearman

PAPER_ACTIONS = tuple(Action(r, k, DRAFT_MODEL) for r in R_CHOICES for k in K_CHOICES)
TIE = 1e-9  # costs within this relative distance of the cheapest are cheapest too


@dataclass(frozen=True)
class PaperMetrics:
    num_requests: int
    spearman: float  # mean over requests of the rank correlation of predicted and replayed costs
    mean_regret: float  # the chosen action's replayed cost over the cheapest's, minus one
    action_accuracy: float  # the chosen action is a cheapest one
    k_accuracy: float  # the chosen k is a cheapest action's k
    mape: float  # of the predicted costs
    runner_up_gap: float  # median over requests of the next dearer action's replayed cost over the cheapest's, minus one


def paper_metrics(trace: Trace, timing: Timing, inputs: DecisionInputs,
                  known_acceptance: Callable[[RecordedRequest], float] | None = None) -> PaperMetrics:
    oracle = Oracle(inputs, timing.costs, timing.overhead, trace.target_namespace, trace.draft_namespace)
    predicted: dict[int, np.ndarray] = {}

    def price(request, features) -> None:
        adaptive = oracle.policy.adaptive  # its running estimates also plan the oracle's own rounds: left as they are
        acceptance = None if known_acceptance is None else {**adaptive.acceptance,
                                                             DRAFT_MODEL: known_acceptance(request)}
        cost_of = {action: cost for cost, _, _, action in adaptive.priced(features, acceptance)}
        predicted[request.request_id] = np.array([cost_of[a] for a in PAPER_ACTIONS])

    oracle.before_pricing = price
    ranks, regrets, hits, k_hits, errors, gaps = [], [], [], [], [], []
    for arrival in schedule(trace):
        request = arrival.request
        oracle.run(request, request.max_new_tokens)
        true_of = {c.action: cost for c, cost, _ in oracle.priced if not c.adaptive}
        true = np.array([true_of[a] for a in PAPER_ACTIONS])
        guess = predicted[request.request_id]
        chosen = int(np.argmin(guess))
        best = true <= true.min() * (1 + TIE)
        rank = spearman(guess, true)
        if not np.isnan(rank):
            ranks.append(rank)
        regrets.append(true[chosen] / true.min() - 1)
        hits.append(bool(best[chosen]))
        k_hits.append(PAPER_ACTIONS[chosen].k in {a.k for a, b in zip(PAPER_ACTIONS, best) if b})
        errors.extend(np.abs(guess - true) / true)
        dearer = true[~best]
        if dearer.size:
            gaps.append(dearer.min() / true.min() - 1)
    return PaperMetrics(len(regrets), float(np.mean(ranks)) if ranks else float("nan"), float(np.mean(regrets)),
                        float(np.mean(hits)), float(np.mean(k_hits)), float(np.mean(errors)),
                        float(np.median(gaps)) if gaps else float("nan"))
