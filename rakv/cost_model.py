"""Analytic cost model of one request under an action (r, drafter, k). Imports no torch.

The model charges, in seconds:
- a store lookup, and for r = 1 the clone of the reused positions (bytes / clone rate);
- the target prefill of the uncached prompt tokens after the reused ones;
- for k = 0: one target step per further token;
- for k > 0: rounds of one target verification of k + 1 tokens, each round advancing
  E_k(a) tokens, plus the drafter's cost: for the draft model its prefill of its
  uncached tokens and k draft steps per round; for ``ngram`` one lookup per round.

It is a function of measured timings (``PairTimings``), what the store holds
(``RequestFeatures``) and the acceptance estimate; the controller and, later, the
simulator call the same functions.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from rakv.drafters import DRAFT_MODEL, DRAFTERS, MODEL_FREE, NGRAM
from rakv.store_model import reused_positions


@dataclass(frozen=True, order=True)
class Action:
    r: int  # 1: reuse KV state from the prefix store; 0: compute the prompt from scratch
    k: int  # draft tokens per speculation round; 0: plain greedy decoding
    drafter: str = DRAFT_MODEL  # who proposes the k tokens (ignored when k = 0)

    def __post_init__(self):
        if self.r not in (0, 1) or self.k < 0 or self.drafter not in DRAFTERS:
            raise ValueError(f"invalid action r={self.r} k={self.k} drafter={self.drafter!r}")
        if self.k == 0 and self.drafter != DRAFT_MODEL:
            object.__setattr__(self, "drafter", DRAFT_MODEL)  # one k = 0 action, whoever asks

    def __str__(self) -> str:
        if self.k and self.drafter != DRAFT_MODEL:
            return f"(r={self.r}, {self.drafter} k={self.k})"
        return f"(r={self.r}, k={self.k})"


def expected_progress(acceptance: float, k: int) -> float:
    """E_k(a) = (1 - a^(k+1)) / (1 - a): expected tokens gained per round of draft length k.

    With acceptance a per draft token (geometric), a round accepts min(k, run) tokens and
    always adds one target token, so k = 0 gives exactly 1 and a = 1 gives k + 1.
    """
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def progress_by_k(acceptance: float, max_k: int) -> list[float]:
    """[E_0(a), ..., E_max_k(a)], each bitwise equal to ``expected_progress(a, k)`` (the
    same expression, computed in one pass: planners evaluate every k on every step)."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0 - 1e-12:
        return [float(k + 1) for k in range(max_k + 1)]
    miss = 1.0 - a
    return [(1.0 - a ** (k + 1)) / miss for k in range(max_k + 1)]


