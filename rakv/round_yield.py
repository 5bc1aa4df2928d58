"""What a round yields: its expected tokens E_k and its seconds, k = 0..max_k, under a
run-length distribution and the draft model's confidence stops; and each request's stop
threshold, moved as its draft tokens are verified. Functions for the round planners
(``rakv.round_planner``, ``rakv.learned_rounds``), which call them on every iteration of
every request. Imports no torch."""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence


def stopped_rounds(acceptance: float, stop_right: float, stop_wrong: float, costs_s: Sequence[float],
                   max_k: int) -> tuple[list[float], list[float]]:
    """([E_0, ..., E_max_k], [cost_0, ..., cost_max_k]) of draft-model rounds capped at k
    whose proposal stops after a token the draft is unsure of: after a right token with
    probability ``stop_right``, after a wrong one with ``stop_wrong`` (a useful threshold
    stops mostly wrong ones), each token right with probability a
    (``run_rounds`` with P(m >= j) = a^j)."""
    return run_rounds(acceptance, acceptance, stop_right, stop_wrong, costs_s, max_k)


def run_rounds(first: float, further: float, stop_right: float, stop_wrong: float, costs_s: Sequence[float],
               max_k: int) -> tuple[list[float], list[float]]:
    """([E_0, ..., E_max_k], [cost_0, ..., cost_max_k]) of rounds capped at k whose run
    length has P(m >= 1) = ``first`` and P(m >= j + 1 | m >= j) = ``further``, the proposal
    stopping after a right token with probability ``stop_right`` and after a wrong one with
    ``stop_wrong`` (both 0: no stops). Token j is kept, and drafting goes on, with
    g_j = a_j (1 - stop_right), a_0 = first and a_j = further after; drafting goes on at all
    with c_j = g_j + (1 - a_j)(1 - stop_wrong). So E_k = 1 + sum_{j<k} a_j prod_{i<j} g_i,
    and the round drafts D_k = sum_{j<k} prod_{i<j} c_i tokens, costing ``costs_s`` (per
    whole k) interpolated at D_k. With no stops and first = further these are
    ``progress_by_k`` and ``costs_s``."""
    if stop_right == 0.0 and stop_wrong == 0.0:  # every round drafts its k: the costs are costs_s
        return list(unstopped_progress(first, further, max_k)), list(costs_s[:max_k + 1])
    a, further = min(max(first, 0.0), 1.0), min(max(further, 0.0), 1.0)
    keep_right, keep_wrong = 1.0 - stop_right, 1.0 - stop_wrong
    progress, costs = [1.0], [costs_s[0]]
    kept = drafted = 0.0
    reach_kept = reach_drafted = 1.0  # prod_{i<j} g_i and prod_{i<j} c_i
    for _ in range(max_k):  # the planners' hot path: every drafter, every iteration
        kept += a * reach_kept
        drafted += reach_drafted
        reach_kept *= a * keep_right
        reach_drafted *= a * keep_right + (1.0 - a) * keep_wrong
        a = further
        whole = int(drafted)  # drafted <= j + 1 <= max_k
        low = costs_s[whole]
        costs.append(low if whole >= max_k else low + (drafted - whole) * (costs_s[whole + 1] - low))
        progress.append(1.0 + kept)
    return progress, costs


@lru_cache(maxsize=4096)  # the learned planner prices the same predictions again and again (``LearnedRounds``)
def unstopped_progress(first: float, further: float, max_k: int) -> tuple[float, ...]:
    """``run_rounds``' (E_0, ..., E_max_k) where no proposal stops early:
    E_k = 1 + first (1 + further + ... + further^(k-1)), both clamped to [0, 1]."""
    a, further = min(max(first, 0.0), 1.0), min(max(further, 0.0), 1.0)
    progress, kept, reach = [1.0], 1.0, a
    for _ in range(max_k):
        kept += reach
        reach *= further
        progress.append(kept)
    return tuple(progress)


MIN_CONFIDENCE_SAMPLES = 6  # verified draft tokens, both outcomes among them, before a request moves its threshold
CONFIDENCE_RANGE = (0.05, 0.9)  # learned thresholds stay inside: near 1, probabilities saturate and tie


def stop_shares(samples: Sequence[tuple[float, bool]], threshold: float) -> tuple[float, float]:
    """Of the (probability, right) samples, the share of right ones and of wrong ones
    below ``threshold`` (0 where there are none)."""
    right = [p < threshold for p, ok in samples if ok]
    wrong = [p < threshold for p, ok in samples if not ok]
    return (sum(right) / len(right) if right else 0.0, sum(wrong) / len(wrong) if wrong else 0.0)


def confidence_threshold(samples: Sequence[tuple[float, bool]], start: float) -> float:
    """The stop threshold after a request's verified draft tokens, each (the draft's
    probability, whether the target agreed): HF's assistant rule, the threshold among the
    observed probabilities that minimises (false continues / wrong tokens) + 3 (false
    stops / right tokens), the highest on ties, kept within ``CONFIDENCE_RANGE``.
    ``start`` until there are ``MIN_CONFIDENCE_SAMPLES`` with both outcomes.

    Only tokens up to the first wrong one in each round are samples: the draft made them
    from the true prefix, so a trace's teacher-forced probabilities give the same samples
    and the same threshold."""
    num_right = sum(1 for _, right in samples if right)
    num_wrong = len(samples) - num_right
    if len(samples) < MIN_CONFIDENCE_SAMPLES or not num_right or not num_wrong:
        return start
    best_cost, best = 3.0, None  # a threshold above every sample: every right token stopped
    continued_right = continued_wrong = 0
    ordered = sorted(samples, key=lambda s: -s[0])
    for i, (prob, right) in enumerate(ordered):
        continued_right += right
        continued_wrong += not right
        if i + 1 < len(ordered) and ordered[i + 1][0] == prob:
            continue  # a threshold continues every token at its probability
        cost = continued_wrong / num_wrong + 3 * (1 - continued_right / num_right)
        if cost < best_cost:
            best_cost, best = cost, prob
    low, high = CONFIDENCE_RANGE
    return start if best is None else min(max(best, low), high)
