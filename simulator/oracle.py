"""The oracle: for every request, each action's simulated cost is known before it runs,
and the cheapest is taken. Imports no torch.

Its actions are every ``rakv.choices.Choice``: every fixed (r, drafter, k), k = 0
included, and the adaptive planner (``rakv``'s per-round planning) with and without the
draft model readied, under r = 0 and r = 1. Each is replayed exactly from the request's run lengths against the store as
it stands (``StoreModel.preview`` changes nothing) and priced by the same cost model the
other policies are; only the cheapest runs. The adaptive planners start from the
estimates of a ``rakv`` policy that observes what the oracle ran, as ``rakv`` would.
"""
from __future__ import annotations

from rakv.acceptance import ReplayedRound
from rakv.choices import Choice, all_choices
from rakv.controller import CostModelPolicy, RequestOutcome, make_planner
from rakv.cost_model import Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL
from rakv.settings import DecisionInputs
from rakv.store_model import PrefixMatch
from simulator.costs import OpCosts, Overhead, request_cost
from simulator.session import ReplayedRequest, Session, output_length
from simulator.trace import RecordedRequest


class _Learner:
    """The oracle's policy slot: it only passes what ran on to the ``rakv`` estimates."""

    name = "oracle"

    def __init__(self, adaptive: CostModelPolicy | None):
        self.adaptive = adaptive

    def observe(self, outcome: RequestOutcome) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(outcome)


class Oracle(Session):
    def __init__(self, inputs: DecisionInputs, costs: OpCosts, overhead: Overhead, target_namespace: str,
                 draft_namespace: str | None):
        adaptive = CostModelPolicy(inputs.timings, inputs.controller) if inputs.timings is not None else None
        super().__init__(_Learner(adaptive), inputs, target_namespace, draft_namespace)
        self.costs, self.overhead = costs, overhead
        self.choices = all_choices(inputs.draft_sizes is not None, adaptive is not None)
        self.priced: list[tuple[Choice, float, ReplayedRequest]] = []  # the last request's choices, priced
        self.before_pricing = None  # called (request, features) before each request's choices are priced

    def decide(self, request: RecordedRequest, features: RequestFeatures, target: PrefixMatch,
               draft: PrefixMatch) -> tuple[Action, object, tuple[ReplayedRound, ...]]:
        if self.before_pricing is not None:
            self.before_pricing(request, features)
        n = features.num_prompt_tokens
        num_output = output_length(request, features.num_new_tokens)
        self.priced = []
        seq = request.token_ids[:n + num_output]
        best = None
        for choice in self.choices:
            planner, rounds = self.rounds(request, features, make_planner(choice, features, self.policy.adaptive))
            ready = DRAFT_MODEL in planner.drafters
            outcome = self.store.preview(seq, n, target, draft if ready else None, choice.r, rounds)
            replayed = ReplayedRequest(request.request_id, choice.action, features, outcome, tuple(planner.drafters),
                                       choice.adaptive, rounds, num_output, ())
            cost_s = request_cost(replayed, n, self.costs, self.inputs, self.overhead).e2e_s
            self.priced.append((choice, cost_s, replayed))
            if best is None or cost_s < best[0]:  # ties: the first weighed (fewer draft tokens, no reuse)
                best = (cost_s, choice.action, planner, rounds)
        return best[1], best[2], best[3]
