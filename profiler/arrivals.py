"""Poisson arrival times, and requests resampled with their prefix families: the one
generator of which requests arrive and when. Imports no torch.

The profiler's workloads (``profiler.workloads``, on their own arrival stream) and the
simulator's schedules (``simulator.schedule``, on the generator that resampled the
requests) both draw their arrivals here, so a recorded workload and a replayed one at the
same rate and from the same generator state arrive at the same times. A serving
recording's resampled requests (``profiler.record --serve-resample``) and a replay's
(``--requests``) are drawn here alike, so the same seed draws the same requests.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

_ARRIVAL_STREAM = 3  # profiler.workloads' arrival stream: the same draws as a recorded workload's


def poisson_arrivals_s(count: int, rate_per_s: float | None, rng: np.random.Generator) -> list[float]:
    """Arrival times of ``count`` requests: the first at 0, then ``count - 1`` exponential
    gaps with mean ``1 / rate_per_s`` drawn from ``rng``; ``None`` puts every request at 0
    (all queued: a saturated server) and draws nothing. Raises ValueError for a rate that is
    not a positive finite number."""
    if rate_per_s is None:
        return [0.0] * count
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError(f"rate_per_s must be a positive number or None, got {rate_per_s}")
    # one draw per gap, all at once: the generator's state after the call depends on count only
    gaps = rng.exponential(1.0 / rate_per_s, size=max(count - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def parse_loads(text: str, what: str, integer: bool) -> tuple[float, ...]:
    """``0.5,1,inf`` (request rates) or ``1,2,4`` (concurrencies) as numbers; ValueError
    naming the option otherwise."""
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a number") from None
        if integer and not (math.isfinite(value) and value >= 1 and value == int(value)):
            raise ValueError(f"{what}: {part!r} must be a whole number >= 1")
        if not value > 0 or math.isnan(value):
            raise ValueError(f"{what}: {part!r} must be > 0 (or inf)")
        values.append(value)
    if not values:
        raise ValueError(f"{what}: no value given")
    return tuple(values)


def parse_seeds(text: str, what: str) -> tuple[int, ...]:
    """``0,1,2`` as distinct non-negative integers (numpy's seeds); ValueError naming the
    option otherwise."""
    wrong = ValueError(f"{what} takes non-negative integers, comma-separated (e.g. 0,1,2), got {text!r}")
    try:
        seeds = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise wrong from None
    if min(seeds) < 0:
        raise wrong
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"{what} lists a seed twice: {text!r}")
    return seeds


def seed_type(text: str) -> int:
    """argparse's ``type`` for one seed: a non-negative integer (``parse_seeds``)."""
    import argparse
    try:
        (seed,) = parse_seeds(text, "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    return seed


def arrivals_s(count: int, rate_per_s: float, seed: int) -> tuple[float, ...]:
    """Poisson arrival times: the first at 0, then exponential gaps of mean ``1 / rate``
    from the seed's arrival stream; ``inf``: all at 0. Every rate draws the same standard
    exponentials, so rate 2's times are rate 1's halved: load points differ in rate only."""
    if math.isinf(rate_per_s):
        return (0.0,) * count
    return tuple(poisson_arrivals_s(count, rate_per_s, np.random.default_rng((int(seed), _ARRIVAL_STREAM))))


def loads_type(what: str, integer: bool):
    """argparse's ``type`` for a list of loads (``parse_loads``) given to option ``what``."""
    import argparse

    def parse(text: str) -> tuple[float, ...]:
        try:
            return parse_loads(text, what, integer)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{what}: ")) from None  # argparse names it
    return parse


def resample_families(group_ids: Sequence[str], num_requests: int, rng: np.random.Generator) -> list[int]:
    """Indices of ``num_requests`` requests resampled with their prefix families: whole
    groups (a conversation, a prompt family; ``group_ids`` per request, a group's requests
    in turn order) drawn with replacement until N are reached, the last cut short, and the
    drawn groups' requests interleaved in a random order that keeps each group's turns in
    order. A group drawn twice repeats its prompts, as a popular prompt does."""
    groups: dict[str, list[int]] = {}
    for index, group in enumerate(group_ids):
        groups.setdefault(group, []).append(index)
    families = list(groups.values())
    drawn: list[list[int]] = []
    total = 0
    while total < num_requests:
        family = families[int(rng.integers(len(families)))][: num_requests - total]
        drawn.append(family)
        total += len(family)
    labels = np.repeat(np.arange(len(drawn)), [len(f) for f in drawn])
    rng.shuffle(labels)
    next_turn = [0] * len(drawn)
    order = []
    for g in labels.tolist():
        order.append(drawn[g][next_turn[g]])
        next_turn[g] += 1
    return order
