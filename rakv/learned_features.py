"""The learned policy's features: one row per (request, choice), all known before the
request runs. The live policy (``rakv.learned``) and training (``policy.dataset``) compute
them here, so the two cannot drift apart. Imports no torch.

Per request: prompt, hit and reusable lengths, whether it is an exact repeat, the
decode context; the ``rakv`` policy's running acceptance estimates (per drafter, and per
prompt-lookup signal); how repetitive the prompt is (the share of its 3-grams seen
earlier in it: prompt lookup's acceptance follows it); the hardware's timing (a step, the
draft's step and the verification jump, relative). Per choice: r, k, the drafter,
adaptive or not, and the analytic cost model's price of it (for an adaptive choice, the
cheapest fixed action it could run), absolute and relative to plain decoding: the
analytic ``rakv`` cost model is a feature, as it is the fallback.
"""
from __future__ import annotations

import math

import numpy as np

from rakv.choices import Choice, adaptive_choice, readied_drafters
from rakv.controller import CostModelPolicy
from rakv.cost_model import Action, RequestFeatures, decode_context
from rakv.drafters import DRAFT_MODEL, NGRAM, ngram_prior
from rakv.store_model import reused_positions

REQUEST_FEATURES = (
    "num_prompt_tokens", "num_new_tokens", "target_hit_tokens", "draft_hit_tokens", "reusable_tokens",
    "hit_fraction", "exact_repeat", "decode_context", "estimate_draft", "estimate_ngram",
    "estimate_ngram_signal_1", "estimate_ngram_signal_2", "estimate_ngram_signal_3",
    "prompt_repeat_3gram", "log_step_s", "draft_step_ratio", "verify_jump_ratio")
CHOICE_FEATURES = ("r", "k", "draft_model", "adaptive", "rakv_choice", "log_analytic_s", "analytic_vs_plain")
FEATURES = REQUEST_FEATURES + CHOICE_FEATURES
ANALYTIC_COLUMN = FEATURES.index("log_analytic_s")


def repeat_share(prompt_ids: np.ndarray, n: int) -> float:
    """The share of the prompt's n-grams (n = 2 or 3) that occurred earlier in it."""
    count = len(prompt_ids) - n + 1
    if count <= 1:
        return 0.0
    ids = np.asarray(prompt_ids, dtype=np.int64)
    shift = 63 // n  # each id in its own bits: n-grams of ids below 2^21 (every tokenizer's) code uniquely
    codes = ids[:count] << (shift * (n - 1))
    for j in range(1, n):
        codes = codes | (ids[j:count + j] << (shift * (n - 1 - j)))
    return 1.0 - len(np.unique(codes)) / count


class _Layout:
    """What ``feature_rows`` precomputes once per choice list: the choice columns, the
    fixed choices the analytic model prices, and, per adaptive choice, the fixed choices
    it could run (k = 0, and rounds of the drafters it has ready)."""

    def __init__(self, choices: tuple[Choice, ...]):
        self.choice_columns = np.array([(c.r, c.k, float(c.drafter == DRAFT_MODEL), float(c.adaptive))
                                        for c in choices])  # [choices, 4]
        self.fixed = [i for i, c in enumerate(choices) if not c.adaptive]
        self.actions = [choices[i].action for i in self.fixed]
        self.pools = {}
        for i, c in enumerate(choices):
            if c.adaptive:
                usable = readied_drafters(c.action)
                self.pools[i] = [j for j in self.fixed if choices[j].r == c.r
                                 and (choices[j].k == 0 or choices[j].drafter in usable)]
        self.plain = np.array([next(j for j in self.fixed if choices[j].r == c.r and choices[j].k == 0)
                               for c in choices])  # per choice: the plain-decoding choice of its r
        self.adaptive_index = {c: i for i, c in enumerate(choices) if c.adaptive}
        self._orders: dict[int, tuple[tuple[Action, ...], list[int]]] = {}  # by id: hashing actions costs

    def order_in(self, actions: tuple[Action, ...]) -> list[int]:
        """Where each fixed choice's action stands in ``actions`` (a policy's action list)."""
        known = self._orders.get(id(actions))
        if known is None or known[0] is not actions:
            known = self._orders[id(actions)] = (actions, [actions.index(a) for a in self.actions])
        return known[1]


_LAYOUTS: dict[int, tuple[tuple[Choice, ...], _Layout]] = {}  # by id: hashing 26 choices costs


def feature_rows(features: RequestFeatures, policy: CostModelPolicy, choices: tuple[Choice, ...]) -> np.ndarray:
    """[len(choices), len(FEATURES)] float64, in ``FEATURES`` order (``features.prompt_ids``
    must be set)."""
    known = _LAYOUTS.get(id(choices))
    if known is None or known[0] is not choices:
        known = _LAYOUTS[id(choices)] = (choices, _Layout(choices))
    layout = known[1]
    timings = policy.timings
    n, hit = features.num_prompt_tokens, features.target_hit_tokens
    context = decode_context(features)
    estimates = policy.acceptance
    signal = [policy.signal_acceptance.get((NGRAM, s), ngram_prior(s)) for s in (1, 2, 3)]
    step_s = timings.target.step_s(context)
    draft_ratio = timings.draft.step_s(context) / step_s if timings.draft is not None else 0.0
    request = [n, features.num_new_tokens, hit, features.draft_hit_tokens,
               reused_positions(n, hit, features.exact_repeat), hit / n, float(features.exact_repeat), context,
               estimates.get(DRAFT_MODEL, 0.0), estimates.get(NGRAM, 0.0), *signal,
               repeat_share(features.prompt_ids, 3), math.log(step_s),
               draft_ratio, timings.target.verify_fixed_s / step_s]
    # the analytic price of each choice (rakv's own pricing: an action over the memory limit
    # has none); an adaptive one costs what its cheapest fixed action would
    priced = policy.priced(features)
    analytic = np.empty(len(choices))
    if len(priced) == len(policy.actions):  # every action fits: priced in the policy's order
        analytic[layout.fixed] = [priced[j][0] for j in layout.order_in(policy.actions)]
    else:
        cost_of = {action: cost for cost, _, _, action in priced}
        analytic[layout.fixed] = [cost_of.get(action, np.inf) for action in layout.actions]
    for i, pool in layout.pools.items():
        analytic[i] = analytic[pool].min()
    rows = np.empty((len(choices), len(FEATURES)))
    rows[:, :len(REQUEST_FEATURES)] = request
    rows[:, len(REQUEST_FEATURES):len(REQUEST_FEATURES) + 4] = layout.choice_columns
    rows[:, -3] = 0.0
    rows[layout.adaptive_index[adaptive_choice(min(priced)[3])], -3] = 1.0  # what rakv itself would run
    rows[:, -2] = np.log(analytic)
    rows[:, -1] = analytic / analytic[layout.plain]
    return rows
