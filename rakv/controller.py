"""Policies: per request, choose whether to reuse stored KV (r), the drafter and the
draft length (k).

One interface serves the engine and the simulator: ``decide(features) -> Action`` before a
request runs and ``observe(outcome)`` after it. Imports no torch.

Fixed policies: ``ar`` (0,0), ``kv-only`` (1,0), ``spec-kN`` (0,N), ``joint-kN`` (1,N)
with the draft model, ``ngram-kN`` (0,N) and ``joint-ngram-kN`` (1,N) with prompt lookup.
The adaptive policy ``rakv`` prices every action with the analytic cost model under an
EWMA of each drafter's acceptance, drops actions whose working KV would exceed the memory
limit, and picks the cheapest (ties: fewer draft tokens, then no reuse).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from rakv.cost_model import (K_CHOICES, Action, PairTimings, RequestFeatures, action_bytes,
                             action_costs_s)
from rakv.drafters import DRAFT_MODEL, NGRAM

FIXED_POLICY_HELP = "ar, kv-only, spec-kN, joint-kN, ngram-kN, joint-ngram-kN (N in 1, 2, 4, 6, 8), rakv"


@dataclass(frozen=True)
class RequestOutcome:
    """What a policy learns from a finished request."""

    action: Action
    accepted_per_round: tuple[int, ...]  # accepted draft tokens in each speculation round
    k_per_round: tuple[int, ...]  # draft length of each round (the last may be clipped)


def acceptance_from_rounds(accepted_per_round, k_per_round) -> float | None:
    """Maximum-likelihood per-token acceptance of a geometric run model.

    Every accepted token is a success; a round that stopped short of its k ended on a
    failure. Returns None when no draft token was proposed.
    """
    successes = sum(accepted_per_round)
    failures = sum(1 for a, k in zip(accepted_per_round, k_per_round) if a < k)
    if successes + failures == 0:
        return None
    return successes / (successes + failures)


class Policy(Protocol):
    name: str

    def decide(self, features: RequestFeatures) -> Action: ...

    def observe(self, outcome: RequestOutcome) -> None: ...


@dataclass
class FixedPolicy:
    name: str
    action: Action

    def decide(self, features: RequestFeatures) -> Action:
        return self.action

    def observe(self, outcome: RequestOutcome) -> None:
        pass


@dataclass(frozen=True)
class ControllerConfig:
    ewma_decay: float = 0.3  # weight of the newest request's acceptance
    memory_limit_bytes: int | None = None  # working KV limit per request; None: unlimited


@dataclass
class CostModelPolicy:
    """The adaptive ``rakv`` policy: cheapest feasible action under the analytic model."""

    timings: PairTimings
    config: ControllerConfig = field(default_factory=ControllerConfig)
    name: str = "rakv"

    def __post_init__(self):
        drafters = ((DRAFT_MODEL,) if self.timings.draft is not None else ()) + (NGRAM,)
        # EWMA of each drafter's per-token acceptance, from the calibration priors
        self.acceptance = {d: self.timings.prior(d) for d in drafters}
        self.actions = tuple(Action(r, 0) for r in (0, 1)) + tuple(
            Action(r, k, d) for d in drafters for k in K_CHOICES[1:] for r in (0, 1))

    def decide(self, features: RequestFeatures) -> Action:
        return self.rank(features)[0][1]

    def rank(self, features: RequestFeatures) -> list[tuple[float, Action]]:
        """Feasible actions with their predicted seconds, cheapest first."""
        limit = self.config.memory_limit_bytes
        actions = [a for a in self.actions if limit is None or action_bytes(a, features, self.timings) <= limit]
        costs = action_costs_s(actions, features, self.acceptance, self.timings)
        ranked = sorted(zip(costs, (a.k for a in actions), (a.r for a in actions), actions))
        if not ranked:
            raise ValueError(
                f"no action fits the memory limit of {limit} bytes for a "
                f"{features.num_prompt_tokens}-token prompt")
        return [(cost, action) for cost, _, _, action in ranked]

    def observe(self, outcome: RequestOutcome) -> None:
        rate = acceptance_from_rounds(outcome.accepted_per_round, outcome.k_per_round)
        drafter = outcome.action.drafter
        if rate is not None and drafter in self.acceptance:
            beta = self.config.ewma_decay
            self.acceptance[drafter] = (1 - beta) * self.acceptance[drafter] + beta * rate


_FIXED = re.compile(r"^(spec|joint|ngram|joint-ngram)-k(\d+)$")


def fixed_action(name: str) -> Action | None:
    """The action of a fixed policy name, or None if ``name`` is not a fixed policy."""
    if name == "ar":
        return Action(0, 0)
    if name == "kv-only":
        return Action(1, 0)
    m = _FIXED.match(name)
    if m and int(m.group(2)) in K_CHOICES[1:]:
        kind = m.group(1)
        return Action(int(kind.startswith("joint")), int(m.group(2)), NGRAM if kind.endswith("ngram") else DRAFT_MODEL)
    return None


def make_policy(name: str, timings: PairTimings | None = None,
                config: ControllerConfig = ControllerConfig()) -> Policy:
    """Build a policy by name; raises ValueError naming the valid choices."""
    action = fixed_action(name)
    if action is not None:
        return FixedPolicy(name, action)
    if name == "rakv":
        if timings is None:
            raise ValueError("policy 'rakv' needs timing statistics (calibrate the pair first)")
        return CostModelPolicy(timings, config)
    raise ValueError(f"unknown policy {name!r}; choose one of: {FIXED_POLICY_HELP}")
