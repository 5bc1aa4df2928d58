"""Step costs: a per-op model fitted to a trace's ops table, and what the engine spends on
one replayed request under it. Imports no torch.

Each model op is the median of its repeats at every grid point, interpolated piecewise
linearly over lengths (and extrapolated along the last segment): ``decode`` over the
context, ``prefill`` over new and cached tokens, ``verify`` over scored tokens and context.
The store's clone and insert are a fixed cost plus a cost per byte; its lookup and prompt
lookup's proposal are linear in the tokens searched.

``request_cost`` walks a request as the engine runs it (``rakv.engine.Engine.generate``):
store lookups, the clones of reused positions and the target's prefill (the time to first
token), then every iteration of the decode loop: prompt lookup's match whenever it is
ready (it is computed once per step, for its signal and its shadow alike), and a plain
target step, or a round: the draft model's catch-up on the tokens it has not seen (after
rounds it did not draft, several), its further steps and the target's verification of the
proposal (an empty prompt-lookup proposal is one plain step); finally the store's inserts.
What the ops do not see (Python per request, per iteration and per round) is
``Overhead``, fitted from the runs table (``simulator.calibration``).

A shared machine's speed drifts by tens of percent over minutes (one Qwen decode step
took 211-317 ms in five ops passes), so a recording stores beside every op and run the
seconds of a fixed probe (``probe_s``, one forward of one token of the target), and costs
are priced at the recording's usual speed, the median probe beside its ops
(``at_usual_speed``); a trace without probes is priced as timed. What a slow phase slows
is what streams memory, as the probe does: each forward reads its weights and caches once,
whatever its rows, and the store copies bytes. The arithmetic on a forward's rows it
leaves alone: across five passes a 64- to 512-token Qwen prefill followed its probe with
an elasticity of 0.0-0.3 (a decode step's: 0.8-1.0), so scaling a whole prefill by its
probe priced Qwen's time to first token up to 18 % low after a slow probe. So of a forward
of several rows only its one-row part is scaled (``OpCosts.streamed``).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Sequence

from rakv.cost_model import interpolate
from rakv.drafters import DRAFT_MODEL, NGRAM
from rakv.op_timing import OpRow
from rakv.rounds import RecordedRounds, walk
from rakv.settings import DecisionInputs
from simulator.session import ReplayedRequest


class CostModelError(ValueError):
    """Ops that cannot be fitted; the message is one line."""


@dataclass(frozen=True)
class Curve:
    """y(x) through sorted points, linear between them and along the end segments beyond."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # x -> y: replays repeat lengths

    def __call__(self, x: float) -> float:
        y = self._memo.get(x)
        if y is None:
            y = self._memo[x] = self._at(x)
        return y

    def _at(self, x: float) -> float:
        return interpolate(self.xs, self.ys, x)


@dataclass(frozen=True)
class Surface:
    """y(x, z): a ``Curve`` over x at each measured z, linear in z between them."""

    zs: tuple[float, ...]
    curves: tuple[Curve, ...]
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # (x, z) -> y

    def __call__(self, x: float, z: float) -> float:
        y = self._memo.get((x, z))
        if y is None:
            y = self._memo[x, z] = (Curve(self.zs, tuple(c(x) for c in self.curves))._at(z) if len(self.zs) > 1
                                    else self.curves[0](x))
        return y


def curve_of(points: dict[float, list[float]]) -> Curve:
    xs = sorted(points)
    return Curve(tuple(xs), tuple(median(points[x]) for x in xs))


def surface(points: dict[tuple[float, float], list[float]]) -> Surface:
    """Points keyed (x, z); each z needs its own x points."""
    by_z: dict[float, dict[float, list[float]]] = defaultdict(dict)
    for (x, z), values in points.items():
        by_z[z][x] = values
    zs = sorted(by_z)
    return Surface(tuple(zs), tuple(curve_of(by_z[z]) for z in zs))


@dataclass(frozen=True)
class OneRow:
    """A forward of any number of rows priced as one row after as many cached tokens."""

    decode: Curve  # (cached tokens)

    def __call__(self, num_tokens: float, num_cached: float) -> float:
        return self.decode(num_cached)


