"""The round oracle: for every request, the exact best schedule of rounds, each one a plain
target step or a round of one ready drafter with any draft length k <= max_k, chosen with
foresight of the recorded run lengths and priced by the simulator's costs. Imports no torch.

Per request-level choice (r, the drafters it readies: none, prompt lookup, the draft
model or both, and those with the store drafter where ``controller.store_drafter`` is
on) the schedule is a shortest path over the decode loop's states, and the
cheapest choice runs, the store as it stands (``StoreModel.preview`` changes nothing).
It bounds what any round planner can reach on the trace: ``regret_vs_round_oracle``.

State: t, the output tokens generated, and the draft model's gap g, the tokens of the
sequence its cache has not seen (n + t minus its positions). A draft-model round from t
pays a catch-up forward over g tokens, so g matters; every other move lengthens it by the
tokens it appends. After a draft-model round g is 1 or 2 (``rakv.rounds.draft_cache_after``),
and at the end the positions the draft keeps are priced (the store's insert). So, with
V(t, g) the least seconds from state (t, g) to the end:

    V(t, g) = iteration(t) + min( min over non-draft moves (a, c): c + V(t + a, g + a),
                                  catch_up(t, g) + D(t) )
    D(t)    = min over draft lengths k: round(t, k) + V(t + a_k, g'_k)      (no g in it)

Moves with the same outcome keep the cheapest; the states reached number O(T^2) at most,
and a request takes a few milliseconds. The oracle plans for free: its requests pay no
adaptive planner's per-iteration overhead (a bound, as fixed policies pay none either),
the per-iteration and per-round overheads they do pay.
"""
from __future__ import annotations

from dataclasses import dataclass

from rakv.acceptance import ReplayedRound
from rakv.cost_model import Action, RequestFeatures
from rakv.drafters import DRAFT_MODEL, MODEL_FREE, NGRAM, SUFFIX, RunLengths
from rakv.rounds import draft_cache_after, tokens_appended
from rakv.settings import DecisionInputs
from rakv.store_model import PrefixMatch
from simulator.costs import OpCosts, Overhead, request_cost
from simulator.session import ReplayedRequest, Session, output_length
from simulator.trace import RecordedRequest

NAME = "round-oracle"
READY_SETS = ((), (NGRAM,), (DRAFT_MODEL,), (DRAFT_MODEL, NGRAM))  # what a request may ready, in the order weighed
STORE_READY_SETS = ((NGRAM, SUFFIX), (DRAFT_MODEL, NGRAM, SUFFIX))  # and with the store drafter, where it is on


@dataclass(frozen=True)
class Schedule:
    decode_s: float  # the decode loop's seconds after the first token, the draft's insert and overheads included
    rounds: tuple[ReplayedRound, ...]


def best_schedule(n: int, num_output: int, max_new: int, max_k: int, drafters: tuple[str, ...],
                  lengths: dict[str, RunLengths], draft_reused: int, kept: int, costs: OpCosts,
                  inputs: DecisionInputs, overhead: Overhead) -> Schedule:
    """The cheapest schedule of a request with an ``n``-token prompt and ``num_output``
    output tokens under a cap of ``max_new``, drafting with ``drafters`` (``lengths``: their
    run lengths), the draft model's cache starting from ``draft_reused`` positions and the
    store keeping ``kept`` target positions (the draft keeps at most as many)."""
    target, draft = costs.target, costs.draft
    end = num_output
    ngram_ready, draft_ready = NGRAM in drafters, DRAFT_MODEL in drafters
    free = [d for d in MODEL_FREE if d in drafters]
    draft_bytes = inputs.draft_sizes.kv_bytes_per_token if draft_ready else 0
    per_round = overhead.round_s

    # per t: the iteration's fixed seconds, the non-draft moves {appended: (seconds, round)} and the draft's
    fixed, plain_moves, draft_moves = [0.0] * end, [None] * end, [None] * end
    for t in range(1, end):
        length = n + t
        fixed[t] = overhead.iteration_s + (costs.ngram(length) if ngram_ready else 0.0)
        moves = {1: (target.decode(length - 1), None)}
        top = min(max_k, max_new - t - 1)
        for drafter in free if top > 0 else ():
            found = lengths[drafter]
            for k in range(1, top + 1):
                proposed, accepted = min(k, found.proposed[t]), min(k, found.runs[t])
                if proposed == 0:
                    break  # an empty proposal is a plain step with a round's overhead
                cost = target.verify(proposed + 1, length - 1) + per_round
                appended = tokens_appended(accepted, t, end)
                if cost < moves.get(appended, (float("inf"),))[0]:
                    moves[appended] = (cost, ReplayedRound(t, drafter, k, proposed, accepted))
        plain_moves[t] = tuple((a, c, rnd) for a, (c, rnd) in moves.items())
        if draft_ready and top > 0:
            runs = lengths[DRAFT_MODEL].runs
            best: dict[tuple[int, int], tuple[float, ReplayedRound]] = {}
            drafting = 0.0  # the draft's steps after its first: k - 1 of them
            for k in range(1, top + 1):
                if k > 1:
                    drafting += draft.decode(length + k - 2)
                accepted = min(k, runs[t])
                appended = tokens_appended(accepted, t, end)
                gap = n + t + appended - draft_cache_after(n, t, k, appended)
                cost = drafting + target.verify(k + 1, length - 1) + per_round
                if cost < best.get((appended, gap), (float("inf"),))[0]:
                    best[appended, gap] = (cost, ReplayedRound(t, DRAFT_MODEL, k, k, accepted))
            draft_moves[t] = tuple((a, g, c, rnd) for (a, g), (c, rnd) in best.items())

    def terminal(gap: int) -> float:
        kept_draft = min(n + end - gap, kept) if draft_ready else 0
        return costs.insert(kept_draft * draft_bytes) if kept_draft > 0 else 0.0

    # V(t, g) and the move taken, from the end backwards. The gaps at t: 1..t+1 (after a
    # draft-model round, lengthened since) and the start's, lengthened to t (no such round
    # yet); without the draft model the gap does not matter and is held at 0.
    start_gap = n + 1 - draft_reused if draft_ready else 0
    gaps_at = ((lambda t: {*range(1, t + 2), start_gap + t - 1}) if draft_ready else (lambda t: (0,)))
    value = {(end, g): terminal(g) for g in gaps_at(end)} if end > 1 else {}
    taken: dict[tuple[int, int], tuple[int, int, ReplayedRound | None]] = {}
    step = 1 if draft_ready else 0  # how a non-draft move lengthens the gap, per token appended
    for t in range(end - 1, 0, -1):
        best_draft = None  # D(t): the cheapest draft-model round from t and where it lands, whatever the gap
        if draft_moves[t]:
            best_draft = min((c + value[t + a, g], t + a, g, rnd) for a, g, c, rnd in draft_moves[t])
        for gap in gaps_at(t):
            best_v, best_move = float("inf"), None
            for a, c, rnd in plain_moves[t]:
                v = c + value[t + a, gap + a * step]
                if v < best_v:
                    best_v, best_move = v, (t + a, gap + a * step, rnd)
            if best_draft is not None:
                v = draft.forward_s(gap, n + t - gap) + best_draft[0]
                if v < best_v:
                    best_v, best_move = v, best_draft[1:]
            value[t, gap] = fixed[t] + best_v
            taken[t, gap] = best_move
    gap = start_gap
    total = value[1, gap] if end > 1 else terminal(gap)
    rounds, t = [], 1
    while t < end:
        t, gap, rnd = taken[t, gap]
        if rnd is not None:
            rounds.append(rnd)
    return Schedule(total, tuple(rounds))


