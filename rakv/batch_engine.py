"""The engine under load: many requests at once, each step one batched target forward.

Requests are submitted at any time (``submit``) and run by ``step``: the scheduler
(``rakv.scheduler``, torch-free) picks each running request's work, a prefill chunk, a
decode row or a speculation round's verification, and this module runs it: the draft
model's proposals for every round that drafts with it, batched the same way
(``decoding.draft_propose_many``), prompt lookup per request, then one target forward
over every request's rows (``decoding.forward_many``). A request's admission looks the
store up and lets its policy decide, as ``Engine.generate`` does; the end of its prefill
keeps its prompt in the store (``StoreConfig.early_prompts``), so that requests arriving
while it runs hit it, and its finish keeps the rest; its round planner is the one it
would have alone.

Invariant (batch invariance): every request's output ids are its own greedy output,
whatever runs beside it, in whatever order requests arrive. It holds by construction: a
forward's rows never mix (``direct_forward.batched_logits``), a prefill chunk computes
what the whole prompt's forward computes for its positions (``rakv.row_attention``), and
only the target's greedy tokens enter the sequence. What batching changes is the time,
and so the rounds: a round's k is clipped to the step's rows, and a policy's running
estimates see requests finish in another order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rakv.controller import Policy, RequestOutcome
from rakv.decoding import draft_propose_many, forward, forward_many, greedy, verified_round
from rakv.drafters import DRAFT_MODEL
from rakv.engine import Decision, Engine, RequestError, RequestResult, RoundRecord, _ModelRounds
from rakv.kv_cache import GrowingCache
from rakv.kv_store import KVStore, measure_sizes
from rakv.models import ModelPair
from rakv.rounds import draft_cache_after, draft_cache_positions
from rakv.cost_model import PairTimings
from rakv.scheduler import PREFILL, VERIFY, BatchConfig, Composition, Scheduler, Seq, Work
from rakv.settings import EngineConfig
from rakv.step_load import pricer


@dataclass(frozen=True)
class TokenEvent:
    """What a step gave one request: its new output tokens (a round may give several), and
    its result once it finished."""

    request_id: int
    token_ids: tuple[int, ...]
    finished: bool
    result: RequestResult | None = None


@dataclass(frozen=True)
class StepRecord(Composition):
    """What the last step ran (its ``Composition``), and its seconds: proposals (the draft
    model's batched forwards and prompt lookups), the target's forward, and all of the
    works' (those two, the rounds' bookkeeping and finishes; not the scheduling before,
    whose admissions look the store up and decide)."""

    propose_s: float
    forward_s: float
    seconds: float


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_bytes: int  # positions the running requests' caches hold, at their bytes per position
    store_bytes: int
    num_preemptions: int
    num_requests_finished: int
    prefix_hit_tokens: int  # prompt positions reused from the store, over finished requests
    prompt_tokens: int
    rounds: int  # speculation rounds of finished requests
    accepted_tokens: int
    num_waiting_late: int  # waiting past the TTFT target (``BatchConfig.ttft_target_s``), not yet admitted
    num_late: int  # requests admitted past the TTFT target


@dataclass(eq=False)
class _Request:
    """A request's state beside its scheduler ``Seq``: its tokens, decision, caches and walk."""

    seq: Seq
    prompt: list[int]
    tokens: list[int]  # prompt + output so far
    policy: Policy
    submitted_s: float  # time.perf_counter() at ``submit``: its result's times count from it
    decision: Decision | None = None  # made at its first admission
    admitted_s: float = 0.0
    decide_s: float = 0.0
    target_cache: object = None
    drafters: dict = field(default_factory=dict)
    prompt_logits: torch.Tensor | None = None
    moves: _ModelRounds | None = None  # set at the first token
    rounds: list = field(default_factory=list)
    first_token_s: float | None = None  # when its first token was delivered: the end of the step that made it


