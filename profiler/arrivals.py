"""Poisson arrival times: the one generator of when requests arrive. Imports no torch.

The profiler's workloads (``profiler.workloads``, on their own arrival stream) and the
simulator's schedules (``simulator.schedule``, on the generator that resampled the
requests) both draw their arrivals here, so a recorded workload and a replayed one at the
same rate and from the same generator state arrive at the same times.
"""
from __future__ import annotations

import math

import numpy as np


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
