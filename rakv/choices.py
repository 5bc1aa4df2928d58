"""What a request-level decision can choose, so that the choice changes what runs: reuse
or not (r), and either a fixed (drafter, k) for every round (k = 0: plain steps) or the
adaptive planner (``rakv``'s per-round planning) with or without the draft model readied.
Imports no torch.

The oracle (``simulator.oracle``) weighs every choice; the learned policy
(``policy.learned``) ranks them. An adaptive choice's planner starts from a ``rakv``
policy's running estimates, which the caller keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

from rakv.controller import CostModelPolicy, RoundPlanner
from rakv.cost_model import K_CHOICES, Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.round_planner import FixedRounds


@dataclass(frozen=True, order=True)
class Choice:
    r: int
    adaptive: bool  # the planner picks each round's drafter and k
    drafter: str  # fixed: who drafts every round (the draft model for k = 0); adaptive: the draft model if readied
    k: int  # fixed: draft tokens every round; adaptive: 0

    @property
    def action(self) -> Action:
        """The request-level action the engine logs: an adaptive choice that readies the
        draft model is (r, k=1, draft), one that does not is (r, k=0)."""
        if self.adaptive:
            return Action(self.r, 1, DRAFT_MODEL) if self.drafter == DRAFT_MODEL else Action(self.r, 0)
        return Action(self.r, self.k, self.drafter)

    def __str__(self) -> str:
        if self.adaptive:
            return f"(r={self.r}, adaptive{', draft' if self.drafter == DRAFT_MODEL else ''})"
        return str(self.action)


def all_choices(draft_model: bool, adaptive: bool = True) -> tuple[Choice, ...]:
    """Every choice, under r = 0 then r = 1: k = 0, each drafter's fixed k, then the adaptive
    planner without and with the draft model (``draft_model`` False: no draft-model choice;
    ``adaptive`` False: no adaptive choice)."""
    drafters = ((DRAFT_MODEL,) if draft_model else ()) + (NGRAM,)
    choices = []
    for r in (0, 1):
        choices.append(Choice(r, False, DRAFT_MODEL, 0))
        choices += [Choice(r, False, d, k) for d in drafters for k in K_CHOICES[1:]]
        if adaptive:
            choices.append(Choice(r, True, NGRAM, 0))
            if draft_model:
                choices.append(Choice(r, True, DRAFT_MODEL, 0))
    return tuple(choices)


def make_planner(choice: Choice, features: RequestFeatures, policy: CostModelPolicy | None) -> RoundPlanner:
    """A fresh planner for the choice; an adaptive one starts from ``policy``'s estimates."""
    if not choice.adaptive:
        return FixedRounds(choice.drafter, choice.k)
    if policy is None:
        raise ValueError("an adaptive choice needs the adaptive policy's timings and estimates")
    return policy.planner(features, choice.action)