@dataclass(frozen=True)
class ModelCosts:
    """One model's forward costs, seconds."""

    prefill: Surface  # (new tokens, cached tokens): one logits row
    decode: Curve  # (cached tokens): one token
    verify: Surface  # (tokens scored, cached tokens): a logits row per token

    def prefill_s(self, num_new: int, num_cached: int) -> float:
        return self.prefill(num_new, num_cached) if num_new > 0 else 0.0

    def one_row(self) -> "ModelCosts":
        """Every forward priced as one row at its context: the part of it that streams the
        weights and the caches."""
        return ModelCosts(OneRow(self.decode), self.decode, OneRow(self.decode))

    def forward_s(self, num_new: int, num_cached: int) -> float:
        """Feeding ``num_new`` tokens for the last one's logits: a step or a short prefill."""
        return self.decode(num_cached) if num_new == 1 else self.prefill_s(num_new, num_cached)


@dataclass(frozen=True)
class OpCosts:
    target: ModelCosts
    draft: ModelCosts | None
    clone: Curve  # (bytes restored)
    insert: Curve  # (bytes kept)
    lookup: Curve  # (prompt tokens): one model's match in the store
    ngram: Curve  # (sequence tokens): one prompt-lookup match
    usual_probe_s: float | None = None  # the speed these costs are at: the ops' median probe (None: unprobed)
    decode_memo: dict = field(default_factory=dict, compare=False, repr=False)  # request_cost's decode loops

    def at_usual_speed(self, seconds: float, probe_s: float | None, streamed_s: float | None = None) -> float:
        """``seconds`` timed beside a probe of ``probe_s`` (a run's), as at these costs' speed;
        ``streamed_s``: the part of them that streams memory, at these costs (None: all)."""
        return at_usual_speed(seconds, probe_s, self.usual_probe_s, streamed_s)

    def streamed(self) -> "OpCosts":
        """These costs with every forward priced as one row (``ModelCosts.one_row``): what
        a request spends streaming memory. The store's copies are all streaming."""
        return replace(self, target=self.target.one_row(), draft=self.draft.one_row() if self.draft else None,
                       decode_memo={})


def at_usual_speed(seconds: float, probe_s: float | None, usual_probe_s: float | None,
                   streamed_s: float | None = None) -> float:
    """``seconds`` timed beside a probe of ``probe_s``, as at the probes' usual speed: their
    streaming part, ``streamed_s`` seconds at the usual speed (None: all of them), took
    probe_s / usual_probe_s times as long; the rest ran as fast as ever. Always between
    ``seconds`` and ``seconds`` scaled whole; as timed if either probe is unknown."""
    if probe_s is None or usual_probe_s is None:
        return seconds
    whole = seconds * usual_probe_s / probe_s
    if streamed_s is None:
        return whole
    usual = seconds - streamed_s * (probe_s / usual_probe_s - 1.0)
    return min(max(usual, min(seconds, whole)), max(seconds, whole))


def _one_row(r: OpRow) -> bool:
    return r.op == "decode" or (r.op == "prefill" and r.num_new_tokens == 1)


def _model_costs(rows: list[OpRow], role: str) -> ModelCosts:
    points: dict[str, dict] = {"prefill": defaultdict(list), "decode": defaultdict(list), "verify": defaultdict(list)}
    for r in rows:
        if r.model != role:
            continue
        if r.op in ("prefill", "verify"):
            points[r.op][r.num_new_tokens, r.num_cached_tokens].append(r.seconds)
        if _one_row(r):  # a one-token prefill is the same call as a decode step after as many
            points["decode"][r.num_cached_tokens].append(r.seconds)
    missing = [op for op, found in points.items() if not found]
    if missing:
        raise CostModelError(f"the ops table holds no {', '.join(missing)} timings of the {role} model")
    return ModelCosts(surface(points["prefill"]), curve_of(points["decode"]), surface(points["verify"]))


def _store_curve(rows: list[OpRow], model: str, op: str, by_bytes: bool) -> Curve:
    points = defaultdict(list)
    for r in rows:
        if r.model == model and r.op == op:
            points[r.num_bytes if by_bytes else (r.num_cached_tokens if model == NGRAM else r.num_new_tokens)].append(
                r.seconds)
    if not points:
        raise CostModelError(f"the ops table holds no {model} {op} timings")
    curve = curve_of(points)
    if len(curve.xs) == 1:  # one size measured: proportional to it
        curve = Curve((0.0,) + curve.xs, (0.0,) + curve.ys)
    return curve


