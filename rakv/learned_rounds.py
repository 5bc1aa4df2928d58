"""The learned round planner: at each round start, for each ready drafter, LightGBM predicts
the distribution of the run length m from what is known at that moment, and the round
with the most expected tokens per second is taken. Imports no torch.

The distribution: P(m >= 1) = p1 (the first drafted token is right) and
P(m >= j + 1 | m >= j) = q after it, so P(m >= j) = p1 q^(j - 1). Two binary models per
drafter give them (``first`` and ``further``): after a 3-gram match prompt lookup's first
token is right most of the time and its runs are long (q high), after a 1-gram match
rarely; a draft model's p1 follows what it just did.

The features (``ROUND_FEATURES``), per drafter at output position t:
- ``signal`` (prompt lookup's matched n-gram order; the store drafter's match-length
  bucket and whether its matches agree, ``suffix_signal``; 0 for a draft model),
  ``proposed`` (a model-free drafter's proposal length) and ``extent`` (prompt lookup's
  match extended backwards);
- ``position`` and ``tokens_left``;
- the request's own running counts, the EWMA part: the planner's per-(drafter, signal)
  acceptance estimate (``AdaptiveRounds``; for a drafter with a model, started from fixed
  priors, not from other requests, so its rounds depend on the request alone), its
  trials, the drafter's rate so far;
- the recent rounds: what the drafter's last proposal had accepted, whether all of it,
  how long ago, and the last three outcomes;
- ``prompt_repeat``: how repetitive the prompt is (the share of its 3-grams seen before);
- the draft model's: its mean probability over its last round's verified tokens, and the
  request's confidence threshold (a round stops after a token below it);
- ``token_prior``: how often the drafter's first token was right after the sequence's last
  token, in the training data (a table per drafter, smoothed towards its mean): after some
  tokens (an opening bracket, a newline in code) the draft agrees far more often.

All are functions of the tokens, the run lengths, the signals and the probabilities a
trace stores (up to each round's first wrong token, as the engine computed them), so the
learned planner's rounds replay exactly (the store drafter's run lengths and signals are
not in a trace: a replay looks them up over its store, as the engine does). The EWMA part
also plans the drafters without a model (the store drafter: not in ``LEARNED``, see
``policy.round_data``): ``AdaptiveRounds``' estimate prices their rounds, started from the
policy's running estimate where ``LearnedPolicy`` carries one.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Mapping, Sequence, cast

import numpy as np

from rakv.drafters import DRAFT_MODEL, MODEL_FREE, NGRAM, Columns, RunLengths
from rakv.suffix_drafter import SUFFIX
from rakv.round_planner import AdaptiveRounds, PlannerConfig, RoundCosts
from rakv.round_yield import run_rounds, unstopped_progress
from rakv.step_load import StepLoad, longest_within
from rakv.trees import sigmoid

ROUND_FEATURES = ("signal", "proposed", "extent", "position", "tokens_left", "estimate", "trials", "drafter_rate",
                  "last_accepted", "last_full", "since_last", "recent_1", "recent_2", "recent_3", "prompt_repeat",
                  "draft_prob", "confidence", "token_prior")
HEADS = ("first", "further")  # P(m >= 1); P(m >= j + 1 | m >= j)
LEARNED = (DRAFT_MODEL, NGRAM)  # the drafters the trainer fits heads for, and the planner logs
NONE = -1.0  # a feature with nothing to report yet


def repeat_share(prompt_ids: Sequence[int] | np.ndarray, n: int) -> float:
    """The share of the prompt's n-grams (n = 2 or 3) that occurred earlier in it (once per
    prompt: requests repeat their prompts, and the count costs a sort)."""
    if len(prompt_ids) - n + 1 <= 1:
        return 0.0
    return _repeat_share(np.asarray(prompt_ids, dtype=np.int64).tobytes(), n)


@lru_cache(maxsize=256)  # keyed by the prompt's bytes: 256 prompts of 8K tokens hold 16 MiB
def _repeat_share(prompt_bytes: bytes, n: int) -> float:
    ids = np.frombuffer(prompt_bytes, dtype=np.int64)
    count = len(ids) - n + 1
    shift = 63 // n  # each id in its own bits: n-grams of ids below 2^21 (every tokenizer's) code uniquely
    codes = ids[:count] << (shift * (n - 1))
    for j in range(1, n):
        codes = codes | (ids[j:count + j] << (shift * (n - 1 - j)))
    return 1.0 - len(np.unique(codes)) / count


TokenPrior = tuple[Mapping[int, float], float]  # P(m >= 1) by the last token, and for a token not in it


class RoundModel:
    """Per drafter, the two heads as compiled functions of ``ROUND_FEATURES`` (raw scores),
    and the token priors they were trained with."""

    MAX_ROWS = 65_536  # rows predicted and kept at most (past them, the memo starts again empty)

    def __init__(self, heads: Mapping[str, tuple[Callable[..., float], Callable[..., float]]],
                 token_priors: Mapping[str, TokenPrior] | None = None):
        self.heads = dict(heads)
        self.token_priors = dict(token_priors or {})
        # (drafter, *row) -> prediction: a request that repeats another's prompt and store
        # state plans from the same rows again (equal features, int or float, predict alike)
        self._predicted: dict[tuple, tuple[float, float]] = {}

    def predict(self, drafter: str, row: Sequence[float]) -> tuple[float, float]:
        """(P(m >= 1), P(m >= j + 1 | m >= j)) of ``drafter`` at the features ``row``."""
        key = (drafter, *row)
        found = self._predicted.get(key)
        if found is None:
            if len(self._predicted) >= self.MAX_ROWS:
                self._predicted.clear()
            first, further = self.heads[drafter]
            found = self._predicted[key] = (sigmoid(first(*row)), sigmoid(further(*row)))
        return found


class _History:
    """One drafter's outcomes in one request, for the recent-rounds features."""

    __slots__ = ("successes", "trials", "last_t", "last_accepted", "last_full", "recent")

    def __init__(self):
        self.successes = self.trials = 0
        self.last_t, self.last_accepted, self.last_full = -1, NONE, NONE
        self.recent = [NONE, NONE, NONE]  # accepted, newest first


