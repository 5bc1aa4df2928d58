"""A sweep's policies set against each other: per load the best fixed policy, and over the
sweep each policy's goodput summed against the best single fixed policy's. Imports no torch.

- Per load, the best fixed policy (``rakv.choices``) by goodput, or by tok/s without an
  SLO, is marked (``mark_best_fixed``): what a policy that adapts must beat.
- Over a sweep of several loads under an SLO (``SweepSummary``): each policy's goodput
  summed over the loads against the best single fixed policy's, the same sum for the best
  of all the policies at each load chosen in hindsight (the envelope of what was
  replayed), and the loads where an adaptive policy kept fewer requests within the SLO
  than ``kv-only`` (``Shortfall``). References stand apart from the policies:
  ``foresight`` (``simulator.foresight``: ``rakv`` knowing each round's outcome) and the
  causal bound (``simulator.causal_bound``: ``rakv`` tuned in hindsight) where they were
  replayed, each with the share of its gain over the best fixed policy each adaptive
  policy reaches; and, over open loops, the ceiling no policy can pass: every request
  within the SLO, each load's requests over its arrivals' span (a load's span runs from
  its first arrival to its last finish, so it is never shorter).

A sum over a sweep weighs every rate alike, so its margins depend on the rates the sweep
holds; ``simulator.capacity`` reads one rate per policy instead.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from rakv.choices import fixed_policy_names
from simulator.causal_bound import MEANING as CAUSAL_MEANING, NAME as CAUSAL
from simulator.foresight import MEANING as FORESIGHT_MEANING, NAME as FORESIGHT
from simulator.load_result import LoadResult

FIXED = frozenset(fixed_policy_names(True))
MEANINGS = {FORESIGHT: FORESIGHT_MEANING, CAUSAL: CAUSAL_MEANING}  # per reference, as the outputs name it
REFERENCES = frozenset(MEANINGS)  # replayed beside the policies, never one of them


def _score(result: LoadResult) -> tuple[float, ...]:
    if result.goodput_per_s is None:
        return (result.output_tok_per_s,)
    return result.goodput_per_s, result.output_tok_per_s


def mark_best_fixed(results: list[LoadResult]) -> list[LoadResult]:
    """``results`` with, per load, the fixed policy of the highest goodput (then tok/s;
    tok/s alone without an SLO) marked; the first listed wins a tie."""
    best: dict[str, LoadResult] = {}
    for r in results:
        if r.policy in FIXED and (r.load not in best or _score(r) > _score(best[r.load])):
            best[r.load] = r
    return [replace(r, best_fixed=True) if best.get(r.load) is r else r for r in results]


@dataclass(frozen=True)
class Shortfall:
    """A load where an adaptive policy kept fewer requests within the SLO than ``kv-only``."""

    load: str
    num_meeting_slo: int
    kv_only_meeting_slo: int
    num_requests: int


@dataclass(frozen=True)
class SweepSummary:
    """Goodput summed over a sweep's loads (req/s), per policy in the order replayed."""

    num_loads: int
    goodput_per_s: dict[str, float]
    best_fixed: str  # the fixed policy of the highest sum
    envelope_per_s: float  # at each load the best policy's goodput, in hindsight, summed
    below_kv_only: dict[str, tuple[Shortfall, ...]]  # per adaptive policy, the loads where it met the SLO less often
    references_per_s: dict[str, float]  # per reference replayed (``REFERENCES``), as ``goodput_per_s``
    # every request of every load within the SLO over its arrivals' span, summed: above any
    # policy's sum; None where a load is a closed loop (its arrivals follow the policy)
    ceiling_per_s: float | None

    def over_best_fixed(self, goodput_per_s: float) -> float | None:
        """The margin over the best single fixed policy's sum; None where no fixed policy
        kept a request within the SLO."""
        best = self.goodput_per_s[self.best_fixed]
        return goodput_per_s / best - 1.0 if best > 0 else None

    def shares_of(self, reference_per_s: float, names: list[str]) -> list[tuple[str, float]]:
        """Per policy of ``names``, the share of a reference's gain over the best fixed
        policy that it reaches; none where the reference gains nothing."""
        gain = reference_per_s - self.goodput_per_s[self.best_fixed]
        if gain <= 0:
            return []
        return [(name, (self.goodput_per_s[name] - self.goodput_per_s[self.best_fixed]) / gain) for name in names]


