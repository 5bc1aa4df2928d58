"""What a round costs the step it joins: the round planners' prices under load. Imports no torch.

At batch 1 a round drafting k tokens is priced alone: its seconds
(``round_planner.RoundCosts``) against the tokens it is expected to make, E_k. In a
batched step (``rakv.scheduler``) the other requests' rows share the target forward,
whose Linear layers stream the weights once for all the rows, so a round costs what its
k extra rows add on top of theirs; and every second it adds delays the others' tokens too.
So a planner under load compares the step's tokens per second (SmartSpec's goodput):

    (N + E_k) / (T + D_k)    against a plain step's    (N + 1 + g) / T,

N the tokens the step's other requests make (one each, a plain step's), T the step with
this request's one row, D_k what the round's k more rows and its proposal add, and g the
planner's ``min_gain``. With no other request (N = 0) that is the batch-1 rule, and the
planners then take their batch-1 prices unchanged. So a round whose rows are nearly free
(a few requests, the weights' stream not yet outgrown) still pays, and k = 0 wins once
rows cost what the others' tokens are worth.

D_k: the target's rows curve (``ModelTimings.rows_extra_s``) at the others' rows + 1 + k
against + 1; for prompt lookup one lookup; for the draft model, per drafted position j, a
whole draft step where no other round planned so far drafts a (j+1)-th token, else the one
row it adds to that batched draft forward. T holds the other rounds' draft forwards so
far. Left out: prefill chunks (the scheduler plans them after the rounds, from the rows
the rounds leave), the attention's growth with the extra rows, and the step's overheads.
Every price is at the request's own context (``RoundCosts.num_context``).

With an ITL target (``rakv.scheduler``'s "Pace") the step also carries the other
requests' pace bounds, and a round keeps within the tightest that a plain step keeps
(``longest_within``); the pace's clock is ``step_price_s``, the same prices over a whole
step's works.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Sequence

from rakv.cost_model import ModelTimings, PairTimings
from rakv.drafters import DRAFT_MODEL, MODEL_FREE

# a step's works' kinds (``rakv.scheduler.Work``): a prefill chunk, one decode row, a round's verification
PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"


@dataclass  # not frozen: built for every round the scheduler plans, and a frozen init costs 4x
class StepLoad:
    """The rest of a step, as the scheduler sees it when it plans one request's round."""

    num_others: int  # other requests decoding in the step: each makes at least one token
    num_other_rows: int  # their target rows: the rounds planned so far, one for each not yet planned
    draft_depths: tuple[int, ...] = ()  # [j]: other rounds planned so far whose draft model drafts a (j+1)-th token
    # the longest step that keeps each other decoding request on the ITL target's pace,
    # ascending (``rakv.scheduler``'s "Pace"; () without a target)
    pace_bounds_s: tuple[float, ...] = ()
    # where the step also prefills another request (whose first token waits on it): the
    # positions this request's draft model would catch up before drafting; 0 otherwise
    catch_up_beside_prefill: int = 0


ALONE = StepLoad(0, 0)


def deepen(depths: list[int], k: int) -> None:
    """``StepLoad.draft_depths`` once a draft-model round drafting k tokens joins them."""
    depths[:k] = [n + 1 for n in depths[:k]] + [1] * (k - len(depths))


def step_price_s(step, timings: PairTimings) -> float:
    """A step's seconds as ``load_prices`` prices its parts: the target's step at the
    longest context the step reaches, its rounds' rows over one, each prefill chunk's
    tokens (``ModelTimings.chunk_s``: the rows curve, measured up to a round's rows and
    extended to a chunk's, priced steps with chunks 20-24 % above what they took, the
    prefill's own line 6-11 %; plain steps 9-40 %: ``bench.step_price``), and the draft
    model's forwards (the j-th over the rounds that drafted a j-th token; each a step
    with its rows over one). ``step``: what it ran (a ``rakv.scheduler.Composition``);
    no work, no time."""
    if not step.rows:
        return 0.0
    target, draft = timings.target, timings.draft
    depths: list[int] = []  # [j]: draft-model rounds that drafted a (j+1)-th token
    num_round_rows, chunks_s = 0, 0.0
    for kind, rows, num_cached, drafter, k in zip(step.kinds, step.rows, step.num_cached, step.drafters, step.ks):
        if kind == PREFILL:
            chunks_s += target.chunk_s(rows, num_cached)
            continue
        num_round_rows += rows
        if drafter == DRAFT_MODEL and k:
            deepen(depths, rows - 1)  # what it proposed: a round may stop short of its k
    num_context = max(n + rows for n, rows in zip(step.num_cached, step.rows))
    price_s = target.step_s(num_context) + target.rows_extra_s(num_round_rows) + chunks_s
    if depths and draft is not None:
        price_s += sum(draft.step_s(num_context) + draft.rows_extra_s(n) for n in depths)
    return price_s


