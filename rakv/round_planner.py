"""Round planners: the drafter and draft length of each round of one request. Imports no torch.

A request's action fixes r and which drafters are ready (the draft model's cache is
prefilled only when the action uses it). Before every round the engine asks its planner
for (drafter, k); k = 0 is one plain target step. After the round it reports what was
proposed and accepted, and, for a drafter the planner shadows, what that drafter would
have proposed: prompt lookup costs microseconds, so the planner can watch it on every
step without using it.

- ``FixedRounds``: the same (drafter, k) every round (the fixed policies).
- ``AdaptiveRounds`` (``rakv``): a per-request acceptance estimate for each ready drafter,
  started at the policy's running estimate and moved towards each new trial; every round
  takes the (drafter, k) with the most expected tokens per second. Prompt lookup pays only
  where the output copies text (an edit of quoted code, a chat answer revising an earlier
  one), and a per-workload average cannot see that; the request's own tokens can.

Invariant: a planner's choices depend only on its start state, the drafters' signals and
the (proposed, accepted) counts reported to it, which are functions of the greedy output:
the drafters' run lengths m_t and signals (``drafters.RunLengths``). So
``acceptance.replay_request`` reproduces a request's rounds exactly from a trace, whatever
the timing noise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from rakv.cost_model import PairTimings, progress_by_k, round_s
from rakv.drafters import DRAFT_MODEL, MODEL_FREE, NGRAM, Columns, ngram_prior
from rakv.suffix_drafter import SUFFIX, suffix_prior
from rakv.round_yield import confidence_threshold, stop_shares, stopped_rounds
from rakv.step_load import StepLoad, load_prices, longest_within

MAX_DRAFT_LENGTH = 16  # the longest round a planner drafts (a fixed policy's k is one of K_CHOICES)


@dataclass  # not frozen: built for every request a replay simulates, and a frozen init costs 4x
class AcceptanceCount:
    """Geometric trials of one drafter under one signal in one request: every accepted
    token is a success; a proposal that stopped short of its verified length ended on a
    failure."""

    drafter: str
    signal: int  # Drafter.signal before the proposal (ngram: matched n-gram length)
    successes: int
    failures: int

    @property
    def rate(self) -> float | None:
        trials = self.successes + self.failures
        return self.successes / trials if trials else None


class _Counts:
    def __init__(self):
        self.trials: dict[tuple[str, int], list[int]] = {}  # (drafter, signal) -> [successes, failures]

    def add(self, drafter: str, signal: int, num_proposed: int, accepted: int) -> None:
        if num_proposed == 0:
            return  # no trial (prompt lookup found no match)
        tally = self.trials.get((drafter, signal))
        if tally is None:
            tally = self.trials[drafter, signal] = [0, 0]
        tally[0] += accepted
        if accepted < num_proposed:
            tally[1] += 1

    def totals(self) -> tuple[AcceptanceCount, ...]:
        return tuple(AcceptanceCount(d, s, *self.trials[d, s]) for d, s in sorted(self.trials))


class FixedRounds:
    """Draft length k with one drafter, every round; shadows nothing; never stops a
    proposal early."""

    shadowed: tuple[str, ...] = ()
    confidence = 0.0
    adaptive = False  # the same (drafter, k) every round

    def __init__(self, drafter: str, k: int):
        self.drafter, self.k = drafter, k
        self.drafters = (drafter,) if k > 0 else ()
        self._counts = _Counts()

    def bind(self, lengths: Mapping[str, Columns], tokens: Sequence[int] = ()) -> None:
        pass

    @property
    def memo_key(self) -> tuple | None:
        """Its rounds depend on the request alone, so a replay computes them once per
        request; not the store drafter's, whose proposals depend on the store."""
        return None if self.drafter == SUFFIX else (self.drafter, self.k)

    def plan(self, signals: Mapping[str, int], t: int = 0, load: StepLoad | None = None) -> tuple[str, int]:
        return self.drafter, self.k

    def observe(self, drafter: str, signal: int, num_proposed: int, accepted: int,
                probs: Sequence[float] = ()) -> None:
        self._counts.add(drafter, signal, num_proposed, accepted)

    def counts(self) -> tuple[AcceptanceCount, ...]:
        return self._counts.totals()


