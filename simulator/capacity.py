"""A policy's capacity under an SLO: the highest Poisson arrival rate at which it keeps at
least a goal share of its requests within the SLO (DistServe's goodput, at its usual goal
of 90 %). Imports no torch.

Why beside the sweep's summed goodput (``simulator.sweep_summary.SweepSummary``): a sum over
a sweep's rates weighs every rate alike, and below the knee every policy serves nearly
every request, so those rates add about the same to every policy's sum and shrink the
margins between policies the more of them a sweep holds. Capacity is one rate per policy,
read where the policies part: how much more traffic a policy carries at the same SLO
attainment.

How: the sweep's replayed loads give each policy's attainment (its requests within the
SLO over its requests) at each rate. Its capacity lies between the last rate before its
attainment first falls below the goal and that rate (the first crossing), and is bisected
there by replaying the policy at rates between, until the bracket is within ``rel_tol``
of its lower end; the lower end, a rate replayed at the goal, is the capacity. Every rate
draws the same standard exponentials (``profiler.arrivals.arrivals_s``: a sweep's loads
differ in rate only), so attainment falls with the rate nearly monotonically; where it
does not, the first crossing is the one taken.

Invariants: a capacity is a rate at which the policy was replayed and met the goal, and
within its bracket's tolerance of one at which it did not; a policy that meets the goal at
every rate of the sweep has the highest as a lower bound (``beyond_sweep``); one below it
at the lowest has none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from profiler.serve_record import Load

DEFAULT_REL_TOL = 0.01  # a bracket this narrow, relative to its lower end, ends the bisection
BASELINES = ("ar", "kv-only")  # the fixed policies shown beside the best one


@dataclass(frozen=True)
class Capacity:
    """One policy's capacity: ``rate_per_s`` (None: below the goal at the sweep's lowest
    rate); ``beyond_sweep``: it met the goal at every rate, so the rate is the sweep's
    highest, a lower bound; ``num_replays``: the loads replayed to bisect it."""

    policy: str
    goal: float
    rate_per_s: float | None
    beyond_sweep: bool = False
    num_replays: int = 0


def attainment_goals(text: str) -> tuple[float, ...]:
    """``--attainment``'s comma list of goals (``0.9,0.95``): distinct shares in (0, 1];
    a one-line ValueError otherwise."""
    goals = []
    for part in text.split(","):
        try:
            goal = float(part)
        except ValueError:
            raise ValueError(f"--attainment: {part!r} is not a number") from None
        if not 0 < goal <= 1:
            raise ValueError(f"--attainment must be a share in (0, 1], e.g. 0.9; got {goal:g}")
        if goal in goals:
            raise ValueError(f"--attainment lists {goal:g} twice")
        goals.append(goal)
    return tuple(goals)


def check_attainment(slo, rates_per_s: Sequence[float | None]) -> None:
    """``--attainment`` beside the replay's ``slo`` and its loads' rates (None for a closed
    loop): a one-line ValueError unless an SLO is stated and the loads are two or more
    finite rates."""
    if slo is None or not slo.stated:
        raise ValueError("--attainment needs an --slo: the bounds a request must meet to count")
    if len(rates_per_s) < 2 or any(rate is None or rate == float("inf") for rate in rates_per_s):
        raise ValueError("--attainment needs a sweep of two or more finite --arrival-rate values, the rates its "
                         "capacities are bisected between (not --concurrency)")


def attainment_points(results: Iterable) -> dict[str, list[tuple[float, float]]]:
    """Per policy, (rate, attainment) of its open-loop results (``LoadResult``s under an
    SLO), by rate."""
    points: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        rate = Load.of_label(r.load).rate_per_s
        if rate is not None and r.num_meeting_slo is not None and r.num_requests:
            points.setdefault(r.policy, []).append((rate, r.num_meeting_slo / r.num_requests))
    return {policy: sorted(found) for policy, found in points.items()}


def first_crossing(points: Sequence[tuple[float, float]], goal: float) -> tuple[float, float] | None:
    """(the last rate at the goal, the first rate below it) of ``points`` by rate; None
    where the first rate is already below it; (highest, inf) where none is."""
    if points[0][1] < goal:
        return None
    for (low, _), (high, attained) in zip(points, points[1:]):
        if attained < goal:
            return low, high
    return points[-1][0], float("inf")


def bisect_capacity(attainment_at: Callable[[float], float], low: float, high: float, goal: float,
                    rel_tol: float = DEFAULT_REL_TOL) -> tuple[float, int]:
    """(the highest rate found at the goal, the replays it took), bisecting [low, high]
    where ``attainment_at(low) >= goal > attainment_at(high)``."""
    num_replays = 0
    while high - low > rel_tol * low:
        middle = 0.5 * (low + high)
        num_replays += 1
        if attainment_at(middle) >= goal:
            low = middle
        else:
            high = middle
    return low, num_replays


def sweep_capacities(results: Iterable, goal: float,
                     attainment_at: Callable[[str, float], float],
                     rel_tol: float = DEFAULT_REL_TOL, done: Callable[[], object] | None = None) -> list[Capacity]:
    """Each policy's capacity from a sweep's ``LoadResult``s, in their policy order,
    bisected with ``attainment_at(policy, rate)`` (a fresh replay); ``done()`` after each
    policy's (a progress bar's update)."""
    capacities = []
    for policy, found in attainment_points(results).items():
        bracket = first_crossing(found, goal)
        if bracket is None:
            capacities.append(Capacity(policy, goal, None))
        elif bracket[1] == float("inf"):
            capacities.append(Capacity(policy, goal, bracket[0], beyond_sweep=True))
        else:
            rate, num_replays = bisect_capacity(lambda r: attainment_at(policy, r), *bracket, goal, rel_tol)
            capacities.append(Capacity(policy, goal, rate, num_replays=num_replays))
        if done is not None:
            done()
    return capacities


def capacity_lines(capacities: list[Capacity], fixed: frozenset[str], references: frozenset[str]) -> list[str]:
    """The capacities as the sweep's summary prints them, a line per goal: the best fixed
    policy's, then each other policy's against it."""
    goals = dict.fromkeys(c.goal for c in capacities)
    return [_goal_line([c for c in capacities if c.goal == goal], fixed, references) for goal in goals]


def _goal_line(capacities: list[Capacity], fixed: frozenset[str], references: frozenset[str]) -> str:
    """``capacity_lines``'s line for one goal's capacities."""

    def text(c: Capacity) -> str:
        if c.rate_per_s is None:
            return "below the goal at every rate"
        return f"{'at least ' if c.beyond_sweep else ''}{c.rate_per_s:.3f}"
    fixed_found = [c for c in capacities if c.policy in fixed and c.rate_per_s is not None]
    goal = capacities[0].goal
    head = (f"Capacity, the highest Poisson rate (req/s) keeping at least {100 * goal:g} % of the requests within "
            f"the SLO (bisected between the sweep's rates to {100 * DEFAULT_REL_TOL:g} %)")
    if not fixed_found:
        return f"{head}: " + "; ".join(f"{c.policy} {text(c)}" for c in capacities)
    best = max(fixed_found, key=lambda c: c.rate_per_s)
    others = []
    for c in capacities:
        if c is best or c.policy in fixed and c.policy not in BASELINES:
            continue
        over = ""
        if c.rate_per_s is not None and not best.beyond_sweep:  # a lower bound's margin is one too
            over = f" ({'at least ' if c.beyond_sweep else ''}{100 * (c.rate_per_s / best.rate_per_s - 1):+.1f} %)"
        others.append(f"{c.policy}{' (a reference)' if c.policy in references else ''} {text(c)}{over}")
    return f"{head}: the best fixed policy {best.policy} {text(best)}" + "".join(f"; {o}" for o in others)