def pricer(timings: PairTimings | None):
    """``step_price_s`` with ``timings``, as ``rakv.scheduler.Scheduler.price_s`` takes
    it; None without timings."""
    return None if timings is None else partial(step_price_s, timings=timings)


def longest_within(costs_s: Sequence[float], top: int, bounds_s: tuple[float, ...]) -> int:
    """The largest k <= ``top`` whose round, priced ``costs_s[k]`` (increasing in k; k = 0
    a plain step), stays within the tightest of ``bounds_s`` (ascending) that a plain step
    keeps: a request that falls behind its pace whatever this round does does not bound
    it. ``top`` where no bound applies, 0 where even k = 1 exceeds it."""
    for bound_s in bounds_s:
        if bound_s >= costs_s[0]:
            return bisect_right(costs_s, bound_s, 1, top + 1) - 1
    return top


@dataclass(frozen=True)
class LoadPrices:
    """A round's prices in a step under ``StepLoad``: rate_k = (offset + E_k) / costs_s[drafter][k]."""

    offset: float  # N: the others' tokens
    base_s: float  # T: the step with this request's one row
    costs_s: dict[str, tuple[float, ...]]  # per drafter, T + D_k for k = 0..max_k

    def plain_rate(self, min_gain: float) -> float:
        """The rate a round must beat: a plain step's, (N + 1 + g) / T."""
        return (self.offset + 1.0 + min_gain) / self.base_s


@lru_cache(maxsize=4096)
def _rows_added_s(model: ModelTimings, num_rows: int, max_k: int) -> tuple[float, ...]:
    """What k more rows add to a forward of ``num_rows`` rows, k = 0..max_k."""
    base = model.rows_extra_s(num_rows)
    return tuple(model.rows_extra_s(num_rows + k) - base for k in range(max_k + 1))


@lru_cache(maxsize=4096)
def _draft_added(model: ModelTimings, depths: tuple[int, ...], max_k: int) -> tuple[tuple[int, ...],
                                                                                   tuple[float, ...], float]:
    """For a draft-model round of k = 0..max_k beside the planned ``depths``: the draft
    forwards it runs alone, and the seconds its rows add to the others'; and the others'
    forwards' seconds over their one-row steps."""
    alone, rows_s = [0], [0.0]
    for j in range(max_k):
        others = depths[j] if j < len(depths) else 0
        alone.append(alone[-1] + (others == 0))
        rows_s.append(rows_s[-1] + (model.rows_extra_s(others + 1) - model.rows_extra_s(others) if others else 0.0))
    return tuple(alone), tuple(rows_s), sum(model.rows_extra_s(n) for n in depths if n)


def load_prices(load: StepLoad, timings: PairTimings, drafters: tuple[str, ...], max_k: int,
                num_context: int) -> LoadPrices:
    """The prices of every ``drafter``'s rounds, k = 0..max_k, in a step under ``load``."""
    target = timings.target
    rows = load.num_other_rows + 1
    added = _rows_added_s(target, rows, max_k)
    base_s = target.step_s(num_context) + target.rows_extra_s(rows)
    draft_step_s = timings.draft.step_s(num_context) if timings.draft is not None else 0.0
    if load.draft_depths and timings.draft is not None:
        _, _, others_s = _draft_added(timings.draft, load.draft_depths, max_k)
        base_s += sum(1 for n in load.draft_depths if n) * draft_step_s + others_s
    costs: dict[str, tuple[float, ...]] = {}
    model_free = None  # the model-free drafters' rounds, priced alike: computed once for all of them
    for drafter in drafters:
        if drafter in MODEL_FREE:
            if model_free is None:
                model_free = (base_s,) + tuple(base_s + a + timings.ngram_lookup_s for a in added[1:])
            costs[drafter] = model_free
        elif drafter == DRAFT_MODEL:
            alone, rows_s, _ = _draft_added(timings.draft, load.draft_depths, max_k)
            costs[drafter] = tuple(base_s + a + n * draft_step_s + r for a, n, r in zip(added, alone, rows_s))
    return LoadPrices(float(load.num_others), base_s, costs)