@dataclass(frozen=True)
class RoundCosts:
    """Seconds of a plain step and, per drafter, of a round drafting k = 0..max_k tokens,
    at one context length (``round_costs``); with the timings they came from, which price
    a round under load (``rakv.step_load``; None: it is priced alone). ``load_memo``: the
    load prices of the planners that share these costs (a policy keeps one ``RoundCosts``
    per context length, and its requests meet the same few loads again and again)."""

    step_s: float
    round_s: Mapping[str, tuple[float, ...]]
    timings: PairTimings | None = None
    num_context: int = 0
    load_memo: dict = field(default_factory=dict, compare=False, repr=False)

    MAX_LOADS = 4096  # load_memo's entries at most (it starts again empty past them)

    def load_priced(self, load: StepLoad, drafters: tuple[str, ...], max_k: int,
                    min_gain: float) -> tuple[float, float, Mapping[str, Sequence[float]]]:
        """(the others' tokens, the rate a round must beat, each drafter's round seconds)
        of ``drafters``' rounds in a step under ``load`` (``rakv.step_load.load_prices`` at
        this context), computed once per argument set."""
        # the pace bounds do not change the prices; a key with them would rarely meet again
        key = (load.num_others, load.num_other_rows, load.draft_depths, drafters, max_k, min_gain)
        priced = self.load_memo.get(key)
        if priced is None:
            if len(self.load_memo) >= self.MAX_LOADS:
                self.load_memo.clear()
            prices = load_prices(load, self.timings, drafters, max_k, self.num_context)
            priced = self.load_memo[key] = (prices.offset, prices.plain_rate(min_gain), prices.costs_s)
        return priced


def round_costs(timings: PairTimings, drafters: tuple[str, ...], max_k: int, num_context: int) -> RoundCosts:
    return RoundCosts(round_s(timings, DRAFT_MODEL, 0, num_context),
                      {d: tuple(round_s(timings, d, k, num_context) for k in range(max_k + 1)) for d in drafters},
                      timings, num_context)


@dataclass(frozen=True)
class PlannerConfig:
    recency: float = 0.1  # weight of each new trial in the request's acceptance estimates
    max_k: int = MAX_DRAFT_LENGTH
    # Speculate only for a predicted gain over a plain step of at least this fraction. The
    # estimate that triggers a round is high because the last trials went well, and what
    # follows is usually worse (regression to the mean); the cost fit leaves out each
    # round's rollback and bookkeeping; and a losing round costs more than a step. On
    # stock CPU kernels, where it cost 2-3 steps, 0.05 let prose lose 4 % to ar on the
    # prompt-lookup bench and 0.25 was needed; on packed kernels (``rakv.cpu_linear``) a
    # losing round of up to 4 drafts costs 1.1 steps, and 0.25 kept the draft model from
    # drafting on code once a request's estimate dipped (the draft is not shadowed, so
    # its estimate cannot recover): replaying qwen-coder-humaneval on packed timings,
    # 0.1 gave 3.03 tok/s against 2.70.
    min_gain: float = 0.1
    shadow_length: int = MAX_DRAFT_LENGTH  # tokens of a shadowed drafter's proposal checked after each round
    # The draft model ends a round after a token it gives less than this probability, as
    # HF's assistant does (``assistant_confidence_threshold``, 0.4); k is then a cap. Each
    # request moves its own threshold as its draft tokens are verified
    # (``confidence_threshold``). 0: proposals always run to k.
    draft_confidence: float = 0.4
    # Price a round in a batched step by what it adds to the step and delays for the other
    # requests (``rakv.step_load``); off: as if it ran alone, as engines before it did.
    load_aware: bool = field(default=True, metadata={"before": False})
    # A draft-model round whose draft cache lags by more than this many positions is not
    # planned in a step that prefills another request (``StepLoad.catch_up_beside_prefill``):
    # its catch-up forward, over a whole prompt at a request's first round (0.64 s for 107
    # positions of Qwen2.5-Coder 0.5B on a Xeon), would delay that request's first token.
    # The round waits for a step without a prefill, drafting with another drafter or not
    # at all meanwhile. None: planned wherever it pays, as engines before it did.
    max_catch_up_beside_prefill: int | None = field(default=16, metadata={"before": None})

    def __post_init__(self):
        if not 0 < self.recency <= 1 or not 1 <= self.max_k <= MAX_DRAFT_LENGTH or self.shadow_length < 1:
            raise ValueError(f"need 0 < recency <= 1, 1 <= max_k <= {MAX_DRAFT_LENGTH} and shadow_length >= 1, "
                             f"got {self.recency}, {self.max_k}, {self.shadow_length}")
        if not 0 <= self.draft_confidence < 1:
            raise ValueError(f"need 0 <= draft_confidence < 1, got {self.draft_confidence}")
        if self.max_catch_up_beside_prefill is not None and self.max_catch_up_beside_prefill < 0:
            raise ValueError(f"max_catch_up_beside_prefill must be at least 0, got {self.max_catch_up_beside_prefill}")