def sweep_summary(results: list[LoadResult]) -> SweepSummary | None:
    """The sweep's summary; None for one load, without an SLO or without a fixed policy."""
    loads = list(dict.fromkeys(r.load for r in results))
    if len(loads) < 2 or any(r.goodput_per_s is None for r in results):
        return None
    totals: dict[str, float] = defaultdict(float)
    best_at: dict[str, float] = defaultdict(float)
    ceiling_at: dict[str, float] = {}
    for r in results:
        totals[r.policy] += r.goodput_per_s
        if r.policy not in REFERENCES:
            best_at[r.load] = max(best_at[r.load], r.goodput_per_s)
        if r.arrivals_span_s > 0:
            ceiling_at[r.load] = r.num_requests / r.arrivals_span_s
    open_loops = all(load.startswith("rate=") for load in loads) and len(ceiling_at) == len(loads)
    fixed = [name for name in totals if name in FIXED]
    if not fixed:
        return None
    kv_only = {r.load: r.num_meeting_slo for r in results if r.policy == "kv-only"}
    below: dict[str, list[Shortfall]] = defaultdict(list)
    for r in results:
        if r.policy not in FIXED | REFERENCES and r.load in kv_only and r.num_meeting_slo < kv_only[r.load]:
            below[r.policy].append(Shortfall(r.load, r.num_meeting_slo, kv_only[r.load], r.num_requests))
    references = {name: totals.pop(name) for name in list(totals) if name in REFERENCES}
    return SweepSummary(len(loads), dict(totals), max(fixed, key=totals.__getitem__), sum(best_at.values()),
                        {name: tuple(found) for name, found in below.items()}, references,
                        sum(ceiling_at.values()) if open_loops else None)


def summary_lines(summary: SweepSummary) -> list[str]:
    best = summary.best_fixed
    adaptive = [name for name in summary.goodput_per_s if name not in FIXED]

    def over(per_s: float) -> str:
        margin = summary.over_best_fixed(per_s)
        return "no fixed policy within the SLO" if margin is None else f"{100 * margin:+.1f} %"
    policies = "".join(f"; {name} {summary.goodput_per_s[name]:.3f} ({over(summary.goodput_per_s[name])})"
                       for name in adaptive)
    envelope = summary.envelope_per_s
    lines = [f"Over the sweep, goodput summed over its {summary.num_loads} loads (req/s): the best single fixed "
             f"policy {best} {summary.goodput_per_s[best]:.3f}{policies}; the best of the policies replayed at "
             f"each load, in hindsight, {envelope:.3f} ({over(envelope)})"]
    if "kv-only" in summary.goodput_per_s and adaptive:
        below = "; ".join(f"{name} at " + ", ".join(f"{s.load} ({s.num_meeting_slo} of {s.num_requests} against "
                                                    f"{s.kv_only_meeting_slo})" for s in summary.below_kv_only[name])
                          for name in adaptive if summary.below_kv_only.get(name))
        lines.append(f"Adaptive policies within the SLO less often than kv-only: {below or 'none'}")
    references = [f"{name} ({MEANINGS[name]}) {per_s:.3f} ({over(per_s)}"
                  + "".join(f"; {a} {100 * s:.0f} % of its gain" for a, s in summary.shares_of(per_s, adaptive))
                  + ")" for name, per_s in summary.references_per_s.items()]
    if summary.ceiling_per_s is not None:
        references.append(f"every request within the SLO, each load's requests over its arrivals' span (no policy "
                          f"passes it) {summary.ceiling_per_s:.3f} ({over(summary.ceiling_per_s)})")
    if references:
        lines.append(f"References, not policies: {'; '.join(references)}")
    return lines
