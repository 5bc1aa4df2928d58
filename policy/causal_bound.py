"""The causal bound: what a round planner that sees only what is known when it plans (the
signals at each round's start, the request's own outcomes so far, and the draft model's
probabilities as it drafts) reaches on a set of requests, with its rules tuned in
hindsight on those very requests. Imports no torch.

The round oracle bounds every planner, but with foresight: it knows each round's run
length before it drafts, so it never drafts a token the target rejects, which no planner
can know. Against it a planner's share of the headroom mixes what it misses with what no
planner could see (``docs/results.md`` section 8: on Qwen code even a stop that ends every
draft-model round right after its first wrong token reaches half the round oracle's gap).
This bound is reachable by a causal planner: ``rakv``'s adaptive rounds with the stop rule
and the speculation threshold that do best on the requests themselves, the best of
``GRID``: the draft model's confidence stop (a round ends after a token it gives less
than this probability, ``PlannerConfig.draft_confidence``), the longest round
(``max_k``) and the gain a round must promise over a plain step (``min_gain``). Tuned on
the requests it is scored on, it is optimistic for a planner tuned elsewhere (as the
learned policy is, on other families): an upper reference for ``rakv``-like planners,
not a bound on every causal planner.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from rakv.settings import Settings, override

# the stop rule and threshold searched (draft_confidence 0: proposals always run to max_k)
GRID = {"planner.draft_confidence": (0.0, 0.2, 0.4, 0.6, 0.8),
        "planner.max_k": (4, 8, 16),
        "planner.min_gain": (0.0, 0.05, 0.1, 0.2)}


@dataclass(frozen=True)
class CausalBound:
    tokens_per_s: float  # the best rate over the grid
    assignments: tuple[str, ...]  # its settings, as ``--set`` takes them (none: the base's)
    num_tried: int


def causal_bound(rate_under: Callable[[Settings], float], base: Settings = Settings(),
                 base_rate: float | None = None) -> CausalBound:
    """The best ``rate_under(settings)`` (tokens per second of ``rakv`` replayed under
    them) over ``base`` itself (no assignments: so the bound is ``rakv`` at the least) and
    ``GRID`` applied to it; ties go to the first tried. ``base_rate``: ``rate_under(base)``
    where the caller has it already; the grid's point equal to ``base`` reuses it too."""
    base_rate = rate_under(base) if base_rate is None else base_rate
    best, best_assignments, tried = base_rate, (), 1
    for values in itertools.product(*GRID.values()):
        assignments = tuple(f"{key}={value}" for key, value in zip(GRID, values))
        settings = base
        for assignment in assignments:
            settings = override(settings, assignment)
        rate = base_rate if settings == base else rate_under(settings)
        tried += 1
        if rate > best:
            best, best_assignments = rate, assignments
    return CausalBound(best, best_assignments, tried)
