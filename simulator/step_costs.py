"""What a batched step costs: a model of the batching engine's step from a serving trace's
op grid, its overheads fitted on recorded steps. Imports no torch.

A step (``simulator.batch_replay.Composition``) runs the draft model's proposals for the
rounds that draft with it, then one target forward over every work's rows. A forward's
Linear layers stream the weights once whatever the rows, then cost per row once the rows
outgrow the stream, and its attention costs per row and cached token. So a forward over
works of r_i rows after c_i cached positions costs

    rows(R) + per_request(L / b, b) * (b - 1) + per_position * sum_i r_i c_i,    R = sum_i r_i,

over b works computing L logits rows (every row of a decode or a verification, one at
most of a prefill chunk, one per request of a draft forward): ``rows`` a curve over the
total rows through the op grid's one-request points at its smallest context (``1 x r``
batched points, and one request's chunks and prefills of n tokens on an empty cache where
no batched point has n rows), ``per_request`` what each further request adds to ``rows``
of their total, a surface through the batched points of b > 1 requests of r rows each,
linear between them in rows and in requests, read at the mean logits rows each and held
at the grid's most beyond it. Past the ``1 x r`` points the rows curve runs through
chunks and prefills, which compute one logits row, where a step's decodes and
verifications compute one per row (Qwen's 151,936-word head: about 3 ms a row on a Zen 3
core): so a further request costs more the more logits rows it brings (Qwen int4, 8
requests: 3 ms each at one row, 15 ms at five), and one median of it overpriced plain
steps and underpriced verifications by 5-13 %. ``per_position`` the median of what the
grid's largest context adds per row and cached position. The draft model's proposals are
its own forwards, priced alike by the draft's points: the first over each drafting
request's rows its draft cache lacks (its catch-up: the tokens since its last round, the
whole prompt at its first; one row where not given), the j-th after it over one row of
each request whose proposal is longer than j (a round's proposal is its verification's
rows less one). What the points do not see is
``StepOverhead``: the logits rows no point holds (a chunk computes one, so a verification
of 17 rows after the 16-row chunk point brings 16 the rows curve lacks; a further request
is priced by points of at most 5 rows each: ``ForwardCosts.unpriced_logits``), at the
median excess per such row of the recorded forwards of the steps that have them; what a
prompt row costs in a step beyond the grid's prefill of as many rows alone (the median
excess per prompt row of the recorded forwards of the steps that prefill); then (Python
per step and per work) a + b per work, fitted on recorded steps by least relative error;
all never negative.

Each served load at its speed: the recorder probes the machine (one forward of one token
of the target, ``profiler.run_noise.MachineSpeed``) just before each load, after waiting
out a slow phase, and just after it; every step of the load holds the mean
(``StepRow.probe_s``, schema 1.5). ``serve_validate`` fits the overheads on the steps'
seconds at the loads' usual speed (each scaled by the loads' median probe over its own:
``load_speeds``) and prices each load at its own (``StepCosts.speed``), scaled whole, as
the batch-1 validation prices runs (``simulator.costs.at_usual_speed``): a batched step
streams the weights, as the probe does. Over three ShareGPT recordings past the knee
(24 loads) each load's time error had followed its probe with slopes of -0.29, -0.64 and
-0.90 (docs/results.md section 32). A trace without probes is priced as timed.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from statistics import median
from typing import Sequence

from profiler.schema import StepRow
from rakv.drafters import DRAFT_MODEL
from rakv.op_timing import OpRow
from rakv.scheduler import PREFILL, VERIFY
from simulator.costs import CostModelError, Curve, Surface, least_relative_error, surface


@dataclass(frozen=True)
class ForwardCosts:
    """One model's batched forward: ``rows`` over the total rows, ``per_request`` for each
    further request by the mean logits rows each, and ``per_position`` seconds per row and
    cached position."""

    rows: Curve
    per_request: Surface | None  # (logits rows each, requests) -> seconds; None: one-request grid only
    max_rows_each: float  # the grid's most rows each: per_request is held there beyond it
    per_position: float
    logits_rows: Curve | None = None  # total rows -> the logits rows ``rows`` holds there (None: every row's)

    def unpriced_logits(self, num_works: int, total: int, num_logits: int) -> float:
        """Of a forward's ``num_logits`` logits rows, those its price leaves out: ``rows``
        holds a logits row for each of its points' (every row of a batched point, one of a
        chunk or a prefill), and each further request's cost those of up to
        ``max_rows_each`` rows."""
        if self.logits_rows is None:
            return 0.0
        priced = self.logits_rows(total)
        if num_works > 1 and self.per_request is not None:
            priced = max(priced, min(num_logits, num_works * self.max_rows_each))
        return max(num_logits - priced, 0.0)

    def seconds(self, works: Sequence[tuple[int, int]], num_logits: int | None = None) -> float:
        """A forward over works of (rows, cached positions) computing ``num_logits`` logits
        rows (None: every row's, as decodes and verifications do)."""
        total = sum(r for r, _ in works)
        if not total:
            return 0.0
        seconds = self.rows(total) + self.per_position * sum(r * c for r, c in works)
        if len(works) > 1 and self.per_request is not None:
            each = (total if num_logits is None else num_logits) / len(works)
            seconds += self.per_request(min(each, self.max_rows_each), len(works)) * (len(works) - 1)
        return seconds


def fit_forward(ops: Sequence[OpRow], model: str) -> ForwardCosts:
    """``model``'s ForwardCosts from a trace's ops (the serving grid's ``batch`` points and
    the prefills); a one-line CostModelError where the trace has no batched points."""
    batched: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    prefills: dict[int, list[float]] = defaultdict(list)
    for row in ops:
        if row.model != model:
            continue
        if row.op == "batch":
            batched[row.num_requests, row.num_new_tokens, row.num_cached_tokens].append(row.seconds)
        elif row.op == "prefill" and row.num_cached_tokens == 0:
            prefills[row.num_new_tokens].append(row.seconds)
    contexts = sorted({c for _, _, c in batched})
    if not contexts:
        raise CostModelError(f"the trace has no batched forwards of the {model} (record it with --grid serving)")
    low, high = contexts[0], contexts[-1]
    added = [(median(batched[b, r, high]) - median(batched[b, r, low])) / (b * r * (high - low))
             for (b, r, c) in batched if c == low and (b, r, high) in batched] if high > low else []
    per_position = max(median(added), 0.0) if added else 0.0

    def at_low(b: int, r: int) -> float:
        """The point of b x r at the smallest context: more cached positions never cost
        less, so one above its largest context's is the grid's noise, and that one is
        taken (a Qwen ShareGPT grid had 1 x 1 at 82.8 ms after 128 positions, 72.6 after
        512, and its 75 ms plain steps were priced 9-12 % high). Not that one less what
        the positions between add: that median overshoots many points, and every serving
        trace validated worse with it."""
        seconds = median(batched[b, r, low])
        return min(seconds, median(batched[b, r, high])) if (b, r, high) in batched else seconds
    points: dict[float, list[float]] = defaultdict(list)
    every_row = {r for (b, r, _) in batched if b > 1}  # rows the grid batches: its points' every row's logits
    for (b, r, c) in batched:
        if c == low and b == 1:
            points[r].append(at_low(b, r) - per_position * r * c)
    for n, seconds in prefills.items():
        if n not in points:  # a forward after a context is what a step runs: the batched point where both are
            points[n].extend(seconds)
    xs = sorted(points)
    ys, top = [], 0.0
    for x in xs:  # more rows never cost less: the grid's noise (3 repeats) is taken out
        top = max(top, median(points[x]))
        ys.append(top)
    rows = Curve(tuple(float(x) for x in xs), tuple(ys))
    logits = Curve(rows.xs, tuple(float(x) if x in every_row else 1.0 for x in xs))
    added = {(r, b): [max((at_low(b, r) - per_position * b * r * low - rows(b * r)) / (b - 1), 0.0)]
             for (b, r, c) in batched if c == low and b > 1}
    if not added:
        return ForwardCosts(rows, None, 0.0, per_position, logits)
    return ForwardCosts(rows, surface(added), float(max(r for r, _ in added)), per_position, logits)


def draft_rounds(composition, draft_rows: Sequence[int] = ()) -> list[tuple[int, int, int]]:
    """The step's draft-model rounds: (tokens proposed, the request's cached positions, the
    rows of its first draft forward) each; a round feeds the target its last token and the
    proposal. ``draft_rows``: per work, the rows its draft cache lacks (``ReplayedStep``);
    empty: one each."""
    return [(rows - 1, cached, draft_rows[i] if draft_rows else 1)
            for i, (kind, drafter, rows, cached) in enumerate(zip(composition.kinds, composition.drafters,
                                                                  composition.rows, composition.num_cached))
            if kind == VERIFY and drafter == DRAFT_MODEL]


@dataclass(frozen=True)
class StepOverhead:
    per_step_s: float
    per_work_s: float
    # what a prompt row adds to a step's target forward beyond the op grid's price of it
    # (``fit_step_costs``); 0 where the steps' forwards were not given
    per_prompt_row_s: float = 0.0
    # what a logits row the grid's points leave out adds (``ForwardCosts.unpriced_logits``):
    # the head's row, 3.2 ms on a Zen 4 core (Qwen's 151,936 words), fitted alike
    per_logits_row_s: float = 0.0


@dataclass(frozen=True)
class StepCosts:
    target: ForwardCosts
    draft: ForwardCosts | None
    overhead: StepOverhead = StepOverhead(0.0, 0.0)
    # the machine's seconds per second of these costs: a load priced at its own speed
    # (``load_speeds``); 1: at the speed they were fitted at
    speed: float = 1.0

    def forward_s(self, composition) -> float:
        num_logits = logits_rows(composition)
        return (self.target.seconds(list(zip(composition.rows, composition.num_cached)), num_logits)
                + self.overhead.per_prompt_row_s * prompt_rows(composition)
                + self.overhead.per_logits_row_s * self.target.unpriced_logits(
                    len(composition.rows), sum(composition.rows), num_logits)) * self.speed

    def propose_s(self, composition, draft_rows: Sequence[int] = ()) -> float:
        """The draft model's forwards for the step's draft-model rounds (none: 0)."""
        rounds = draft_rounds(composition, draft_rows)
        if not rounds or self.draft is None:
            return 0.0
        first = self.draft.seconds([(behind, c) for _, c, behind in rounds], len(rounds))  # a logits row each
        return (first + sum(self.draft.seconds([(1, c + j) for proposed, c, _ in rounds if proposed > j])
                            for j in range(1, max(p for p, _, _ in rounds)))) * self.speed

    def seconds(self, composition, draft_rows: Sequence[int] = ()) -> float:
        """A step's seconds; ``draft_rows`` as ``draft_rounds`` takes them."""
        return (self.forward_s(composition) + self.propose_s(composition, draft_rows)
                + (self.overhead.per_step_s + self.overhead.per_work_s * len(composition.rows)) * self.speed)


def prompt_rows(composition) -> int:
    """The step's prompt rows: its prefill chunks' tokens."""
    return sum(rows for kind, rows in zip(composition.kinds, composition.rows) if kind == PREFILL)


def logits_rows(composition) -> int:
    """The logits rows of the step's target forward: every row of a decode or a
    verification, one of a prefill chunk (the prompt's last computes one, the others none)."""
    return sum(1 if kind == PREFILL else rows for kind, rows in zip(composition.kinds, composition.rows))


def fit_step_costs(ops: Sequence[OpRow], compositions: Sequence, seconds: Sequence[float],
                   draft_rows: Sequence[Sequence[int]] = (), forward_s: Sequence[float] = ()) -> StepCosts:
    """The op grid's forwards, and the overheads that bring them to the recorded
    ``seconds`` of ``compositions`` (each step's whole time; ``draft_rows`` per step as
    ``draft_rounds`` takes them, or none). ``forward_s``: each step's target forward as
    recorded (or none), from which two prices beyond the grid's, each a median, never
    negative: a logits row the grid leaves out (``ForwardCosts.unpriced_logits``), over the
    steps that prefill nothing and have such rows, of their forward's excess per row (a
    verification of 17 rows, a store round of 16, was priced 21 % low on a Zen 4); then a
    prompt row, over the steps that prefill, of their forward's excess per prompt row (a
    prompt's rows in a step cost more than the grid's prefill of as many alone: over the
    shipped serving traces such steps were priced 2-7 % low, the others within 1-3 % either
    way). Results, section 40. Then the per-step and per-work overheads are fitted on the
    whole steps."""
    import numpy as np
    draft = fit_forward(ops, DRAFT_MODEL) if any(r.model == DRAFT_MODEL and r.op == "batch" for r in ops) else None
    costs = StepCosts(fit_forward(ops, "target"), draft)
    if not compositions:
        return costs
    # the logits rows first, on the steps that prefill nothing, then the prompt rows
    plain = [(c, measured, costs.target.unpriced_logits(len(c.rows), sum(c.rows), logits_rows(c)))
             for c, measured in zip(compositions, forward_s) if not prompt_rows(c)]
    excess = [(measured - costs.forward_s(c)) / n for c, measured, n in plain if n > 0]
    costs = replace(costs, overhead=replace(costs.overhead,
                                            per_logits_row_s=max(median(excess), 0.0) if excess else 0.0))
    excess = [(measured - costs.forward_s(c)) / prompt_rows(c)
              for c, measured in zip(compositions, forward_s) if prompt_rows(c)]
    costs = replace(costs, overhead=replace(costs.overhead,
                                            per_prompt_row_s=max(median(excess), 0.0) if excess else 0.0))
    behind = list(draft_rows) or [()] * len(compositions)
    modelled = np.array([costs.seconds(c, b) for c, b in zip(compositions, behind)])
    target = np.array(seconds, dtype=float)
    design = np.array([[1.0, len(c.rows)] for c in compositions])
    fixed, per_work = least_relative_error(design, target - modelled, target)
    return replace(costs, overhead=replace(costs.overhead, per_step_s=fixed, per_work_s=per_work))


@dataclass(frozen=True)
class StepErrors:
    """Mean absolute percentage errors over steps: the whole step, its target forward and
    its proposals (the steps with draft-model rounds), and the load's total time."""

    num_steps: int  # each figure None where there are none
    step_mape: float | None
    forward_mape: float | None
    propose_mape: float | None  # None also where no step drafted with the draft model
    total_error: float | None  # (modelled - recorded) / recorded, all steps' seconds summed


def step_errors(costs: StepCosts, compositions: Sequence, rows: Sequence,
                draft_rows: Sequence[Sequence[int]] = ()) -> StepErrors:
    """``costs`` against recorded steps (``profiler.schema.StepRow``) of the same
    compositions (``draft_rows`` per step, or none)."""
    def mape(pairs):
        pairs = [(m, r) for m, r in pairs if r > 0]
        return 100.0 * sum(abs(m - r) / r for m, r in pairs) / len(pairs) if pairs else None
    behind = list(draft_rows) or [()] * len(compositions)
    modelled = [costs.seconds(c, b) for c, b in zip(compositions, behind)]
    drafting = [(costs.propose_s(c, b), r.propose_s) for c, b, r in zip(compositions, behind, rows)
                if draft_rounds(c)]
    recorded_s = sum(r.seconds for r in rows)
    return StepErrors(len(rows), mape(zip(modelled, (r.seconds for r in rows))),
                      mape((costs.forward_s(c), r.forward_s) for c, r in zip(compositions, rows)),
                      mape(drafting), 100.0 * (sum(modelled) / recorded_s - 1.0) if recorded_s > 0 else None)


def load_speeds(steps: dict[tuple[str, str], list[StepRow]]) -> dict[tuple[str, str], float]:
    """Per recorded (load, policy) with a probe, how much longer the machine took than at
    the loads' usual speed: its probe over their median (1: as usual); none without."""
    probes = {key: rows[0].probe_s for key, rows in steps.items() if rows and rows[0].probe_s is not None}
    usual = median(probes.values()) if probes else None
    return {key: probe / usual for key, probe in probes.items()}