@dataclass(frozen=True)
class ModelTimings:
    """Least-squares fits of one model's forward costs on one machine (seconds)."""

    prefill_fixed_s: float
    prefill_per_token_s: float  # per new token
    prefill_per_token_context_s: float  # per (new token x tokens attended), the attention term
    step_fixed_s: float  # one-token forward at context 0
    step_per_context_s: float
    verify_per_token_s: float  # each extra token scored in the same forward
    kv_bytes_per_token: int
    # A forward of 2+ tokens over a one-token step, before the per-token term: on a CPU a
    # 2-token forward costs about 1.7 steps (matrix-vector becomes matrix-matrix), a
    # 9-token one about 2.8, so a line through the origin misprices short rounds.
    verify_fixed_s: float = 0.0
    # Measured seconds a forward of T >= 2 tokens takes over a one-token step, per T in
    # ``verify_tokens``, never decreasing in T. Where present they replace the line above,
    # interpolated: the cost of T tokens need not be linear in T (int4 Qwen2.5-Coder-1.5B
    # on one CPU thread: 1.06 steps for 2 tokens, 1.21 for 5, 1.32 for 9, 2.12 for 17,
    # when the kernel read the weights once for up to 8 rows), and the line made long
    # rounds look dear.
    verify_tokens: tuple[int, ...] = ()
    verify_extra_s: tuple[float, ...] = ()

    def prefill_s(self, num_new: int, num_cached: int) -> float:
        if num_new <= 0:
            return 0.0
        attended = num_cached + num_new / 2
        return (self.prefill_fixed_s + self.prefill_per_token_s * num_new
                + self.prefill_per_token_context_s * num_new * attended)

    def chunk_s(self, num_new: int, num_cached: int) -> float:
        """What a prefill chunk of ``num_new`` tokens after ``num_cached`` adds to a
        batched step: its prefill less the fixed part, which the step pays once."""
        return self.prefill_s(num_new, num_cached) - self.prefill_fixed_s if num_new > 0 else 0.0

    def step_s(self, num_context: int) -> float:
        return self.step_fixed_s + self.step_per_context_s * num_context

    def verify_s(self, num_tokens: int, num_context: int) -> float:
        if num_tokens <= 1:
            return self.step_s(num_context)
        return self.step_s(num_context) + self.rows_extra_s(num_tokens)

    def rows_extra_s(self, num_rows: int) -> float:
        """Seconds a forward of ``num_rows`` rows takes over a one-row step: the measured
        curve (extended along its last segment past the longest verification measured, as
        a batched step's rows may be), else the line."""
        if num_rows <= 1:
            return 0.0
        if self.verify_tokens:
            return interpolate((1, *self.verify_tokens), (0.0, *self.verify_extra_s), num_rows)
        return self.verify_fixed_s + self.verify_per_token_s * (num_rows - 1)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """y(x) through the points (xs increasing): linear between them and along the end
    segments beyond, never below 0 (the simulator's op curves too)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(ys[i] + slope * (x - xs[i]), 0.0)


@dataclass(frozen=True)
class PairTimings:
    target: ModelTimings
    draft: ModelTimings | None
    clone_s_per_byte: float
    lookup_s: float
    acceptance_prior: float  # teacher-forced draft/target agreement measured at calibration
    ngram_lookup_s: float = 0.0  # one prompt-lookup proposal
    ngram_acceptance_prior: float = 0.0

    def prior(self, drafter: str) -> float:
        return self.ngram_acceptance_prior if drafter == NGRAM else self.acceptance_prior


@dataclass(frozen=True)
class RequestFeatures:
    """What the controller sees of one request before it runs."""

    num_prompt_tokens: int
    num_new_tokens: int  # tokens to generate (the request's max_new_tokens)
    target_hit_tokens: int  # exact common prefix with the store, 0 on a miss
    draft_hit_tokens: int
    exact_repeat: bool  # the whole prompt and its logits are stored
    acceptance: float = 0.0  # the controller's running estimate for the drafter
    prompt_ids: np.ndarray | None = field(default=None, compare=False, repr=False)  # [n] int64, for prompt-side features
    num_running: int = 0  # requests running beside it when it is admitted (0: batch 1)

    @classmethod
    def of(cls, target_match, draft_match, num_new_tokens: int, prompt_ids: np.ndarray | None = None,
           num_running: int = 0) -> "RequestFeatures":
        """From the store's ``PrefixMatch`` of the prompt for the target and the draft."""
        return cls(num_prompt_tokens=target_match.num_prompt_tokens, num_new_tokens=num_new_tokens,
                   target_hit_tokens=target_match.hit_tokens, draft_hit_tokens=draft_match.hit_tokens,
                   exact_repeat=target_match.exact_repeat, prompt_ids=prompt_ids, num_running=num_running)


def action_bytes(action: Action, features: RequestFeatures, timings: PairTimings) -> int:
    """Peak working KV bytes of the action: every position the caches will hold."""
    positions = features.num_prompt_tokens + features.num_new_tokens + action.k
    total = positions * timings.target.kv_bytes_per_token
    if action.k > 0 and action.drafter == DRAFT_MODEL and timings.draft is not None:
        total += positions * timings.draft.kv_bytes_per_token
    return total


def action_cost_s(action: Action, features: RequestFeatures, timings: PairTimings) -> float:
    """Predicted end-to-end seconds of the request under ``action``."""
    return action_costs_s((action,), features, {action.drafter: features.acceptance}, timings)[0]


def round_s(timings: PairTimings, drafter: str, k: int, num_context: int) -> float:
    """Seconds of one round at ``num_context`` positions: k = 0 is one target step; k > 0
    is a target verification of k + 1 tokens plus the drafter's proposal (``ngram``: one
    lookup; the draft model: k steps)."""
    if k == 0:
        return timings.target.step_s(num_context)
    verify_s = timings.target.verify_s(k + 1, num_context)
    if drafter in MODEL_FREE:  # the store drafter's lookup is priced as prompt lookup's
        return verify_s + timings.ngram_lookup_s
    if timings.draft is None:
        raise ValueError("a draft-model round needs the draft's timings")
    return verify_s + k * timings.draft.step_s(num_context)


