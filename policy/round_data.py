"""Training data for the learned round planner: the decision points of every request of
every trace, each labelled, for each drafter ready there, with its run length. Imports no
torch.

Every request is walked, in the trace's order through one replayed store (as the
simulator replays it), with every drafter ready (no draft model for a pair without one) by
a ``LearnedRounds`` planner that logs its features at every round start: without a model
it plans as ``rakv``'s adaptive planner, with one as the learned planner (the states that
planner visits: the second pass of training). The label is exact, from the run lengths:
m_t, capped where a round could see no further (the planner's max_k; a model-free
drafter's proposal length).

Only the drafters in ``rakv.learned_rounds.LEARNED`` get rows (the planner logs no
other). The store drafter's acceptance is what the store holds for the workload being
served: how often its requests repeat earlier ones, which no recorded trace shows (none
repeats a request; walking one twice taught the heads a single repeat rate, and they
drafted shorter store rounds than ``rakv`` wherever requests repeat more). The policy's
running estimate by signal measures it as it serves, so the learned planner plans that
drafter's rounds as ``rakv`` does (``rakv.learned``).

``token_prior`` is made from the labels: a first pass logs none, ``token_prior`` makes the
table from the training rows, and ``DrafterRows.with_token_prior`` fills the column in.

The heads' targets (``rakv.learned_rounds.HEADS``): ``first``, m >= 1, on every row;
``further``, on rows with m >= 1, the share of the m - 1 continuations among the
continuations and the stop (none when m reached the cap: censored), weighted by their
count (LightGBM's cross-entropy objective takes a share with a weight).

Families (a request's group id: a conversation, a prompt family, named by its workload, so
the same HumanEval task recorded in two traces is one family) are split 60/20/20 by
requests, seeded; a family's requests are never on two sides, in any trace.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rakv.controller import ControllerConfig, RequestOutcome
from rakv.cost_model import Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL
from rakv.learned import LearnedPolicy, PolicyFile
from rakv.learned_rounds import ROUND_FEATURES, LearnedRounds, RoundModel, TokenPrior
from rakv.settings import DecisionInputs
from simulator.session import Session, replayed_lengths
from simulator.trace import Trace

SPLITS = ("train", "validation", "test")
SPLIT_SHARES = (0.6, 0.2, 0.2)


@dataclass(frozen=True)
class DrafterRows:
    """One drafter's decision points."""

    x: np.ndarray  # [rows, ROUND_FEATURES]
    run: np.ndarray  # [rows] m_t, capped
    cap: np.ndarray  # [rows] the longest run a round there could see
    family: np.ndarray  # [rows] str
    token: np.ndarray  # [rows] the sequence's last token at the decision point

    @staticmethod
    def concat(parts: list["DrafterRows"]) -> "DrafterRows":
        parts = [p for p in parts if len(p.run)] or parts[:1]
        return DrafterRows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("x", "run", "cap", "family",
                                                                                      "token")))

    def with_token_prior(self, prior: TokenPrior) -> "DrafterRows":
        """The rows with ``token_prior`` from ``prior`` (a first pass logs none: the table
        is made from its labels)."""
        x = self.x.copy()
        x[:, TOKEN_PRIOR] = [prior[0].get(int(t), prior[1]) for t in self.token]
        return DrafterRows(x, self.run, self.cap, self.family, self.token)


TOKEN_PRIOR = ROUND_FEATURES.index("token_prior")
TOKEN_PSEUDO_COUNT = 10  # a token seen n times weighs n / (n + 10) against the drafter's mean


def token_prior(rows: DrafterRows) -> TokenPrior:
    """P(m >= 1) after each last token of ``rows``, smoothed towards their mean."""
    hit = first_target(rows)
    mean = float(hit.mean()) if len(hit) else 0.0
    sums: dict[int, list[float]] = {}
    for token, h in zip(rows.token.tolist(), hit.tolist()):
        tally = sums.setdefault(int(token), [0.0, 0])
        tally[0] += h
        tally[1] += 1
    return ({t: (s + TOKEN_PSEUDO_COUNT * mean) / (n + TOKEN_PSEUDO_COUNT) for t, (s, n) in sums.items()}, mean)