class BatchEngine(Engine):
    """Continuous batching over one pair, one prefix store and a default policy (a request
    may bring its own). Not thread-safe: one thread makes every call. ``generate`` (the
    batch-1 engine's) stays available."""

    def __init__(self, pair: ModelPair, policy: Policy, config: EngineConfig = EngineConfig(),
                 batch: BatchConfig = BatchConfig(), store: KVStore | None = None,
                 timings: PairTimings | None = None):
        """``timings``: the calibration that prices steps for ``batch.itl_target_s``'s pace
        (``rakv.scheduler``); None: no pace is kept."""
        super().__init__(pair, policy, config, store)
        self.batch = batch
        self.scheduler = Scheduler(batch, self._admit, self._preempted, lambda: self.store.total_bytes,
                                   self.store.index.evict_lru, pricer(timings))
        self._requests: dict[int, _Request] = {}
        self._events: list[TokenEvent] = []
        self._undelivered: list[_Request] = []  # first tokens made this step, timed when the step delivers them
        self._target_bytes = measure_sizes(pair.target).kv_bytes_per_token
        self._draft_bytes = measure_sizes(pair.draft).kv_bytes_per_token if pair.draft is not None else 0
        self._finished = {"count": 0, "hit": 0, "prompt": 0, "rounds": 0, "accepted": 0}
        self.last_step: StepRecord | None = None

    # -- requests ------------------------------------------------------------------
    def submit(self, prompt_ids, max_new_tokens: int, policy: Policy | None = None,
               arrival_s: float | None = None) -> int:
        """Queue a request; its id. Raises RequestError (one line) for one that can never run.
        ``arrival_s``: when it arrived, on ``time.perf_counter``'s clock (None: now), where a
        TTFT target's wait counts from; its result's times count from this call."""
        prompt = self.validate(prompt_ids, max_new_tokens)
        n = len(prompt)
        max_new = min(max_new_tokens, self.max_positions - n)
        need = (n + max_new) * (self._target_bytes + self._draft_bytes)
        if need > self.batch.memory_budget_bytes:
            raise RequestError(f"a request of {n} + {max_new} tokens needs {need / 2**20:.1f} MiB of KV, over the "
                               f"memory budget of {self.batch.memory_budget_bytes / 2**20:.1f} MiB")
        request_id = self.num_requests
        self.num_requests += 1
        submitted_s = time.perf_counter()
        seq = Seq(request_id, n, max_new, self._target_bytes, num_tokens=n, prefill_end=n,
                  arrival_s=submitted_s if arrival_s is None else arrival_s)
        self._requests[request_id] = _Request(seq, prompt, list(prompt), policy or self.policy, submitted_s)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: int) -> None:
        """Drop a request, waiting or running; its caches go now, nothing is stored."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.remove(req.seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run(self, requests: list[tuple[list[int], int]]) -> list[RequestResult]:
        """Submit every (prompt ids, max new tokens) at once and step until all finish; the
        results in submission order."""
        ids = [self.submit(prompt, max_new) for prompt, max_new in requests]
        results = {}
        while self.has_work():
            for event in self.step():
                if event.finished:
                    results[event.request_id] = event.result
        return [results[i] for i in ids]

    def stats(self) -> EngineStats:
        running = [self._requests[s.request_id] for s in self.scheduler.running]
        kv = sum(r.seq.bytes_per_position * r.seq.num_computed for r in running)
        f = self._finished
        return EngineStats(len(running), len(self.scheduler.waiting), kv, self.store.total_bytes,
                           self.scheduler.num_preemptions, f["count"], f["hit"], f["prompt"], f["rounds"],
                           f["accepted"], self.scheduler.num_waiting_late(time.perf_counter()),
                           self.scheduler.num_late)

    # -- a step --------------------------------------------------------------------
    def step(self, now_s: float | None = None) -> list[TokenEvent]:
        """One step: the scheduler's works, one batched target forward, the tokens.
        ``now_s``: the scheduler's time, on ``time.perf_counter``'s clock (None: now)."""
        return self.run_works(self.scheduler.schedule(time.perf_counter() if now_s is None else now_s))

    def run_works(self, works: list[Work]) -> list[TokenEvent]:
        """Carry out a step's works (``Scheduler.schedule``'s, each of them once); the step's
        account goes to ``last_step``."""
        start_s = time.perf_counter()
        reqs = [self._requests[w.seq.request_id] for w in works]
        num_cached = tuple(w.seq.num_computed for w in works)
        proposals = self._propose(works, reqs)
        feeds = [self._feed(w, r, p) for w, r, p in zip(works, reqs, proposals)]
        forward_start_s = time.perf_counter()
        logits = forward_many(self.pair.target, [r.target_cache for r in reqs], [f[0] for f in feeds],
                              [f[1] for f in feeds]) if works else []
        forward_s = time.perf_counter() - forward_start_s
        for work, req, proposal, rows in zip(works, reqs, proposals, logits):
            self._advance(work, req, proposal, rows)
        # a first token reaches its client with the step's other tokens, not when it was made (an
        # exact repeat's at its admission, before the step ran): its TTFT counts to here, as the
        # server's and the simulator's do
        delivered_s = time.perf_counter()
        for req in self._undelivered:
            req.first_token_s = delivered_s
        self._undelivered = []
        for seq in list(self.scheduler.running):
            req = self._requests[seq.request_id]
            if req.moves is not None and req.seq.t >= req.moves.end:
                self._finish(req)
        self.last_step = StepRecord(
            tuple(w.seq.request_id for w in works), tuple(w.kind for w in works), tuple(len(f[0]) for f in feeds),
            num_cached, tuple(w.drafter or "" for w in works), tuple(w.k for w in works),
            forward_start_s - start_s, forward_s, time.perf_counter() - start_s)
        self.scheduler.ran(self.last_step)
        events, self._events = self._events, []
        return events

    def _propose(self, works: list[Work], reqs: list[_Request]) -> list[tuple[list[int], tuple]]:
        """Each verification's proposal and the draft's probabilities (the draft model's,
        batched over the requests that draft with it; prompt lookup's per request)."""
        proposals: list[tuple[list[int], tuple]] = [([], ())] * len(works)
        drafting = [i for i, w in enumerate(works) if w.kind == VERIFY and w.drafter == DRAFT_MODEL]
        for i, w in enumerate(works):
            if w.kind == VERIFY and w.drafter != DRAFT_MODEL:
                proposals[i] = (reqs[i].drafters[w.drafter].propose(reqs[i].tokens, w.k), ())
        if drafting:
            caches = []
            for i in drafting:
                req = reqs[i]
                cache = req.drafters[DRAFT_MODEL].cache
                # the walk's account of the draft cache, which the simulator prices, is exact (a
                # preempted request's draft cache restarts empty and catches up)
                assert req.seq.num_preemptions or cache.get_seq_length() == req.seq.draft_seen
                caches.append(cache)
            made = draft_propose_many(self.pair.draft, caches, [reqs[i].tokens for i in drafting],
                                      [works[i].k for i in drafting],
                                      [reqs[i].moves.stop_below(DRAFT_MODEL) for i in drafting])
            for i, (proposal, probs) in zip(drafting, made):
                proposals[i] = (proposal, tuple(probs))
        return proposals

    @staticmethod
    def _feed(work: Work, req: _Request, proposal: tuple[list[int], tuple]) -> tuple[list[int], int]:
        """The tokens ``work`` feeds the target, and the logits rows it needs."""
        seq = req.seq
        if work.kind == PREFILL:
            end = seq.num_computed + work.rows
            return req.tokens[seq.num_computed:end], int(end == seq.prefill_end and seq.t == 0)
        return req.tokens[-1:] + proposal[0], len(proposal[0]) + 1

    def _advance(self, work: Work, req: _Request, proposal: tuple[list[int], tuple], logits) -> None:
        """The request after its work: tokens appended, its planner told, its caches rolled back."""
        seq, t = req.seq, req.seq.t
        if work.kind == PREFILL:
            seq.num_computed += work.rows
            if logits is not None:  # the prompt's last chunk: the first token
                if self.store.model.keeps_prompts_early():
                    self.store.insert(self.pair.target_fingerprint, req.prompt, req.target_cache,
                                      {seq.num_prompt: logits[0]}, in_use=True)
                self._first_token(req, logits[0])
            return
        moves = req.moves
        if work.kind == VERIFY:
            drafter = req.drafters[work.drafter]
            rnd = verified_round(req.target_cache, drafter, req.tokens, t, work.k, proposal[0], proposal[1], logits,
                                 self.pair.eos_token_ids)
            new_ids, record = rnd.new_ids, RoundRecord(t, work.drafter, work.k, rnd.num_proposed, rnd.accepted)
            moves.logits = rnd.logits
            moves.append(t, rnd.new_ids)
            _, appended = moves.finish_move(t, work.drafter, work.k, record, rnd.draft_probs)
            req.rounds.append(record)
            if work.drafter == DRAFT_MODEL:
                seq.draft_seen = draft_cache_after(seq.num_prompt, t, record.num_proposed, appended)
        else:
            moves.logits = logits[0]
            new_ids = tuple(greedy(logits))
            moves.append(t, list(new_ids))
            moves.finish_move(t, work.drafter, 0)
        seq.num_tokens = len(req.tokens)
        seq.num_computed = seq.num_tokens - 1
        self._events.append(TokenEvent(seq.request_id, tuple(new_ids), False))

    # -- admission, first token, finish --------------------------------------------
    def _admit(self, seq: Seq) -> None:
        """The request's store lookup, decision and restored caches (``Engine.generate``'s
        start), when the scheduler first admits it."""
        start = time.perf_counter()
        req = self._requests[seq.request_id]
        req.admitted_s = start
        req.decision = decision = self.decide(req.prompt, seq.max_new_tokens, req.policy, len(self.scheduler.running))
        seq.draft_seen = decision.draft_reused or 0
        req.drafters = self._drafters(decision.planner.drafters, decision.draft_match, seq.draft_seen)
        reused = decision.reuse.reused_tokens
        req.target_cache = self.store.restore(decision.match.entry, reused) if reused else GrowingCache()
        seq.bytes_per_position = self._target_bytes + (self._draft_bytes if decision.draft_reused is not None else 0)
        seq.num_computed = reused
        req.decide_s = time.perf_counter() - start
        if reused == seq.num_prompt:  # an exact repeat: the stored logits, no prefill
            self._first_token(req, self.store.stored_logits(decision.match))

    def _first_token(self, req: _Request, logits: torch.Tensor) -> None:
        req.prompt_logits = logits
        req.tokens += greedy(logits[None])
        req.seq.num_tokens = len(req.tokens)
        self._undelivered.append(req)
        req.moves = _ModelRounds(req.decision.planner, req.seq.max_new_tokens, self.pair, req.target_cache, req.drafters,
                                 req.tokens, req.seq.num_prompt, logits)
        req.seq.moves = req.moves
        self._events.append(TokenEvent(req.seq.request_id, (req.tokens[-1],), False))

    def _preempted(self, seq: Seq) -> None:
        """Its caches go; they are recomputed when it runs again."""
        req = self._requests[seq.request_id]
        req.target_cache = GrowingCache()
        if req.moves is not None:
            req.moves.target_cache = req.target_cache
        if DRAFT_MODEL in req.drafters:
            req.drafters[DRAFT_MODEL].cache = GrowingCache()

    def _finish(self, req: _Request) -> None:
        seq = req.seq
        n = seq.num_prompt
        drafter = req.drafters.get(DRAFT_MODEL)
        if drafter is not None and seq.num_preemptions:
            # a preempted request's draft cache restarted empty: bring it to the walk's account
            account = draft_cache_positions(n, req.decision.draft_reused, req.rounds, len(req.tokens) - n)
            if drafter.cache.get_seq_length() < account:
                forward(self.pair.draft, drafter.cache, req.tokens[drafter.cache.get_seq_length():account])
        self._store(req.prompt, req.tokens, req.target_cache, {n: req.prompt_logits, len(req.tokens) - 1:
                                                                req.moves.logits},
                    drafter.cache if drafter is not None else None, req.decision.draft_reused, req.rounds)
        decision = req.decision
        req.policy.observe(RequestOutcome(decision.action, decision.planner.counts()))
        now = time.perf_counter()
        result = RequestResult(
            request_id=seq.request_id, policy=req.policy.name, action=decision.action, num_prompt_tokens=n,
            hit_tokens=decision.match.hit_tokens, reused_tokens=decision.reuse.reused_tokens,
            draft_reused_tokens=decision.draft_reused or 0, hit_kind=decision.reuse.hit_kind,
            output_ids=tuple(req.tokens[n:]), ttft_s=req.first_token_s - req.submitted_s, e2e_s=now - req.submitted_s,
            decide_s=req.decide_s, rounds=tuple(req.rounds), queue_s=req.admitted_s - req.submitted_s,
            num_preemptions=seq.num_preemptions)
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        f = self._finished
        f["count"] += 1
        f["hit"] += decision.reuse.reused_tokens
        f["prompt"] += n
        f["rounds"] += len(req.rounds)
        f["accepted"] += sum(r.accepted for r in req.rounds)
        self._events.append(TokenEvent(seq.request_id, (), True, result))