def decode_context(features: RequestFeatures) -> int:
    """The context length a request's decoding is priced at: halfway through its output."""
    return features.num_prompt_tokens + features.num_new_tokens // 2


def action_costs_s(actions, features: RequestFeatures, acceptance: dict[str, float],
                   timings: PairTimings, rounds=None) -> list[float]:
    """Predicted seconds of each action, with ``acceptance`` per drafter. The terms shared
    by many actions (prefills, steps) are computed once: this runs on every request.
    ``rounds`` (``round_planner.RoundCosts`` at ``decode_context``) may hold the per-round
    costs already computed."""
    return costs_under(action_terms(actions, features, timings, rounds), acceptance)


ActionTerm = tuple[float, int, float, str, int]  # (start or whole seconds, tokens left, seconds a round, drafter, k)


def action_terms(actions, features: RequestFeatures, timings: PairTimings, rounds=None) -> tuple[ActionTerm, ...]:
    """``action_costs_s``'s parts that the acceptance leaves alone, per action: (the
    seconds before decoding, or the whole seconds where k = 0; the tokens decoded after
    the first; a round's seconds; the drafter; k). A function of the request's lengths and
    hits, so a policy keeps them per request shape (``costs_under`` prices them)."""
    n, num_new = features.num_prompt_tokens, features.num_new_tokens
    target, draft = timings.target, timings.draft
    remaining = max(num_new - 1, 0)  # the first token comes out of the prefill
    context = decode_context(features)
    start_s = {}  # (r, uses draft model) -> lookup, clones and prefills before decoding
    for r in (0, 1):
        reused = reused_positions(n, features.target_hit_tokens, features.exact_repeat) if r else 0
        start_s[r, False] = (timings.lookup_s + timings.clone_s_per_byte * reused * target.kv_bytes_per_token
                             + target.prefill_s(n - reused, reused))
        if draft is not None:
            draft_reused = min(features.draft_hit_tokens, n) if r else 0
            start_s[r, True] = (start_s[r, False] + timings.clone_s_per_byte * draft_reused * draft.kv_bytes_per_token
                                + draft.prefill_s(n + 1 - draft_reused, draft_reused))
    terms = []
    for action in actions:
        k, drafter = action.k, action.drafter
        if rounds is None:
            per_round_s = round_s(timings, drafter, k, context)
        else:
            per_round_s = rounds.round_s[drafter][k] if k else rounds.step_s
        if k == 0:
            terms.append((start_s[action.r, False] + remaining * per_round_s, remaining, per_round_s, drafter, 0))
        else:
            terms.append((start_s[action.r, drafter == DRAFT_MODEL], remaining, per_round_s, drafter, k))
    return tuple(terms)


def costs_under(terms: Sequence[ActionTerm], acceptance: dict[str, float]) -> list[float]:
    """Predicted seconds of each action of ``terms`` (``action_terms``) with ``acceptance``
    per drafter: a drafting action's rounds each advance E_k tokens."""
    costs = []
    progress: dict[str, list[float]] = {}  # per drafter, E_k for every k: actions share them
    max_k = max((term[4] for term in terms), default=0)  # E_k up to the longest draft asked for
    for start_s, remaining, per_round_s, drafter, k in terms:
        if k == 0:
            costs.append(start_s)  # the whole seconds already
            continue
        by_k = progress.get(drafter)
        if by_k is None:
            by_k = progress[drafter] = progress_by_k(acceptance.get(drafter, 0.0), max_k)
        costs.append(start_s + remaining / by_k[k] * per_round_s)
    return costs


