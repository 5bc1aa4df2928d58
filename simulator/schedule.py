"""Which recorded requests a replay serves, and when they arrive. Imports no torch.

- As recorded: the trace's requests in order, at their recorded arrival times.
- ``num_requests``: the trace's requests resampled with their prefix families: whole
  groups (a conversation, a prompt family) are drawn with replacement, seeded, until N
  requests are reached (the last group cut short), and the drawn groups' requests are
  interleaved in a seeded order that keeps each group's turns in order. A group drawn
  twice repeats its prompts, as a popular prompt does: the store sees exact repeats.
- ``arrival_rate_per_s``: Poisson arrivals at that rate, in serving order
  (``profiler.arrivals``, drawn after the resampling from the same seeded generator);
  without it, a resampled workload takes the trace's own mean rate, or all requests at 0
  when the trace recorded none (every request queued: a saturated server).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from profiler.arrivals import poisson_arrivals_s
from simulator.trace import RecordedRequest, Trace


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    request: RecordedRequest


class ScheduleError(ValueError):
    """A schedule that cannot be built; the message is one line."""


def _groups(trace: Trace) -> list[list[RecordedRequest]]:
    groups: dict[str, list[RecordedRequest]] = {}
    for request in trace.requests:
        groups.setdefault(request.group_id, []).append(request)
    return list(groups.values())


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
        requests = _resample(_groups(trace), num_requests, rng)
        if arrival_rate_per_s is None:
            arrival_rate_per_s = mean_rate_per_s(trace)
    return [Arrival(t, r) for t, r in zip(poisson_arrivals_s(len(requests), arrival_rate_per_s, rng), requests)]


def _resample(groups: list[list[RecordedRequest]], num_requests: int, rng: np.random.Generator) -> list[RecordedRequest]:
    drawn: list[list[RecordedRequest]] = []
    total = 0
    while total < num_requests:
        group = groups[int(rng.integers(len(groups)))][: num_requests - total]
        drawn.append(group)
        total += len(group)
    labels = np.repeat(np.arange(len(drawn)), [len(g) for g in drawn])
    rng.shuffle(labels)
    next_turn = [0] * len(drawn)
    order = []
    for g in labels.tolist():
        order.append(drawn[g][next_turn[g]])
        next_turn[g] += 1
    return order
