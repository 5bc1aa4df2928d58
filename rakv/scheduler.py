"""Continuous batching's decisions: which requests run in a step, and with how many rows.
Imports no torch, so a replay can run the very same scheduler over a trace's facts.

Each step every running request contributes rows to one target forward: a chunk of its
prefill, one decode row, or a verification of a speculation round's k + 1 rows (its round
planner's choice, made here through its ``moves``). Conventions as vLLM's:
``max_num_seqs`` caps the running requests, ``max_num_batched_tokens`` the rows of a
step, prompts are prefilled in chunks, admission is first come first served, and a
request that cannot grow preempts the most recently admitted one, whose state is
recomputed when it is admitted again.

Invariants:
- Order. ``running`` is in admission order. A step plans the decoding requests first, in
  that order (their rows are what keeps tokens flowing), then prefill chunks in that
  order, then admits waiting requests from the front of ``waiting`` (with a TTFT target,
  those in time first, and late ones only in a lull: "Late requests yield") while rows,
  seats, memory and prefills last: a step prefills at most ``max_num_prefills``
  requests, an admission counting as one (its store lookup is made when it is admitted).
  A preempted request goes back to the front of ``waiting``. A round's planner is shown
  the rest of the step (``rakv.step_load.StepLoad``): the rounds planned before it, one
  row for each decoding request after it, and whether the step prefills (a running
  request's chunk, or a waiting request it may admit with a seat free).
- Rows. A step's works hold at most ``max_num_batched_tokens`` rows; a round's k is
  clipped to the rows left (``PlannedRounds.plan_move``'s ``max_k``): batching changes
  a request's rounds, never its tokens.
- Memory. Each running request reserves (its cached positions + the step's rows)
  positions at its bytes per position (target, plus the draft where it readied it: the
  draft's cache never holds more positions than that); reservations plus
  the prefix store's bytes stay within ``memory_budget_bytes`` whenever a step is planned:
  least recently used store entries go first, then running requests are preempted,
  newest first. A request is never lost or duplicated: it is in exactly one of
  ``waiting``, ``running`` or finished (``finish``) or dropped (``remove``).
- Pace (with ``itl_target_s``). From its first token, each request holds a slack: the
  target's seconds for every token it has made, less every step it was running through,
  as the planners price what the step ran (``price_s``, told by ``ran``). Each other
  decoding request on pace (slack >= 0) bounds a round's step to the target plus its
  slack (``StepLoad.pace_bounds_s``); the planner keeps its round within the tightest
  bound that a plain step would keep (``step_load.longest_within``), so no request that
  could stay on pace falls behind it for another's round, and a request may spend its
  own slack. Prefill chunks are not paced. A request already behind, or one that a
  plain step already puts behind, does not bound it: where plain steps cannot keep the
  pace (the load is past what they serve at the target), tokens per second is what
  brings requests back, and rounds are priced by it alone. The clock is the price, not
  the wall, so a replay makes the engine's choices exactly.
- Late requests yield (with ``ttft_target_s``). A waiting request not yet admitted that
  has waited past the target (``schedule``'s ``now_s`` less its ``arrival_s``: the
  engine's wall clock, a replay's modelled one) has missed a TTFT bound at the target
  whatever runs: admission takes the first request still in time (or admitted before: a
  preempted one); first come first served within each. A late request is admitted only
  in a lull, where none waits in time and none admitted in time still runs (``Seq.late``:
  admitted past the target), so that it takes no seat or row a request in time could
  use; under sustained overload it waits until the load ebbs. Past the knee, first come
  first served makes every request late (each waits behind all that came before); this
  keeps serving those that can still be in time. Those in time also bound a round's
  step as a pace does (``StepLoad.pace_bounds_s``): to half the least time any request
  still waiting in time for its first token (not admitted, or prefilling) has left, so
  that this step and one more like it, its prefill's, end within the target. A first
  token comes at the end of the step that admits the request, and one arriving
  meanwhile first waits out the step under way.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Callable

from rakv.drafters import DRAFT_MODEL
from rakv.step_load import DECODE, PREFILL, VERIFY, StepLoad, deepen

TTFT_TARGET_HELP = ("the time to first token to serve requests within, in seconds (your TTFT bound): a request "
                    "that has waited longer yields its turn to those still in time (first come first served within "
                    "each) and runs only when none of them runs, and no round makes a step longer than half the "
                    "least time a request in time has left")
MAX_NUM_PREFILLS_HELP = ("requests one step prefills at most, an admission counting as one: on a CPU a prompt's rows "
                         "cost what they cost alone, so a second prompt in a step makes the first one's first token "
                         "wait for it, for no gain; raise it for an accelerator, whose steps batch short prompts "
                         "nearly free")
ITL_TARGET_HELP = ("keep decoding requests to this inter-token latency in seconds: a round may not make a step "
                   "longer than another running request's pace allows (steps as the calibration prices them)")


@dataclass(frozen=True)
class BatchConfig:
    max_num_seqs: int = 8  # running requests at most
    max_num_batched_tokens: int = 256  # rows of one step at most
    memory_budget_bytes: int = 2 * 2**30  # running requests' KV and the prefix store together
    # The inter-token latency to keep decoding requests to: a round may not make its step
    # longer than another decoding request's pace allows (``Scheduler``'s "Pace"). None:
    # rounds are priced by tokens per second alone.
    itl_target_s: float | None = None
    # Waiting requests past this many seconds since they arrived yield their turn to those
    # still in time and run in lulls, and those in time bound the rounds' steps
    # (``Scheduler``'s "Late requests yield"). None: first come first served, steps
    # bounded by no wait.
    ttft_target_s: float | None = None
    # Requests a step prefills at most (running requests' next chunks and admissions). Where
    # a prompt's rows cost about what they cost alone, as a CPU's forward over a prompt of a
    # hundred tokens does, two prompts in one step gain nothing and make the first one's
    # first token, and every decoding request's next, wait for the second prompt; one a
    # step, each first token comes as early or earlier, the second's later by one step's
    # base cost at most. An accelerator, whose forwards batch short prompts nearly free,
    # wants more. Engines before it prefilled as many as rows and seats allowed.
    max_num_prefills: int = 1

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "memory_budget_bytes", "max_num_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("itl_target_s", "ttft_target_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, got {getattr(self, name)}")


@dataclass(eq=False)
class Seq:
    """A request as the scheduler sees it. ``moves``: its round planner's walk
    (``rakv.rounds.PlannedRounds``), set at admission; ``t``: output tokens so far."""

    request_id: int
    num_prompt: int
    max_new_tokens: int
    bytes_per_position: int  # KV bytes a position takes in its caches (target, and draft if readied)
    num_tokens: int = 0  # prompt + output known so far
    num_computed: int = 0  # positions in the target's cache
    prefill_end: int = 0  # positions to compute before it decodes (prompt, or all but the last token after a preemption)
    moves: object = None
    num_preemptions: int = 0
    admitted: bool = False  # admitted once (its store lookup and decision are made)
    slack_s: float = 0.0  # from its first token: seconds ahead of the ITL target, steps as priced (see "Pace")
    # positions the walk accounts to its draft model's cache (``rakv.rounds.draft_cache_after``),
    # kept by the engine and the replay: a round of it first catches up on num_tokens minus these
    draft_seen: int = 0
    arrival_s: float = 0.0  # when it arrived, on the clock ``Scheduler.schedule`` is given
    late: bool = False  # admitted past the TTFT target: it missed its bound whatever runs ("Late requests yield")

    @property
    def t(self) -> int:
        return self.num_tokens - self.num_prompt

    @property
    def draft_behind(self) -> int:
        """Positions a round of its draft model first catches up on (``draft_seen``'s lag)."""
        return self.num_tokens - self.draft_seen

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_end


@dataclass  # not frozen: built for every request in every step, and a frozen init costs 4x
class Work:
    """One request's part of a step: ``rows`` rows of ``kind``; a round's drafter and k."""

    seq: Seq
    kind: str  # PREFILL, DECODE or VERIFY
    rows: int  # prefill: the chunk's tokens; decode: 1; verify: at most k + 1 (a proposal may be shorter)
    drafter: str | None = None
    k: int = 0


@dataclass(frozen=True)
class Composition:
    """What a step ran, in its works' order: each request (its id), its kind, the rows it
    fed the target (a prompt-lookup proposal may be shorter than its k), its target
    cache's positions before the step, its round's drafter ("" where none) and k. The
    engine's account of a step (``rakv.batch_engine.StepRecord``) and the replay's
    (``simulator.batch_replay``) alike."""

    request_ids: tuple[int, ...]
    kinds: tuple[str, ...]
    rows: tuple[int, ...]
    num_cached: tuple[int, ...]
    drafters: tuple[str, ...]
    ks: tuple[int, ...]

    @classmethod
    def of(cls, step) -> "Composition":
        """The composition of anything that lists these fields (a recorded ``StepRow``)."""
        return cls(step.request_ids, step.kinds, step.rows, step.num_cached, step.drafters, step.ks)


@dataclass
class Scheduler:
    """FCFS continuous batching under a row budget, a seat cap and a memory budget.
    ``admit(seq)`` is called once per request at its first admission (the engine looks it
    up in the store, decides, and sets ``prefill_end``, ``num_computed``, ``moves`` and
    ``bytes_per_position``); ``preempted(seq)`` when a running request loses its state;
    ``store_bytes()`` / ``evict_store()`` read and shrink the prefix store (``evict_store``
    returns False when it is empty)."""

    config: BatchConfig
    admit: Callable[[Seq], None]
    preempted: Callable[[Seq], None]
    store_bytes: Callable[[], int]
    evict_store: Callable[[], bool]
    # a step's seconds as the planners price what it ran (``rakv.step_load.step_price_s``):
    # the pace's clock, the same live and in a replay; None: no pace is kept
    price_s: Callable[[Composition], float] | None = None
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    num_preemptions: int = 0
    num_late: int = 0  # requests admitted past the TTFT target
    # the step being planned: each running request's reservation in bytes (its cached
    # positions and its planned rows), and their sum; kept as works are planned, requests
    # admitted and preempted, so that a step's memory checks cost O(1) each
    _held: dict = field(default_factory=dict)
    _held_bytes: int = 0
    # the last step's pace: (seq, t) of each running request with output before it, and its price
    _pace_before: list = field(default_factory=list)
    _pace_price_s: float = 0.0

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Seq) -> None:
        """Drop a request wherever it is (an abort); its reservation goes with it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Seq) -> None:
        self.running.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- a step ------------------------------------------------------------------
    def schedule(self, now_s: float = 0.0) -> list[Work]:
        """The works of the next step (empty when nothing can run); ``now_s``: the time on
        the clock of the requests' ``arrival_s`` (read only with a TTFT target)."""
        budget = self.config.max_num_batched_tokens
        pacing = self.price_s is not None and self.config.itl_target_s is not None
        if pacing:
            self._pace_last_step()
        self._held, self._held_bytes = {}, 0
        for seq in self.running:
            self._reserve(seq, seq.num_computed)
        works: list[Work] = []
        decoding = [seq for seq in self.running if not seq.prefilling]  # a prefill waits for the second pass
        num_alive = len(decoding)  # those not preempted: a prefix of them (preemption takes the newest)
        planned_rows, depths = 0, []  # the rounds planned so far: their rows, and their draft depths (StepLoad)
        paces = self._paces(decoding) if pacing else []
        waits = self._ttft_bounds(now_s)
        # whether the step will prefill: a running request's next chunk, or an admission
        prefills = any(seq.prefilling for seq in self.running) or (
            bool(self.waiting) and len(self.running) < self.config.max_num_seqs
            and self._next_waiting(now_s) is not None)
        for i, seq in enumerate(decoding):
            if i >= num_alive or budget == 0:
                break
            rows = self._rows_for(seq, budget)
            while num_alive and decoding[num_alive - 1] not in self._held:
                num_alive -= 1
            if rows == 0:
                break  # it preempted itself, and every one after it before
            unplanned = num_alive - i - 1
            load = StepLoad(len(works) + unplanned, planned_rows + unplanned, tuple(depths),
                            _bounds_beside(seq, paces, waits) if paces or waits else (),
                            seq.draft_behind if prefills else 0)
            drafter, k = seq.moves.plan_move(seq.t, rows - 1, load)
            works.append(self._planned(Work(seq, VERIFY if k > 0 else DECODE, k + 1, drafter, k)))
            budget -= k + 1
            planned_rows += k + 1
            if drafter == DRAFT_MODEL and k:
                deepen(depths, k)
        num_prefills = 0
        for seq in self.running:
            if seq.prefilling and budget > 0:
                if num_prefills == self.config.max_num_prefills:
                    break
                work = self._chunk(seq, budget)
                if work is None:
                    break  # a prefill waits for memory rather than preempt
                works.append(work)
                budget -= work.rows
                num_prefills += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting(now_s)
            if seq is None:
                break  # only late requests wait, beside one in time
            if num_prefills == self.config.max_num_prefills and (seq.prefilling or not seq.admitted):
                break  # it prefills in a later step
            if not seq.admitted:
                self.admit(seq)
                seq.admitted = True
                seq.late = self._is_late(seq, now_s)
                self.num_late += seq.late
            work = self._chunk(seq, budget) if seq.prefilling else None
            if not self._fits(seq, work.rows if work is not None else 1):
                break  # FCFS: nothing overtakes it; it runs when memory frees up
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            self.running.append(seq)
            self._reserve(seq, seq.num_computed + (work.rows if work is not None else 0))
            if work is not None:
                works.append(work)
                budget -= work.rows
                num_prefills += 1
        if pacing:
            self._pace_before = [(seq, seq.t) for seq in self.running if seq.t > 0]
        return works

    def ran(self, step: Composition) -> None:
        """The step last scheduled, as it ran (its proposals made): its price is the pace's
        clock. The engine and the replay call it once per step, before the next ``schedule``."""
        if self._pace_before:
            self._pace_price_s = self.price_s(step)

    def _ttft_bounds(self, now_s: float) -> tuple[float, ...]:
        """With a TTFT target, the bound that the requests still waiting for their first
        token in time put on a round's step: half the least time left to the target among
        them (this step and one more like it, its prefill's, within it); () where none is."""
        target_s = self.config.ttft_target_s
        if target_s is None:
            return ()
        first = [seq for seq in self.waiting if not seq.admitted]
        first += [seq for seq in self.running if seq.prefilling and seq.t == 0]
        waited_s = [now_s - seq.arrival_s for seq in first if not self._is_late(seq, now_s)]
        return (0.5 * (target_s - max(waited_s)),) if waited_s else ()

    def _next_waiting(self, now_s: float) -> Seq | None:
        """The waiting request to admit next: the front; with a TTFT target the first still
        in time (admitted before, or waiting at most the target), else the front in a lull
        (no request admitted in time runs), else None."""
        if self.config.ttft_target_s is None:
            return self.waiting[0]
        for seq in self.waiting:
            if seq.admitted or not self._is_late(seq, now_s):
                return seq
        return None if any(not seq.late for seq in self.running) else self.waiting[0]

    def num_waiting_late(self, now_s: float) -> int:
        """Requests waiting past the TTFT target, not yet admitted: those a lull will serve."""
        return sum(not seq.admitted and self._is_late(seq, now_s) for seq in self.waiting)

    def _is_late(self, seq: Seq, now_s: float) -> bool:
        """Whether ``seq`` has waited past the TTFT target (none: never)."""
        target_s = self.config.ttft_target_s
        return target_s is not None and now_s - seq.arrival_s > target_s

    # -- pace --------------------------------------------------------------------
    def _pace_last_step(self) -> None:
        """Each request that had its first token before the last step: the ITL target's
        seconds for the tokens the step made it, less the step's price."""
        itl_s = self.config.itl_target_s
        for seq, t in self._pace_before:
            seq.slack_s += itl_s * (seq.t - t) - self._pace_price_s
        self._pace_before, self._pace_price_s = [], 0.0

    def _paces(self, decoding: list[Seq]) -> list[tuple[float, Seq]]:
        """(the longest step it keeps pace through, seq) of each decoding request on pace,
        tightest first."""
        itl_s = self.config.itl_target_s
        return sorted(((itl_s + seq.slack_s, seq) for seq in decoding if seq.slack_s >= 0), key=itemgetter(0))

    def _planned(self, work: Work) -> Work:
        if work.seq in self._held:  # a waiting request's rows count from its admission
            self._reserve(work.seq, work.rows)
        return work

    def _chunk(self, seq: Seq, budget: int) -> Work | None:
        """The next prefill chunk of ``seq`` within ``budget`` rows, or None where memory lacks."""
        chunk = min(seq.prefill_end - seq.num_computed, budget)
        return self._planned(Work(seq, PREFILL, chunk)) if self._fits(seq, chunk) else None

    # -- memory ------------------------------------------------------------------
    def _reserve(self, seq: Seq, num_positions: int) -> None:
        num_bytes = seq.bytes_per_position * num_positions
        self._held[seq] = self._held.get(seq, 0) + num_bytes  # a Seq hashes by identity (eq=False)
        self._held_bytes += num_bytes

    def _free_bytes(self, seq: Seq) -> int:
        """What the budget leaves beside the store and the other running requests'
        reservations (their caches' positions and the rows planned for them this step)."""
        others = self._held_bytes - self._held.get(seq, 0)
        return self.config.memory_budget_bytes - others - self.store_bytes()

    def _fits(self, seq: Seq, rows: int) -> bool:
        """Whether ``seq``'s caches can grow by ``rows`` positions beside the other running
        requests and the store, evicting store entries (LRU) to make room."""
        need = seq.bytes_per_position * (seq.num_computed + rows)
        while self._free_bytes(seq) < need:
            if not self.evict_store():
                return False
        return True

    def _rows_for(self, seq: Seq, max_rows: int) -> int:
        """Rows ``seq`` may take this step, at most ``max_rows``, preempting the newest
        running requests until one row fits; 0 where ``seq`` itself was preempted."""
        need = seq.bytes_per_position * (seq.num_computed + 1)
        while (free := self._free_bytes(seq)) < need:  # as ``_fits(seq, 1)``, keeping what is free
            if self.evict_store():
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return 0
        fit = free // max(seq.bytes_per_position, 1) - seq.num_computed
        return max(1, min(max_rows, fit))

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._held_bytes -= self._held.pop(seq, 0)
        seq.num_computed = 0
        # recomputed: all but the last token where it has output (that token is known), else the prompt
        seq.prefill_end = seq.num_tokens - 1 if seq.t > 0 else seq.num_tokens
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted(seq)
        self.waiting.appendleft(seq)


def _bounds_beside(seq: Seq, paces: list[tuple[float, Seq]], waits: tuple[float, ...]) -> tuple[float, ...]:
    """The other requests' paces and the waits' bound (``StepLoad.pace_bounds_s``), tightest first."""
    bounds = tuple(bound_s for bound_s, other in paces if other is not seq)
    return tuple(sorted(bounds + waits)) if waits else bounds
