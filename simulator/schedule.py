"""Which recorded requests a replay serves, and when they arrive. Imports no torch.

- As recorded: the trace's requests in order, at their recorded arrival times.
- ``num_requests``: the trace's requests resampled with their prefix families, whole
  conversations drawn with replacement (``profiler.arrivals.resample_families``, the draw
  a serving recording's ``--serve-resample`` makes too): a group drawn twice repeats its
  prompts, as a popular prompt does, so the store sees exact repeats.
- ``arrival_rate_per_s``: Poisson arrivals at that rate, in serving order
  (``profiler.arrivals``, drawn after the resampling from the same seeded generator);
  without it, a resampled workload takes the trace's own mean rate, or all requests at 0
  when the trace recorded none (every request queued: a saturated server).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from profiler.arrivals import poisson_arrivals_s, resample_families
from simulator.trace import RecordedRequest, Trace


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    request: RecordedRequest


class ScheduleError(ValueError):
    """A schedule that cannot be built; the message is one line."""


def mean_rate_per_s(trace: Trace) -> float | None:
    """The recorded arrivals' mean rate, or None when they all arrived together."""
    arrivals = [r.arrival_s for r in trace.requests]
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if span > 0 else None


def schedule(trace: Trace, num_requests: int | None = None, arrival_rate_per_s: float | None = None,
             seed: int = 0) -> list[Arrival]:
    """The requests to serve, in arrival order (see the module docstring)."""
    if num_requests is not None and num_requests < 1:
        raise ScheduleError(f"--requests must be at least 1, got {num_requests}")
    if arrival_rate_per_s is not None and not (arrival_rate_per_s > 0 and math.isfinite(arrival_rate_per_s)):
        raise ScheduleError(f"--arrival-rate must be a positive number, got {arrival_rate_per_s}")
    rng = np.random.default_rng(seed)
    if num_requests is None:
        requests = list(trace.requests)
        if arrival_rate_per_s is None:
            return [Arrival(r.arrival_s, r) for r in requests]
    else:
        requests = [trace.requests[i]
                    for i in resample_families([r.group_id for r in trace.requests], num_requests, rng)]
        if arrival_rate_per_s is None:
            arrival_rate_per_s = mean_rate_per_s(trace)
    return [Arrival(t, r) for t, r in zip(poisson_arrivals_s(len(requests), arrival_rate_per_s, rng), requests)]