def first_target(rows: DrafterRows) -> np.ndarray:
    return (rows.run >= 1).astype(float)


def further_target(rows: DrafterRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(which rows, the share of continuations, its weight)."""
    continued = np.maximum(rows.run - 1, 0)
    trials = continued + (rows.run < rows.cap)
    keep = (rows.run >= 1) & (trials > 0)
    return keep, continued[keep] / trials[keep], trials[keep].astype(float)


class ReadyingAll:
    """The learned policy (``model`` None: the analytic planner), every request readying
    every drafter of the pair on a miss, each planner logging its decision points."""

    name = "learned"

    def __init__(self, inputs: DecisionInputs, controller: ControllerConfig, draft_prior: float,
                 model: RoundModel | None):
        self.learned = LearnedPolicy(PolicyFile.in_memory(model, controller, draft_prior), inputs.timings)
        self.action = Action(0, 1, DRAFT_MODEL) if DRAFT_MODEL in self.learned.analytic.drafters else Action(0, 0)
        self.logs: list[tuple[LearnedRounds, list]] = []  # per request: its planner and what it logged

    def decide(self, features: RequestFeatures) -> Action:
        return self.action

    def planner(self, features: RequestFeatures, action: Action) -> LearnedRounds:
        log: list = []
        planner = self.learned.planner(features, action, log)
        self.logs.append((planner, log))
        return planner

    def observe(self, outcome: RequestOutcome) -> None:
        pass  # each request's rounds start from the same priors


def collect(trace: Trace, inputs: DecisionInputs, controller: ControllerConfig, draft_prior: float,
            model: RoundModel | None = None) -> dict[str, DrafterRows]:
    """Per drafter of ``rakv.learned_rounds.LEARNED``, the decision points of every
    request of ``trace`` (see the module docstring)."""
    policy = ReadyingAll(inputs, controller, draft_prior, model)
    session = Session(policy, inputs, trace.target_namespace, trace.draft_namespace)
    found: dict[str, list] = {}
    for request in trace.requests:
        replayed = session.run(request, request.max_new_tokens)
        planner, log = policy.logs[-1]
        lengths_of = replayed_lengths(request, replayed)
        family, n = request.group_id, len(request.prompt_ids)
        for t, drafter, row in log:
            cap = planner.longest_round(drafter, t)
            found.setdefault(drafter, []).append((row, min(lengths_of[drafter].runs[t], cap), cap, family,
                                                  int(request.token_ids[n + t - 1])))
    return {d: DrafterRows(np.array([r[0] for r in rows], dtype=float).reshape(-1, len(ROUND_FEATURES)),
                           *(np.array([r[i] for r in rows]) for i in range(1, 5)))
            for d, rows in found.items()}


def draft_acceptance(rows: DrafterRows) -> float:
    """The draft model's per-token acceptance over the rows (the start of each request's estimate)."""
    continued = rows.run.sum()
    return float(continued / (continued + (rows.run < rows.cap).sum())) if len(rows.run) else 0.5


def split_families(families: dict[str, int], seed: int = 0) -> dict[str, str]:
    """Family -> split, in seeded order, each split taking its share of the requests
    (``families``: requests per family)."""
    names = sorted(families)
    order = np.random.default_rng(seed).permutation(len(names))
    total, taken, assigned = sum(families.values()), 0, {}
    bounds = np.cumsum(SPLIT_SHARES) * total
    for i in order:
        assigned[names[i]] = next((s for s, bound in zip(SPLITS, bounds) if taken < bound - 1e-9), SPLITS[-1])
        taken += families[names[i]]
    return assigned