def best_round(drafter: str, progress: Sequence[float], costs_s: Sequence[float], top: int, offset: float,
               best_rate: float, best: tuple[str, int]) -> tuple[float, tuple[str, int]]:
    """(the rate, (drafter, k)) of ``drafter``'s round k in 1..``top`` with the most tokens
    per second, (offset + progress[k]) / costs_s[k], where it beats ``best_rate`` (the best
    so far, ``best``'s), else (best_rate, best). A round must beat it by a relative 1e-9,
    so a tie goes to the smaller k, then to the drafter asked first."""
    beat = best_rate * (1 + 1e-9)
    for k in range(1, top + 1):
        rate = (offset + progress[k]) / costs_s[k]
        if rate > beat:
            best_rate, best, beat = rate, (drafter, k), rate * (1 + 1e-9)
    return best_rate, best


def initial_estimate(drafter: str, signal: int, estimates: Mapping[str, float]) -> float:
    """Acceptance under a signal never observed: prompt lookup's and the store drafter's
    priors for their match, or the drafter's overall estimate in ``estimates`` (read only
    for a drafter with no prior by signal: the model-free ones need no entry there)."""
    if drafter == NGRAM:
        return ngram_prior(signal)
    return suffix_prior(signal) if drafter == SUFFIX else estimates[drafter]


