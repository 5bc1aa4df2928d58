"""The oracle: for every request, each action's simulated cost is known before it runs,
and the cheapest is taken. Imports no torch.

Its actions are every fixed (r, drafter, k), k = 0 included, and the adaptive planner
(``rakv``'s per-round planning) with and without the draft model readied, under r = 0
and r = 1. Each is replayed exactly from the request's run lengths against the store as
it stands (``StoreModel.preview`` changes nothing) and priced by the same cost model the
other policies are; only the cheapest runs. The adaptive planners start from the
estimates of a ``rakv`` policy that observes what the oracle ran, as ``rakv`` would.
"""
from __future__ import annotations

from rakv.acceptance import ReplayedRound
from rakv.controller import CostModelPolicy, RequestOutcome
from rakv.cost_model import K_CHOICES, Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.round_planner import AdaptiveRounds, FixedRounds
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

    def candidates(self, features: RequestFeatures):
        """(action, a fresh planner) for every action the oracle weighs."""
        drafters = ((DRAFT_MODEL,) if self.inputs.draft_sizes is not None else ()) + (NGRAM,)
        adaptive = self.policy.adaptive
        for r in (0, 1):
            yield Action(r, 0), FixedRounds(DRAFT_MODEL, 0)
            for drafter in drafters:
                for k in K_CHOICES[1:]:
                    yield Action(r, k, drafter), FixedRounds(drafter, k)
            if adaptive is not None:
                yield Action(r, 0), adaptive.planner(features, Action(r, 0))
                if DRAFT_MODEL in drafters:
                    yield Action(r, 1, DRAFT_MODEL), adaptive.planner(features, Action(r, 1, DRAFT_MODEL))

    def decide(self, request: RecordedRequest, features: RequestFeatures, target: PrefixMatch,
               draft: PrefixMatch) -> tuple[Action, object, tuple[ReplayedRound, ...]]:
        n = features.num_prompt_tokens
        num_output = output_length(request, features.num_new_tokens)
        seq = request.token_ids[:n + num_output]
        best = None
        for action, planner in self.candidates(features):
            planner, rounds = self.rounds(request, features, planner)
            ready = DRAFT_MODEL in planner.drafters
            outcome = self.store.preview(seq, n, target, draft if ready else None, action.r, rounds)
            replayed = ReplayedRequest(request.request_id, action, features, outcome, tuple(planner.drafters),
                                       isinstance(planner, AdaptiveRounds), rounds, num_output, ())
            cost_s = request_cost(replayed, n, self.costs, self.inputs, self.overhead).e2e_s
            if best is None or cost_s < best[0]:  # ties: the first weighed (fewer draft tokens, no reuse)
                best = (cost_s, action, planner, rounds)
        return best[1], best[2], best[3]
