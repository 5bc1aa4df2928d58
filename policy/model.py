"""The learned cost ranker: LightGBM over ``rakv.learned_features``, and how well it chooses.
Imports no torch.

Two kinds, the evaluation decides between them:
- ``regression``: the log of a choice's cost over its analytic price (the analytic EWMA
  cost model's error, which the trees learn to correct), so a predicted cost is the
  analytic price times exp(prediction); the cheapest prediction is chosen.
- ``lambdarank``: within each request, relevance by how many choices cost more; the
  highest score is chosen.

Metrics over groups (``policy.dataset.Group``), each against the labelled costs: the
Spearman correlation of predicted and true costs per request (mean), regret (the chosen
choice's cost over the cheapest's, minus one: mean and 95th percentile), k-accuracy
(the chosen k, or adaptive, is a cheapest choice's), choice accuracy (the chosen choice
costs the least, ties included) and, for regression, the MAPE of the predicted costs.
Every chooser is a score per choice, lowest taken (``scores``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policy.dataset import Group, stack
from rakv.learned import scores
from rakv.learned_features import ANALYTIC_COLUMN, FEATURES
from simulator.validate import spearman

KINDS = ("regression", "lambdarank")
TIE = 1e-9  # costs within this relative distance of the cheapest are cheapest too


@dataclass(frozen=True)
class Metrics:
    spearman: float
    mean_regret: float
    p95_regret: float
    k_accuracy: float
    action_accuracy: float
    mape: float | None  # of the predicted costs; None for a ranker
    num_requests: int


def lgb_params(kind: str, params: dict, seed: int = 0) -> dict:
    base = {"objective": kind, "verbosity": -1, "seed": seed, "deterministic": True, "num_threads": 1,
            "force_row_wise": True}
    if kind == "lambdarank":
        base.update(metric="ndcg", lambdarank_truncation_level=8)
    return {**base, **params}


def targets(kind: str, groups: list[Group]) -> np.ndarray:
    rows, costs, _ = stack(groups)
    if kind == "regression":
        return np.log(costs) - rows[:, ANALYTIC_COLUMN]
    return np.concatenate([relevance(g.cost_s) for g in groups])


def relevance(cost_s: np.ndarray) -> np.ndarray:
    """How many choices of the request cost more (at most 30, LightGBM's default gains)."""
    worse = (cost_s[None, :] > cost_s[:, None] * (1 + TIE)).sum(axis=1)
    return np.minimum(worse, 30).astype(float)


def train(kind: str, train_groups: list[Group], params: dict, num_rounds: int, seed: int = 0, callbacks=None):
    import lightgbm as lgb
    rows, _, sizes = stack(train_groups)
    data = lgb.Dataset(rows, targets(kind, train_groups), group=sizes if kind == "lambdarank" else None,
                       feature_name=list(FEATURES), free_raw_data=False)
    return lgb.train(lgb_params(kind, params, seed), data, num_boost_round=num_rounds, callbacks=callbacks or [])


def metrics(groups: list[Group], scores_per_group: list[np.ndarray], predicted_s: list[np.ndarray] | None = None,
            chosen_per_group: list[int] | None = None) -> Metrics:
    """How a chooser taking the lowest score of each group (or ``chosen_per_group``) fares;
    the scores rank the choices; ``predicted_s`` (per group, seconds per choice) gives the
    MAPE."""
    regrets, ranks, k_hits, hits = [], [], [], []
    for i, (g, score) in enumerate(zip(groups, scores_per_group)):
        chosen = int(np.argmin(score)) if chosen_per_group is None else chosen_per_group[i]
        cheapest = g.cost_s.min()
        regrets.append(g.cost_s[chosen] / cheapest - 1)
        best = g.cost_s <= cheapest * (1 + TIE)
        hits.append(bool(best[chosen]))
        k_of = [("adaptive" if c.adaptive else c.k) for c in g.choices]
        k_hits.append(k_of[chosen] in {k for k, b in zip(k_of, best) if b})
        if np.all(np.isfinite(score)):
            ranks.append(spearman(score, g.cost_s))
    ranks = [r for r in ranks if not np.isnan(r)]
    mape = None
    if predicted_s is not None:
        mape = float(np.mean(np.concatenate([np.abs(p - g.cost_s) / g.cost_s for g, p in zip(groups, predicted_s)])))
    return Metrics(float(np.mean(ranks)) if ranks else float("nan"), float(np.mean(regrets)),
                   float(np.percentile(regrets, 95)), float(np.mean(k_hits)), float(np.mean(hits)), mape, len(groups))


def model_scores(kind: str, booster, groups: list[Group]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """(scores per group, predicted seconds per group or None) of a booster."""
    rows, _, sizes = stack(groups)
    outputs = booster.predict(rows) if len(rows) else np.empty(0)
    per_group = np.split(outputs, np.cumsum(sizes)[:-1]) if sizes else []
    all_scores = [scores(kind, out, g.rows) for out, g in zip(per_group, groups)]
    return all_scores, ([np.exp(s) for s in all_scores] if kind == "regression" else None)


def analytic_scores(groups: list[Group]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The analytic EWMA cost model as a chooser: its log price of each choice."""
    return [g.rows[:, ANALYTIC_COLUMN] for g in groups], [np.exp(g.rows[:, ANALYTIC_COLUMN]) for g in groups]


def fixed_scores(groups: list[Group], index: int) -> list[np.ndarray]:
    """Always the choice at ``index``."""
    return [np.where(np.arange(len(g.choices)) == index, 0.0, np.inf) for g in groups]