def _fit_model(rows: list, role: str) -> ModelTimings:
    """Least-squares fits of one model's prefill, decode and verify rows."""
    def select(op):
        return [r for r in rows if r.model == role and r.op == op]
    prefill, decode, verify = select("prefill"), select("decode"), select("verify")
    if not (prefill and decode and verify):
        raise ValueError(f"the ops hold no prefill, decode and verify timings of the {role}")
    design = np.array([[1.0, r.num_new_tokens, r.num_new_tokens * (r.num_cached_tokens + r.num_new_tokens / 2)]
                       for r in prefill])
    p_fixed, p_token, p_ctx = (max(float(x), 0.0) for x in
                               np.linalg.lstsq(design, np.array([r.seconds for r in prefill]), rcond=None)[0])
    contexts = np.array([r.num_cached_tokens for r in decode], dtype=float)
    seconds = np.array([r.seconds for r in decode])
    if len(set(contexts)) > 1:
        step_slope, step_fixed = (float(x) for x in np.polyfit(contexts, seconds, 1))
    else:
        step_slope, step_fixed = 0.0, float(np.median(seconds))
    step_slope = max(step_slope, 0.0)
    step_fixed = max(step_fixed, 0.0)
    # Each verify row over the one-token step of its own repeat: the calibration and the
    # recorder time the grid in passes of one repeat, so a repeat's rows share the same
    # minutes of the machine, whose speed drifts. Against the step of all repeats, a
    # verify block timed in a fast minute priced a 17-token forward at one step.
    level = {repeat: float(np.median([r.seconds - step_slope * r.num_cached_tokens for r in decode
                                      if r.repeat == repeat])) for repeat in {r.repeat for r in decode}}
    extra = np.array([r.seconds - (level.get(r.repeat, step_fixed) + step_slope * r.num_cached_tokens)
                      for r in verify])
    scored = np.array([r.num_new_tokens - 1 for r in verify], dtype=float)
    verify_fixed, verify_slope = _fit_line_nonnegative(scored, extra)
    sizes = sorted({r.num_new_tokens for r in verify})
    medians = [max(float(np.median([e for e, r in zip(extra, verify) if r.num_new_tokens == size])), 0.0)
               for size in sizes]
    extra_by_size = nondecreasing(medians)
    kv_bytes = max(r.num_bytes // r.num_new_tokens for r in prefill)
    return ModelTimings(
        prefill_fixed_s=p_fixed, prefill_per_token_s=p_token, prefill_per_token_context_s=p_ctx,
        step_fixed_s=step_fixed, step_per_context_s=step_slope, verify_per_token_s=verify_slope,
        kv_bytes_per_token=kv_bytes, verify_fixed_s=verify_fixed, verify_tokens=tuple(sizes),
        verify_extra_s=extra_by_size)


def nondecreasing(values: Sequence[float]) -> tuple[float, ...]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators). A
    forward over more tokens never costs less on kernels that read the weights once for
    all the rows (the packed, int8 and int4 ones); where the medians say otherwise, that is
    the machine's noise. (PyTorch's stock float32 kernels did cost less at 5 tokens than at
    3; their dip is averaged.)"""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours, means increasing
    for value in values:
        blocks.append([float(value), 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return tuple(total / count for total, count in blocks for _ in range(count))


def _fit_line_nonnegative(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of y ~ x by least squares, both kept >= 0."""
    if len(set(x.tolist())) > 1:
        slope, intercept = (float(v) for v in np.polyfit(x, y, 1))
        if slope >= 0 and intercept >= 0:
            return intercept, slope
        if slope < 0:
            return max(float(np.mean(y)), 0.0), 0.0
    return 0.0, max(float(np.dot(x, y) / max(np.dot(x, x), 1e-12)), 0.0)


def fit_timings(rows: list, acceptance_prior: float = 0.0, ngram_acceptance_prior: float = 0.0) -> PairTimings:
    """The cost model's timings from ops rows (``profiler.schema.OpRow``: a calibration or
    a trace's ops table)."""
    has_draft = any(r.model == "draft" for r in rows)
    clone = [r for r in rows if r.model == "store" and r.op == "clone"]
    lookup = [r.seconds for r in rows if r.model == "store" and r.op == "lookup"]
    ngram = [r.seconds for r in rows if r.model == "ngram" and r.op == "propose"]
    clone_s_per_byte = sum(r.seconds for r in clone) / max(sum(r.num_bytes for r in clone), 1)
    return PairTimings(
        target=_fit_model(rows, "target"), draft=_fit_model(rows, "draft") if has_draft else None,
        clone_s_per_byte=clone_s_per_byte, lookup_s=float(np.median(lookup)) if lookup else 0.0,
        acceptance_prior=acceptance_prior, ngram_lookup_s=float(np.median(ngram)) if ngram else 0.0,
        ngram_acceptance_prior=ngram_acceptance_prior)
