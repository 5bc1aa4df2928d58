"""Guarding the runs table against a busy machine: a run that something else on the
machine slowed is timed again, from the same engine state, and the median attempt is kept.

Which runs were slowed? The runs of one request under every policy (its *siblings*, run
in lockstep) did different work, so their times are compared after dividing each by the
calibrated price of the work it did (``priced_s``: its prefill, plain steps and rounds).
The calibration prices some policies' work a little high or low, the same way on every
request, so each policy's ratio is compared with the siblings' median times what that
policy's ratio usually is (its median over the earlier requests, ``SlowRuns``). A run
more than ``tolerance`` above that is an outlier (noise only ever adds time). It is run
again from a snapshot of its engine taken before it, up to ``max_attempts`` times in
all, and the attempt with the median end-to-end time is kept.

Invariant: an engine's decisions are functions of the tokens and its settings, never of
time, so every attempt makes the same decisions, rounds, output and store contents, and
the engine after a repeat is the engine after the first attempt.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from statistics import median

from rakv.cost_model import PairTimings, round_s


@dataclass(frozen=True)
class NoiseGuard:
    tolerance: float = 0.15  # a run this much slower than its siblings' median, per priced second, is repeated
    max_attempts: int = 3  # attempts in all, the first included; 1: never repeat

    def __post_init__(self):
        if self.tolerance <= 0 or self.max_attempts < 1:
            raise ValueError(f"need a positive tolerance and at least 1 attempt, got {self.tolerance}, "
                             f"{self.max_attempts}")


def priced_s(result, timings: PairTimings) -> float:
    """The calibrated seconds of the work a run did (``rakv.engine.RequestResult``): the
    target's prefill of what it did not reuse, then every plain step and round, at the
    context halfway through the output."""
    n = result.num_prompt_tokens
    context = n + len(result.output_ids) // 2
    total = timings.target.prefill_s(n - result.reused_tokens, result.reused_tokens)
    advanced = 1 + sum(r.accepted + 1 for r in result.rounds)
    for r in result.rounds:
        total += round_s(timings, r.drafter, max(r.num_proposed, 1), context)
    total += max(len(result.output_ids) - advanced, 0) * timings.target.step_s(context)
    return total


class SlowRuns:
    """Picks the slowed runs of each request, learning from earlier requests how each
    policy's time usually compares with its siblings' (a calibration that misprices one
    policy's work must not make every one of its runs look slowed)."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance
        self._usual: dict[str, list[float]] = {}  # policy -> its unslowed runs' ratio over their siblings' median

    def __call__(self, ratios: dict[str, float]) -> list[str]:
        """The names whose seconds per priced second exceed the siblings' median times
        their usual share by more than ``tolerance`` (none with fewer than 3 siblings:
        no median to trust)."""
        if len(ratios) < 3:
            return []
        middle = median(ratios.values())
        slow = [name for name, ratio in ratios.items()
                if ratio > middle * median(self._usual.get(name) or [1.0]) * (1 + self.tolerance)]
        for name, ratio in ratios.items():
            if name not in slow:
                self._usual.setdefault(name, []).append(ratio / middle)
        return slow


class EngineSnapshot:
    """An engine's state between requests (its store's index and its policy), to run a
    request again from. Stored tensors are never mutated, so they are shared, not copied."""

    def __init__(self, engine):
        self._memo = {id(entry.payload): entry.payload for entry in engine.store.index.entries()}
        self._state = copy.deepcopy((engine.store.model, engine.policy, engine.num_requests), dict(self._memo))

    def restore(self, engine) -> None:
        engine.store.model, engine.policy, engine.num_requests = copy.deepcopy(self._state, dict(self._memo))


def median_attempt(attempts: list) -> object:
    """The attempt with the median end-to-end time (the lower middle of an even count)."""
    ordered = sorted(attempts, key=lambda r: r.e2e_s)
    return ordered[(len(ordered) - 1) // 2]