def fit_op_costs(ops: Sequence[OpRow]) -> OpCosts:
    """The costs of ``ops`` at their usual speed (the module docstring)."""
    rows = list(ops)
    if not rows:
        raise CostModelError("the trace has no ops table rows: record it with ops, or give a timing trace")
    probes = [r.probe_s for r in rows if r.probe_s is not None]
    usual = median(probes) if probes else None
    rows = _at_usual_speed(rows, usual)
    has_draft = any(r.model == DRAFT_MODEL for r in rows)
    return OpCosts(
        target=_model_costs(rows, "target"), draft=_model_costs(rows, DRAFT_MODEL) if has_draft else None,
        clone=_store_curve(rows, "store", "clone", True), insert=_store_curve(rows, "store", "insert", True),
        lookup=_store_curve(rows, "store", "lookup", False), ngram=_store_curve(rows, NGRAM, "propose", False),
        usual_probe_s=usual)


def _at_usual_speed(rows: list[OpRow], usual_probe_s: float | None) -> list[OpRow]:
    """Each op's seconds at the usual speed: a one-row forward's and a store op's scaled
    whole, a forward of several rows only in its one-row part at its context (the one-row
    forwards' curve, at the usual speed)."""
    if usual_probe_s is None:
        return rows
    one_row_points: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.model in ("target", DRAFT_MODEL) and _one_row(r):
            one_row_points[r.model][r.num_cached_tokens].append(at_usual_speed(r.seconds, r.probe_s, usual_probe_s))
    one_row = {model: curve_of(points) for model, points in one_row_points.items()}

    def streamed(r: OpRow) -> float | None:
        several = r.model in one_row and r.op in ("prefill", "verify") and not _one_row(r)
        return one_row[r.model](r.num_cached_tokens) if several else None
    return [replace(r, seconds=at_usual_speed(r.seconds, r.probe_s, usual_probe_s, streamed(r))) for r in rows]


@dataclass(frozen=True)
class Overhead:
    """Seconds the ops do not see: Python per request (before the first token, and
    after it), per decode-loop iteration, per round, and the adaptive planner's extra per
    iteration."""

    ttft_s: float = 0.0
    request_s: float = 0.0
    iteration_s: float = 0.0
    round_s: float = 0.0
    adaptive_iteration_s: float = 0.0


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class RequestCost:
    ttft_s: float  # service time to the first token (no queueing)
    e2e_s: float  # service time of the whole request
    num_iterations: int  # decode-loop iterations: plain steps and rounds
    ops_ttft_s: float  # the ops' part of each, before the overhead
    ops_e2e_s: float


def request_cost(replayed: ReplayedRequest, num_prompt: int, costs: OpCosts, inputs: DecisionInputs,
                 overhead: Overhead = Overhead()) -> RequestCost:
    """What the engine spends on ``replayed`` (see the module docstring)."""
    n, target = num_prompt, costs.target
    store = replayed.store
    reused = store.reuse.reused_tokens
    ttft = costs.lookup(n) * (1 + (inputs.draft_sizes is not None))
    if reused:
        ttft += costs.clone(reused * inputs.target_sizes.kv_bytes_per_token)
    ttft += target.prefill_s(n - reused, reused)
    total = ttft
    if store.draft_reused_tokens:
        total += costs.clone(store.draft_reused_tokens * inputs.draft_sizes.kv_bytes_per_token)
    key = (n, replayed.num_output_tokens, replayed.drafters, store.draft_reused_tokens, replayed.rounds)
    decode = costs.decode_memo.get(key)
    if decode is None:  # requests repeat in a replay, and so, mostly, do their rounds
        decode = costs.decode_memo[key] = _decode_s(costs, *key)
    total += decode[0]
    if store.kept_tokens:
        total += costs.insert(store.kept_tokens * inputs.target_sizes.kv_bytes_per_token)
    if store.kept_draft_tokens:
        total += costs.insert(store.kept_draft_tokens * inputs.draft_sizes.kv_bytes_per_token)
    # the round oracle plans for free (``simulator.round_oracle``)
    return with_overhead(RequestCost(ttft, total, decode[1], ttft, total), overhead, len(replayed.rounds),
                         replayed.adaptive and not replayed.foresight)


