"""The causal bound: what a round planner that sees only what is known when it plans (the
signals at each round's start, the request's own outcomes so far, and the draft model's
probabilities as it drafts) reaches on a set of requests, with its rules tuned in
hindsight on those very requests. Imports no torch.

The round oracle bounds every planner, but with foresight: it knows each round's run
length before it drafts, so it never drafts a token the target rejects, which no planner
can know. Against it a planner's share of the headroom mixes what it misses with what no
planner could see (``docs/results.md`` section 8: on Qwen code even a stop that ends every
draft-model round right after its first wrong token reaches half the round oracle's gap).
This bound is reachable by a causal planner: ``rakv``'s adaptive rounds with the settings
that do best on the requests themselves, the best of a grid. Tuned on the requests it is
scored on, it is optimistic for a planner tuned elsewhere (as the learned policy is, on
other families or seeds): an upper reference for ``rakv``-like planners, not a bound on
every causal planner.

- At batch 1 (``GRID``, ``policy.evaluate``): the draft model's confidence stop (a round
  ends after a token it gives less than this probability,
  ``PlannerConfig.draft_confidence``), the longest round (``max_k``) and the gain a round
  must promise over a plain step (``min_gain``), scored by tokens per second.
- Under load (``LOAD_GRID``, ``simulator.replay --policy causal-bound``): the longest
  round, the gain, and how fast a request's estimates follow its outcomes (``recency``),
  scored by the goodput summed over the sweep's loads, the trainer's objective. Replayed
  on this CPU under load the draft model rarely drafts, so its stop is left out; the
  longest round moved the chat knee's best capacity by 13 % (4 to 16) and ``recency`` by
  up to 5 % (``docs/results.md`` section 37). Its settings are the controller's alone, so
  the bound is ``rakv``'s policy under them, on the replay's store and drafters.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

from rakv.settings import Settings, override

NAME = "causal-bound"  # the reference under load, as the replay's outputs name it
MEANING = "rakv under the settings that serve this sweep best, tuned in hindsight"

# the stop rule and threshold searched at batch 1 (draft_confidence 0: proposals always run to max_k)
GRID = {"planner.draft_confidence": (0.0, 0.2, 0.4, 0.6, 0.8),
        "planner.max_k": (4, 8, 16),
        "planner.min_gain": (0.0, 0.05, 0.1, 0.2)}
# under load: how long rounds run, what they must promise, how fast estimates move
LOAD_GRID = {"planner.max_k": (4, 8, 16),
             "planner.min_gain": (0.0, 0.05, 0.1, 0.2),
             "planner.recency": (0.05, 0.1, 0.3)}


@dataclass(frozen=True)
class CausalBound:
    score: float  # the best score over the grid (tokens per second; under load, summed goodput)
    assignments: tuple[str, ...]  # its settings, as ``--set`` takes them (none: the base's)
    num_tried: int


def num_settings(grid: Mapping[str, tuple]) -> int:
    """The settings ``grid`` holds."""
    return math.prod(len(values) for values in grid.values())


def tuned(base: Settings, assignments: tuple[str, ...]) -> Settings:
    """``base`` with ``assignments`` (``CausalBound.assignments``) applied."""
    for assignment in assignments:
        base = override(base, assignment)
    return base


def causal_bound(score_under: Callable[[Settings], float], base: Settings = Settings(),
                 base_score: float | None = None, grid: Mapping[str, tuple] = GRID,
                 done: Callable[[], object] | None = None) -> CausalBound:
    """The best ``score_under(settings)`` (``rakv`` replayed under them) over ``base``
    itself (no assignments: so the bound is ``rakv`` at the least) and ``grid`` applied to
    it; ties go to the first tried. ``base_score``: ``score_under(base)`` where the caller
    has it already; the grid's point equal to ``base`` reuses it too. ``done``: called
    after each setting scored (a progress bar's update)."""
    base_score = score_under(base) if base_score is None else base_score
    best, best_assignments, tried = base_score, (), 1
    for values in itertools.product(*grid.values()):
        assignments = tuple(f"{key}={value}" for key, value in zip(grid, values))
        settings = tuned(base, assignments)
        score = base_score if settings == base else score_under(settings)
        tried += 1
        if score > best:
            best, best_assignments = score, assignments
        if done is not None:
            done()
    return CausalBound(best, best_assignments, tried)