class AdaptiveRounds:
    """Each round: the (drafter, k) with the most expected tokens per second under the
    request's own acceptance estimate for each (drafter, signal). Ties go to the smaller
    k, then the earlier drafter.

    The signal splits one drafter's guesses by what is known before they are made:
    prompt lookup after a 3-gram match is right most of the time, after a 1-gram match
    rarely, and with no match it has nothing to propose (signal 0, acceptance 0). An
    unseen signal starts from the policy's running estimate for it, else from
    ``ngram_prior`` (prompt lookup), ``suffix_prior`` (the store drafter) or the drafter's own estimate.
    Prompt lookup and the store drafter are shadowed whenever they are ready and not
    drafting: after each round the engine reports how much of each one's proposal the new
    tokens confirm, so a copy stretch is noticed after one step and the estimate decays
    again once it ends.
    """

    adaptive = True  # each round planned anew

    @property
    def memo_key(self) -> tuple | None:
        return None  # its rounds start from the policy's running estimates: not the request's alone

    def __init__(self, drafters: tuple[str, ...], priors: Mapping[tuple[str, int], float],
                 fallback: Mapping[str, float], costs: "RoundCosts", config: PlannerConfig = PlannerConfig(),
                 probe: str | None = None):
        """``probe``: a drafter whose acceptance the policy has not measured; the first
        round drafts with it, at its best-priced k, whatever the margin."""
        self.drafters = drafters
        self._probe = probe
        self.config = config
        self.shadowed = tuple(d for d in drafters if d in MODEL_FREE)
        self.acceptance = dict(priors)  # (drafter, signal) -> per-token acceptance, this request
        self.fallback = dict(fallback)  # per drafter, for a signal not seen before
        self.costs_s = costs.round_s  # per drafter: seconds of a round drafting k = 0..max_k tokens
        self.step_s = costs.step_s
        self._round_costs = costs if config.load_aware and costs.timings is not None else None
        self._plain_rate = (1.0 + config.min_gain) / self.step_s  # the rate a round must beat
        self._cheapest: dict[str, float] = {}  # per drafter, when first needed (``_cheapest_s``)
        self._hopeless: dict[str, float] = {}  # per drafter, when first needed (``_hopeless_at``)
        self._plain = (drafters[0] if drafters else DRAFT_MODEL, 0)
        self._keep = 1.0 - config.recency
        self._max_k = config.max_k
        self.shadow_length = config.shadow_length
        self.confidence = config.draft_confidence if DRAFT_MODEL in drafters else 0.0  # this request's stop threshold
        self._confidence_samples: list[tuple[float, bool]] = []
        self._stop_shares = (0.0, 0.0)  # of the request's right and wrong draft tokens, those below its threshold
        self._counts = _Counts()

    def estimate(self, drafter: str, signal: int) -> float:
        """The request's acceptance of ``drafter`` under ``signal``; under a signal not seen
        before ``initial_estimate``, kept (the value every later call would give: the
        planners read it on every iteration)."""
        a = self.acceptance.get((drafter, signal))
        if a is None:
            a = self.acceptance[drafter, signal] = initial_estimate(drafter, signal, self.fallback)
        return a

    def bind(self, lengths: Mapping[str, Columns], tokens: Sequence[int] = ()) -> None:
        pass  # the signals are all it reads

    def plan(self, signals: Mapping[str, int], t: int = 0, load: StepLoad | None = None) -> tuple[str, int]:
        """``load``: the rest of the batched step the round joins (None or no other
        request: priced alone)."""
        held = self._held(load)
        if self._probe is not None and self._probe != held:  # a held probe waits for its step
            drafter, self._probe = self._probe, None
            progress, costs = self._priced(drafter, signals[drafter])
            return drafter, max(range(1, self._max_k + 1), key=lambda k: progress[k] / costs[k])
        offset, best_rate, costs_s = self._prices(load)
        bounds_s = load.pace_bounds_s if load is not None else ()
        best = self._plain
        for drafter in self.drafters:
            if drafter == held:
                continue
            priced = self._rounds(drafter, signals[drafter], t, offset, best_rate, costs_s, bounds_s)
            if priced is not None:
                best_rate, best = best_round(drafter, *priced, offset, best_rate, best)
        return best

    def _rounds(self, drafter: str, signal: int, t: int, offset: float, best_rate: float,
                costs_s: Mapping[str, Sequence[float]], bounds_s: tuple[float, ...]
                ) -> tuple[Sequence[float], Sequence[float], int] | None:
        """(E_k, seconds of a round, the longest k) of ``drafter``'s rounds at t, priced by
        ``costs_s`` within the pace ``bounds_s``, for ``plan`` to weigh against the rate so
        far; None where none of them can win. The planners differ here alone."""
        top = longest_within(costs_s[drafter], self._max_k, bounds_s)
        if not top:
            return None  # even its shortest round would make the step too slow
        a = self.estimate(drafter, signal)
        if costs_s is self.costs_s:
            if a <= self._hopeless_at(drafter):
                return None  # no round of this drafter can win (``_hopeless_at``)
        elif a < 1.0 and (offset + 1.0 / (1.0 - a)) <= best_rate * costs_s[drafter][1]:
            return None  # likewise under load: E_k < 1 / (1 - a), and every round costs at least its k = 1
        return *self._priced(drafter, signal, a, costs_s[drafter]), top

    def _held(self, load: StepLoad | None) -> str | None:
        """The draft model where its round must wait: its catch-up would land in a step that
        prefills another request (``PlannerConfig.max_catch_up_beside_prefill``); else None."""
        limit = self.config.max_catch_up_beside_prefill
        if load is None or limit is None or load.catch_up_beside_prefill <= limit:
            return None
        return DRAFT_MODEL

    def _hopeless_at(self, drafter: str) -> float:
        """The acceptance at or below which no round of ``drafter`` alone can beat a plain
        step: E_k(a) < 1 / (1 - a) for every k, so a round's rate is below
        1 / ((1 - a) * its cheapest round). The 1e-9 keeps float rounding on the safe side:
        this only skips work, every drafter above it is priced exactly. Computed when first
        asked (rounds under load are bounded by the step's prices instead)."""
        found = self._hopeless.get(drafter)
        if found is None:
            found = self._hopeless[drafter] = 1.0 - 1.0 / (self._plain_rate * self._cheapest_s(drafter)) - 1e-9
        return found

    def _cheapest_s(self, drafter: str) -> float:
        """Seconds of ``drafter``'s cheapest round alone (k = 1..max_k), when first asked."""
        found = self._cheapest.get(drafter)
        if found is None:
            found = self._cheapest[drafter] = min(self.costs_s[drafter][1:self._max_k + 1])
        return found

    def _prices(self, load: StepLoad | None) -> tuple[float, float, Mapping[str, Sequence[float]]]:
        """(the others' tokens, the rate a round must beat, each drafter's round seconds)
        in a step under ``load`` (``rakv.step_load``); alone, the batch-1 prices themselves."""
        costs = self._round_costs
        if load is None or not load.num_others or costs is None:
            return 0.0, self._plain_rate, self.costs_s
        return costs.load_priced(load, self.drafters, self._max_k, self.config.min_gain)

    def _priced(self, drafter: str, signal: int, a: float | None = None,
                costs_s: Sequence[float] | None = None) -> tuple[list[float], Sequence[float]]:
        """(E_k, seconds of a round) for k = 0..max_k of ``drafter`` under ``signal``, the
        round's seconds by whole k ``costs_s`` (default: alone)."""
        if a is None:
            a = self.estimate(drafter, signal)
        if costs_s is None:
            costs_s = self.costs_s[drafter]
        if drafter == DRAFT_MODEL and self._stop_shares != (0.0, 0.0):
            return stopped_rounds(a, *self._stop_shares, costs_s, self._max_k)
        return progress_by_k(a, self._max_k), costs_s

    def observe(self, drafter: str, signal: int, num_proposed: int, accepted: int,
                probs: Sequence[float] = ()) -> None:
        """A round (or a shadowed proposal) of ``drafter`` under ``signal``: ``accepted``
        of ``num_proposed`` verified tokens matched, the first mismatch ending it if
        accepted < num_proposed. ``probs``: the draft model's probability of each
        proposed token, when its proposals stop on confidence (the first accepted + 1
        are used: those made from the true prefix)."""
        if probs and self.confidence > 0:
            self._confidence_samples += [(p, i < accepted) for i, p in enumerate(probs[:accepted + 1])]
            self.confidence = confidence_threshold(self._confidence_samples, self.config.draft_confidence)
            self._stop_shares = stop_shares(self._confidence_samples, self.confidence)
        if num_proposed == 0:
            return  # nothing proposed (prompt lookup found no match): nothing learned
        self._counts.add(drafter, signal, num_proposed, accepted)
        keep = self._keep
        # ``accepted`` successes then, maybe, one failure, each moving the estimate by recency
        miss = 1.0 - self.estimate(drafter, signal)
        rate = 1.0 - miss * keep ** accepted
        self.acceptance[drafter, signal] = rate * keep if accepted < num_proposed else rate

    def counts(self) -> tuple[AcceptanceCount, ...]:
        return self._counts.totals()
