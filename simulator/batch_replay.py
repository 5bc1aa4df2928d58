"""Serving under load, replayed: the batching engine's own scheduler (``rakv.scheduler``,
the same code, not a copy) over a trace's facts. Imports no torch.

``BatchReplay`` stands where ``rakv.batch_engine.BatchEngine`` stands, with the models
replaced by the trace: admission looks the prompt up in the engine's store model, the
request's policy decides and makes its round planner (``rakv.controller.start_request``,
as ``Engine.decide`` does); each step
carries out the scheduler's works, a prefill chunk advancing the cached positions, a
round proposing and accepting what the request's recorded run lengths say
(``rakv.acceptance``'s ``RunLengthRounds``, the batch-1 replay's rounds), a plain step
appending one token; a request whose prefill ends keeps its prompt in the store
(``StoreModel.keep_prompt``), and one that reaches its output's end leaves its entries
there and its counts with its policy, in the engine's order. So every decision, every
step's composition (which requests, their kinds, rows, contexts, drafters and k) and every
round are a function of the arrival order and the settings, as in the engine, and a
closed-loop load (``c=N``: the next request submitted when one finishes, in request order,
as ``profiler.serve_record`` drives the engine) reproduces the recorded steps exactly.

Times are not modelled here: ``simulator.serve_sim`` drives a replay under a load and
prices its steps (``simulator.step_costs``), ``python -m simulator.serve_validate``
checks both against a serving trace.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rakv.acceptance import RunLengthRounds, with_store_drafter
from rakv.controller import Policy, RequestOutcome, start_request
from rakv.drafters import DRAFT_MODEL
from rakv.rounds import draft_cache_after
from rakv.scheduler import DECODE, PREFILL, VERIFY, BatchConfig, Composition, Scheduler, Seq, Work
from rakv.settings import DecisionInputs
from rakv.step_load import pricer
from simulator.session import SessionError, output_length
from simulator.trace import RecordedRequest


@dataclass(frozen=True)
class ReplayedStep:
    """A step as replayed: its composition; ``row_cuts``, per work, None where its rows are
    exact, else the count they are exact up to: a draft-model round stopped on confidence
    past its first wrong token or the output's end, where the trace knows only that it
    proposed at least ``ReplayedRound.proposed_known``; the requests that got their first
    token in it, and those it finished (with their output tokens and the prompt positions
    they reused from the store); per work, the rows its draft model's cache lacked before a
    draft-model round (what the round's first draft forward feeds:
    ``step_costs.draft_rounds``), else 0."""

    composition: Composition
    row_cuts: tuple[int | None, ...]
    first_tokens: tuple[int, ...]
    finished: tuple[tuple[int, int, int], ...]  # (request id, output tokens, reused positions)
    draft_rows: tuple[int, ...] = ()


@dataclass(eq=False)
class _Live:
    """A request in the replay beside its scheduler ``Seq`` (``_Request``'s account)."""

    seq: Seq
    recorded: RecordedRequest
    num_output: int  # its greedy output's length under its cap: where it ends
    action: object = None
    planner: object = None
    reused: int = 0
    draft_reused: int | None = None  # None: it did not ready the draft model
    moves: RunLengthRounds | None = None  # set at its first token
    rounds: list = field(default_factory=list)
    pending: tuple | None = None  # a round proposed this step: (round, probs), carried to ``_advance``


class BatchReplay:
    """The batching engine over a trace's facts: ``submit`` requests, ``step`` until
    ``has_work`` is False. One policy for every request, one store, one scheduler."""

    def __init__(self, policy: Policy, inputs: DecisionInputs, batch: BatchConfig, target_namespace: str,
                 draft_namespace: str | None):
        from rakv.store_model import StoreModel
        self.policy, self.inputs = policy, inputs
        self.target_namespace, self.draft_namespace = target_namespace, draft_namespace
        self.store = StoreModel(inputs.engine.store)
        self.scheduler = Scheduler(batch, self._admit, self._preempted, lambda: self.store.total_bytes,
                                   self.store.index.evict_lru, pricer(inputs.timings))
        self._live: dict[int, _Live] = {}
        self._first_tokens: list[int] = []  # this step's, admissions' exact repeats included
        self._target_bytes = inputs.target_sizes.kv_bytes_per_token
        self._draft_bytes = inputs.draft_sizes.kv_bytes_per_token if inputs.draft_sizes is not None else 0
        self.num_submitted = 0

    def submit(self, recorded: RecordedRequest, max_new_tokens: int, arrival_s: float = 0.0) -> int:
        """Queue a recorded request (as ``BatchEngine.submit``; ``arrival_s`` on ``step``'s
        clock); its id, in submission order."""
        if max_new_tokens > recorded.max_new_tokens:
            raise SessionError(f"request {recorded.request_id} was recorded up to {recorded.max_new_tokens} new "
                               f"tokens; a replay cannot ask for {max_new_tokens}")
        n = len(recorded.prompt_ids)
        max_new = min(max_new_tokens, self.inputs.max_positions - n)
        request_id = self.num_submitted
        self.num_submitted += 1
        seq = Seq(request_id, n, max_new, self._target_bytes, num_tokens=n, prefill_end=n, arrival_s=arrival_s)
        self._live[request_id] = _Live(seq, recorded, output_length(recorded, max_new))
        self.scheduler.add(seq)
        return request_id

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, now_s: float = 0.0) -> ReplayedStep:
        """One step at ``now_s`` (the modelled clock): the scheduler's works carried out (the
        finished requests in the order the engine finishes them)."""
        self._first_tokens = []
        works = self.scheduler.schedule(now_s)
        draft_rows = tuple(self._draft_behind(w) for w in works)
        for work in works:  # the engine proposes every round before the step's forward
            if work.kind == VERIFY:
                self._propose(work)
        composition = Composition(tuple(w.seq.request_id for w in works), tuple(w.kind for w in works),
                                  tuple(self._rows(w) for w in works), tuple(w.seq.num_computed for w in works),
                                  tuple(w.drafter or "" for w in works), tuple(w.k for w in works))
        cuts = tuple(self._row_cut(w) for w in works)
        self.scheduler.ran(composition)
        for work in works:
            self._advance(work)
        finished = []
        for seq in list(self.scheduler.running):
            live = self._live[seq.request_id]
            if live.moves is not None and seq.t >= live.moves.end:
                self._finish(live)
                finished.append((seq.request_id, seq.t, live.reused))
        return ReplayedStep(composition, cuts, tuple(self._first_tokens), tuple(finished), draft_rows)

    def _draft_behind(self, work: Work) -> int:
        """The positions a draft-model round's first draft forward catches up (the walk's
        account; after a preemption the engine's draft cache restarts empty, which this
        does not see)."""
        if work.kind != VERIFY or work.drafter != DRAFT_MODEL:
            return 0
        return work.seq.draft_behind

    def _row_cut(self, work: Work) -> int | None:
        if work.kind != VERIFY:
            return None
        rnd = self._live[work.seq.request_id].pending[0]
        return None if rnd.proposed_exact else rnd.proposed_known + 1  # the target's token and those proposed

    # -- a work --------------------------------------------------------------------
    def _propose(self, work: Work) -> None:
        """A round's proposal and what the target accepts of it, from the run lengths."""
        live = self._live[work.seq.request_id]
        live.pending = live.moves.propose(work.seq.t, work.drafter, work.k, live.moves.stop_below(work.drafter),
                                          live.seq.draft_seen)

    def _rows(self, work: Work) -> int:
        """The rows the work feeds the target: a chunk, one token, or the last token and
        the proposal (a prompt-lookup proposal may be shorter than k)."""
        if work.kind != VERIFY:
            return work.rows
        return self._live[work.seq.request_id].pending[0].num_proposed + 1

    def _advance(self, work: Work) -> None:
        live = self._live[work.seq.request_id]
        seq, t = live.seq, live.seq.t
        if work.kind == PREFILL:
            seq.num_computed += work.rows
            if seq.num_computed == seq.prefill_end and t == 0:
                if self.store.keeps_prompts_early():
                    self.store.keep_prompt(live.recorded.token_ids[:seq.num_prompt],
                                           (self.target_namespace, self.inputs.target_sizes))
                self._first_token(live)
            return
        if work.kind == VERIFY:
            rnd, probs = live.pending
            _, appended = live.moves.finish_move(t, work.drafter, work.k, rnd, probs)
            live.rounds.append(rnd)
            if work.drafter == DRAFT_MODEL:
                seq.draft_seen = draft_cache_after(seq.num_prompt, t, rnd.num_proposed, appended)
        else:
            assert work.kind == DECODE
            _, appended = live.moves.finish_move(t, work.drafter, 0)
        seq.num_tokens += appended
        seq.num_computed = seq.num_tokens - 1

    # -- admission, first token, finish (``BatchEngine``'s, over the store model) ------
    def _admit(self, seq: Seq) -> None:
        live = self._live[seq.request_id]
        missing = None if self.inputs.draft_sizes is not None else SessionError(
            f"policy {self.policy.name!r} needs a draft model; the trace's pair has none")
        decision = start_request(self.store, (self.target_namespace, self.draft_namespace),
                                 live.recorded.token_ids[:seq.num_prompt], seq.max_new_tokens, self.policy, missing,
                                 len(self.scheduler.running))
        live.action, live.planner = decision.action, decision.planner
        live.reused, live.draft_reused = decision.reuse.reused_tokens, decision.draft_reused
        seq.draft_seen = live.draft_reused or 0
        seq.bytes_per_position = self._target_bytes + (self._draft_bytes if live.draft_reused is not None else 0)
        seq.num_computed = live.reused
        if live.reused == seq.num_prompt:  # an exact repeat: the stored logits, no prefill
            self._first_token(live)

    def _first_token(self, live: _Live) -> None:
        self._first_tokens.append(live.seq.request_id)
        live.seq.num_tokens += 1
        recorded = live.recorded
        lengths = with_store_drafter(recorded.lengths, live.planner.drafters, self.store, self.target_namespace,
                                     self.inputs.engine.suffix, recorded.token_ids, live.seq.num_prompt,
                                     live.num_output)
        live.moves = RunLengthRounds(live.planner, lengths, live.num_output, live.seq.max_new_tokens,
                                      recorded.token_ids)
        live.seq.moves = live.moves

    def _preempted(self, seq: Seq) -> None:
        """Nothing to drop: a replay holds no caches (the draft's account, ``Seq.draft_seen``,
        is the walk's, as the engine's store sees it at the finish)."""

    def _finish(self, live: _Live) -> None:
        seq = live.seq
        draft = (self.draft_namespace, self.inputs.draft_sizes) if live.draft_reused is not None else None
        self.store.keep(live.recorded.token_ids[:seq.num_tokens], seq.num_prompt,
                        (self.target_namespace, self.inputs.target_sizes), draft, live.draft_reused, live.rounds)
        self.policy.observe(RequestOutcome(live.action, live.planner.counts()))
        self.scheduler.finish(seq)
        del self._live[seq.request_id]