class _Foresight:
    """The planner slot of a request the oracle scheduled: its drafters, nothing learned."""

    adaptive = True  # its rounds are chosen per round

    def __init__(self, drafters: tuple[str, ...]):
        self.drafters = drafters

    def counts(self) -> tuple:
        return ()


class _Nobody:
    name = NAME

    def observe(self, outcome) -> None:
        pass


class RoundOracle(Session):
    """Serves each request with the cheapest (r, drafters readied) and, under it, the best
    schedule of rounds (``best_schedule``)."""

    def __init__(self, inputs: DecisionInputs, costs: OpCosts, overhead: Overhead, target_namespace: str,
                 draft_namespace: str | None):
        super().__init__(_Nobody(), inputs, target_namespace, draft_namespace)
        self.costs, self.overhead = costs, overhead
        has_draft = inputs.draft_sizes is not None and costs.draft is not None
        store_sets = STORE_READY_SETS if inputs.controller.store_drafter else ()
        self.ready_sets = tuple(s for s in READY_SETS + store_sets if has_draft or DRAFT_MODEL not in s)
        self.priced: list[tuple[int, tuple[str, ...], float, ReplayedRequest]] = []  # the last request's, each priced
        # a schedule depends on the request, its cap, the drafters, the draft's reused positions and what is kept
        self._schedules: dict[tuple, tuple[ReplayedRound, ...]] = {}

    def run(self, request: RecordedRequest, max_new_tokens: int) -> ReplayedRequest:
        replayed = super().run(request, max_new_tokens)
        replayed.foresight = True
        return replayed

    def decide(self, request: RecordedRequest, features: RequestFeatures, target: PrefixMatch,
               draft: PrefixMatch) -> tuple[Action, object, tuple[ReplayedRound, ...]]:
        n = features.num_prompt_tokens
        max_new = features.num_new_tokens
        num_output = output_length(request, max_new)
        seq = request.token_ids[:n + num_output]
        max_k = min(self.inputs.controller.rounds.max_k, request.max_k)
        kept = self.store.kept_lengths(n, len(seq), None, ())[0]
        self.priced, best = [], None
        lengths = self.lengths(request, (SUFFIX,) if self.inputs.controller.store_drafter else (), num_output)
        if SUFFIX in lengths:  # looked up at every position now, as the store stands at the request's start
            lengths = {**lengths, SUFFIX: lengths[SUFFIX].materialized()}
        # r changes a schedule only through the draft's reused positions; the store drafter's
        # run lengths change with the store's contents, so its schedules are kept for this call only
        here: dict[tuple, tuple[ReplayedRound, ...]] = {}
        for r in (0, 1):
            for drafters in self.ready_sets:
                ready = DRAFT_MODEL in drafters
                reused = self.store.reuse_of(target, draft if ready else None, r)[1]
                key = (request.request_id, max_new, drafters, reused, kept)
                memo = here if SUFFIX in drafters else self._schedules
                if key not in memo:
                    memo[key] = best_schedule(n, num_output, max_new, max_k, drafters, lengths, reused, kept,
                                              self.costs, self.inputs, self.overhead).rounds
                rounds = memo[key]
                action = Action(r, 1, DRAFT_MODEL if ready else NGRAM) if drafters else Action(r, 0)
                outcome = self.store.preview(seq, n, target, draft if ready else None, r, rounds)
                replayed = ReplayedRequest(request.request_id, action, features, outcome, drafters, True, rounds,
                                           num_output, (), foresight=True)
                cost_s = request_cost(replayed, n, self.costs, self.inputs, self.overhead).e2e_s
                self.priced.append((r, drafters, cost_s, replayed))
                if best is None or cost_s < best[0]:  # ties: the first weighed (no reuse, fewer drafters)
                    best = (cost_s, action, drafters, rounds)
        return best[1], _Foresight(best[2]), best[3]