def _decode_s(costs: OpCosts, n: int, num_output: int, drafters: tuple[str, ...], draft_reused: int,
              rounds: tuple) -> tuple[float, int]:
    """(seconds, iterations) of the decode loop after the first token, walked as the engine
    runs it (``rakv.rounds.walk``)."""
    target, draft = costs.target, costs.draft
    ngram_ready = NGRAM in drafters
    total, iterations = 0.0, 0

    def price(t: int, rnd, draft_seen: int) -> None:
        nonlocal total, iterations
        length = n + t  # the sequence so far; the target's cache holds all of it but the last token
        iterations += 1
        if ngram_ready:
            total += costs.ngram(length)
        if rnd is None:
            total += target.decode(length - 1)
            return
        if rnd.drafter == DRAFT_MODEL:  # it catches up on the tokens it has not seen, then drafts
            total += draft.forward_s(length - draft_seen, draft_seen)
            total += sum(draft.decode(length + i) for i in range(rnd.num_proposed - 1))
        if rnd.num_proposed:
            total += target.verify(rnd.num_proposed + 1, length - 1)
        else:  # an empty prompt-lookup proposal: one plain step
            total += target.decode(length - 1)

    walk(RecordedRounds(rounds, num_output), n, draft_reused, price)
    return total, iterations


@dataclass(frozen=True)
class OverheadSample:
    """One measured run beside the ops' account of it."""

    cost: RequestCost  # under zero overhead
    num_rounds: int
    adaptive: bool
    measured_ttft_s: float
    measured_e2e_s: float


def fit_overhead(samples: Sequence[OverheadSample]) -> Overhead:
    """The overhead that best explains measured runs beyond their ops, minimising the mean
    absolute relative error (what MAPE measures; a run slowed by something else on the
    machine pulls it far less than least squares would): the time to first token's as a
    constant, the rest as a constant per request plus terms per iteration, per round and
    per adaptive iteration. Every term is at least 0 (Python's work takes time, it never
    gives any back), so a prediction is never below the ops' own account, in sample or
    out: an unconstrained fit gave a request that stopped after 2 tokens -0.075 s. A term
    no sample varies is left at 0. No samples: zero."""
    import numpy as np
    if not samples:
        return Overhead()
    ttft_s = least_relative_error(np.ones((len(samples), 1)),
                                   np.array([s.measured_ttft_s - s.cost.ops_ttft_s for s in samples]),
                                   np.array([s.measured_ttft_s for s in samples]))[0]
    columns = [[1.0] * len(samples), [s.cost.num_iterations for s in samples], [s.num_rounds for s in samples],
               [s.cost.num_iterations * s.adaptive for s in samples]]
    design = np.array(columns, dtype=float).T  # [runs, 4]
    used = [j for j in range(4) if j == 0 or np.ptp(design[:, j]) > 0]
    residual = np.array([s.measured_e2e_s - s.cost.ops_e2e_s - ttft_s for s in samples])
    coef = dict(zip(used, least_relative_error(design[:, used], residual,
                                                np.array([s.measured_e2e_s for s in samples]))))
    return Overhead(ttft_s=float(ttft_s), request_s=coef.get(0, 0.0), iteration_s=coef.get(1, 0.0),
                    round_s=coef.get(2, 0.0), adaptive_iteration_s=coef.get(3, 0.0))


def least_relative_error(design, target, scale, iterations: int = 50) -> list[float]:
    """x >= 0 minimising sum |target - design @ x| / scale, by iteratively reweighted
    non-negative least squares."""
    import numpy as np
    from scipy.optimize import nnls
    weights = 1.0 / scale
    x = np.zeros(design.shape[1])
    for _ in range(iterations):
        root = np.sqrt(weights)
        x = nnls(design * root[:, None], target * root)[0]
        error = np.abs(target - design @ x)
        weights = 1.0 / (scale * np.maximum(error, 1e-4 * scale))
    return [float(v) for v in x]


def with_overhead(cost: RequestCost, overhead: Overhead, num_rounds: int, adaptive: bool) -> RequestCost:
    """``cost`` (fitted under zero overhead) with ``overhead`` added."""
    e2e = (cost.ops_e2e_s + overhead.ttft_s + overhead.request_s + overhead.iteration_s * cost.num_iterations
           + overhead.round_s * num_rounds + overhead.adaptive_iteration_s * cost.num_iterations * adaptive)
    return RequestCost(cost.ops_ttft_s + overhead.ttft_s, e2e, cost.num_iterations, cost.ops_ttft_s, cost.ops_e2e_s)