class LearnedRounds(AdaptiveRounds):
    """``AdaptiveRounds`` whose rounds are priced by the round model's run-length
    distribution (``run_rounds``) instead of a geometric one from the EWMA estimate. With
    ``model`` None it plans as ``AdaptiveRounds`` and, with ``log`` given, appends every
    decision's (t, drafter, features) to it: the training data (``policy.round_data``)."""

    def __init__(self, drafters: tuple[str, ...], priors: Mapping[tuple[str, int], float],
                 fallback: Mapping[str, float], costs: RoundCosts, config: PlannerConfig, model: RoundModel | None,
                 num_prompt: int, num_new_tokens: int, prompt_repeat: float, log: list | None = None):
        super().__init__(drafters, priors, fallback, costs, config)
        self.model, self.log = model, log
        self._carried = bool(priors)  # estimates from the requests before (``LearnedPolicy.planner``)
        # without a model (a first pass), ``token_prior`` is logged as NONE: the table is made from its labels
        self.token_priors = model.token_priors if model is not None else {}
        self.num_prompt, self.num_new_tokens, self.prompt_repeat = num_prompt, num_new_tokens, prompt_repeat
        self.history = {d: _History() for d in (DRAFT_MODEL, NGRAM, SUFFIX)}
        self._t = 0
        self._draft_prob = NONE
        self._lengths: Mapping[str, Columns] = {}
        self._tokens: Sequence[int] | np.ndarray = ()

    def bind(self, lengths: Mapping[str, Columns], tokens: Sequence[int] = ()) -> None:
        """``tokens``: the request's sequence, prompt first (``rakv.rounds.PlannedRounds``)."""
        self._lengths, self._tokens = lengths, tokens

    @property
    def memo_key(self) -> tuple | None:
        """Its rounds depend on the request alone, so a replay computes them once per
        request; not with the store drafter ready, whose proposals depend on the store, nor
        where a drafter's estimates were carried from the requests before."""
        if self.log is not None or SUFFIX in self.drafters or self._carried:
            return None
        return "learned", id(self.model), self.drafters, self._max_k

    def longest_round(self, drafter: str, t: int) -> int:
        """The most tokens a round of ``drafter`` at t can draft, as the engine drafts: a
        model-free drafter's proposal (prompt lookup's of at most ``shadow_length``)."""
        if drafter not in MODEL_FREE:
            return self._max_k
        proposed = self._lengths[drafter].proposed[t]
        return min(self._max_k, proposed, self.shadow_length) if drafter == NGRAM else min(self._max_k, proposed)

    def features(self, drafter: str, signal: int, t: int, longest: int | None = None) -> list[float]:
        """``ROUND_FEATURES`` of ``drafter`` at t (``extent``: prompt lookup's alone; the
        store drafter's match length is in its signal's bucket). ``longest``: its
        ``longest_round`` at t, where known."""
        h = self.history[drafter]
        draft = drafter == DRAFT_MODEL
        return [signal, self.longest_round(drafter, t) if longest is None else longest,
                cast(RunLengths, self._lengths[NGRAM]).extents[t] if drafter == NGRAM else 0, t,
                self.num_new_tokens - t, self.estimate(drafter, signal), h.trials,
                h.successes / h.trials if h.trials else NONE, h.last_accepted, h.last_full,
                t - h.last_t if h.last_t >= 0 else NONE, *h.recent, self.prompt_repeat,
                self._draft_prob if draft else NONE, self.confidence if draft else NONE, self.token_prior(drafter, t)]

    def token_prior(self, drafter: str, t: int) -> float:
        """The drafter's P(m >= 1) after the sequence's last token at t, from its table."""
        table = self.token_priors.get(drafter)
        if table is None or not len(self._tokens):
            return NONE
        return table[0].get(int(self._tokens[self.num_prompt + t - 1]), table[1])

    def plan(self, signals: Mapping[str, int], t: int = 0, load: StepLoad | None = None) -> tuple[str, int]:
        self._t = t
        if self.log is not None:
            for drafter in self.drafters:
                # a model-free drafter with no proposal has no decision
                if drafter in LEARNED and self.longest_round(drafter, t):
                    self.log.append((t, drafter, self.features(drafter, signals[drafter], t)))
        return super().plan(signals, t, load)  # the skeleton's; its rounds priced by ``_rounds`` below

    def _rounds(self, drafter: str, signal: int, t: int, offset: float, best_rate: float,
                costs_s: Mapping[str, Sequence[float]], bounds_s: tuple[float, ...]
                ) -> tuple[Sequence[float], Sequence[float], int] | None:
        """``AdaptiveRounds._rounds`` with the model's runs for a drafter it has heads for."""
        if self.model is None:  # a first pass: the analytic planner's rounds
            return super()._rounds(drafter, signal, t, offset, best_rate, costs_s, bounds_s)
        longest = self.longest_round(drafter, t)
        top = longest_within(costs_s[drafter], longest, bounds_s) if bounds_s else longest
        if not top:
            return None  # nothing to propose, or even its shortest round would make the step too slow
        if drafter not in self.model.heads:  # no model for it: the EWMA estimate's geometric runs
            a = self.estimate(drafter, signal)
            if a <= 0.0:
                return None  # nothing proposed: no round of it can gain
            return *self._priced(drafter, signal, a, costs_s[drafter]), top
        first, further = self.model.predict(drafter, self.features(drafter, signal, t, longest))
        # no round can win if even its most tokens at its cheapest cannot (this only skips work)
        cheapest = costs_s[drafter][1] if costs_s is not self.costs_s else self._cheapest_s(drafter)
        if (offset + 1.0 + first / max(1.0 - further, 1.0 / top)) < best_rate * cheapest:
            return None
        if drafter == DRAFT_MODEL and self._stop_shares != (0.0, 0.0):
            return *run_rounds(first, further, *self._stop_shares, costs_s[drafter], top), top
        return unstopped_progress(first, further, top), costs_s[drafter], top  # as ``run_rounds`` prices them

    def observe(self, drafter: str, signal: int, num_proposed: int, accepted: int,
                probs: Sequence[float] = ()) -> None:
        super().observe(drafter, signal, num_proposed, accepted, probs)
        if num_proposed == 0:
            return
        h = self.history[drafter]
        h.successes += accepted
        h.trials += accepted + (accepted < num_proposed)
        h.last_t, h.last_accepted, h.last_full = self._t, accepted, float(accepted == num_proposed)
        h.recent = [accepted, h.recent[0], h.recent[1]]
        if probs:
            verified = probs[:accepted + 1]
            self._draft_prob = sum(verified) / len(verified)
