"""Foresight under load: ``rakv`` with each round's outcome known before it drafts. A
reference for the batched replay, not a policy an engine can run. Imports no torch.

At batch 1 the round oracle (``simulator.round_oracle``) bounds what any round planner can
reach: a shortest path over each request's rounds. Under load a request's rounds share
their steps with other requests', whose rounds depend on it in turn, and no such path is
known. So this answers a narrower question, the one the planners' predictions can be
measured by: what would ``rakv`` reach if it knew, before each round, how many tokens the
round will bring?

``ForesightRounds`` differs from ``rakv``'s planner (``AdaptiveRounds``) in that alone:
each round it prices every ready drafter's rounds at the step's prices, as ``rakv``
prices them (``rakv.step_load``; its ``min_gain``, ITL pace and held draft model
included), but with the tokens each k brings read off the request's run lengths, min(k,
m_t) + 1, where ``rakv`` expects E_k from its estimate. So it drafts no further than the
run (k <= m_t: a longer round costs more rows for no more tokens) and never where the run
is empty; the draft model runs to k (no confidence stop: the stop only guesses where the
run ends) and is never probed. The request-level choices (reuse, which drafters to ready)
are ``rakv``'s, from the running estimates, which the rounds feed as ``rakv``'s do.

Invariant: the rounds are a function of the trace's facts and the step's load, as every
planner's; every round accepts all it drafts.

It is greedy, one round at a time, by the step's tokens per second: not a bound on
goodput, which turns on queues and latency bounds no single round sees.
``simulator.sweep_summary`` lists it apart from the policies.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from rakv.controller import CostModelPolicy
from rakv.cost_model import Action, RequestFeatures
from rakv.drafters import Columns
from rakv.round_planner import AdaptiveRounds
from rakv.step_load import longest_within

NAME = "foresight"
MEANING = "rakv knowing each round's outcome before it drafts"  # as the replay's outputs name it


class ForesightRounds(AdaptiveRounds):
    """``AdaptiveRounds`` with each round's tokens read off the run lengths it is bound to."""

    def bind(self, lengths: Mapping[str, Columns], tokens=()) -> None:
        self._runs = {d: lengths[d].runs for d in self.drafters}  # m_t, read at t (the store drafter's looked up then)

    def _rounds(self, drafter: str, signal: int, t: int, offset: float, best_rate: float,
                costs_s: Mapping[str, Sequence[float]], bounds_s: tuple[float, ...]
                ) -> tuple[Sequence[float], Sequence[float], int] | None:
        run = self._runs[drafter][t]
        if not run:
            return None  # a round would bring the target's one token, at more than a step's price
        top = min(run, longest_within(costs_s[drafter], self._max_k, bounds_s))
        # a round of k <= m_t brings its k tokens and the target's own: progress[k] = k + 1
        return range(1, top + 2), costs_s[drafter], top


@dataclass
class ForesightPolicy(CostModelPolicy):
    """``rakv``'s controller, its requests' rounds planned with foresight."""

    name: str = NAME

    def planner(self, features: RequestFeatures, action: Action) -> ForesightRounds:
        drafters, config, costs = self.planner_setup(features, action)
        return ForesightRounds(drafters, self.signal_acceptance, self.acceptance, costs,
                               replace(config, draft_confidence=0.0))
