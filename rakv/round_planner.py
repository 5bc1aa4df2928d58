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

from dataclasses import dataclass
from typing import Mapping

from rakv.cost_model import K_CHOICES, PairTimings, progress_by_k, round_s
from rakv.drafters import DRAFT_MODEL, NGRAM, ngram_prior

MAX_DRAFT_LENGTH = max(K_CHOICES)  # the longest round a planner drafts
SHADOW_LENGTH = MAX_DRAFT_LENGTH  # tokens of a shadowed drafter's proposal checked after each round


@dataclass(frozen=True)
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
    """Draft length k with one drafter, every round; shadows nothing."""

    shadowed: tuple[str, ...] = ()

    def __init__(self, drafter: str, k: int):
        self.drafter, self.k = drafter, k
        self.drafters = (drafter,) if k > 0 else ()
        self._counts = _Counts()

    def plan(self, signals: Mapping[str, int]) -> tuple[str, int]:
        return self.drafter, self.k

    def observe(self, drafter: str, signal: int, num_proposed: int, accepted: int) -> None:
        self._counts.add(drafter, signal, num_proposed, accepted)

    def counts(self) -> tuple[AcceptanceCount, ...]:
        return self._counts.totals()


@dataclass(frozen=True)
class RoundCosts:
    """Seconds of a plain step and, per drafter, of a round drafting k = 0..max_k tokens,
    at one context length (``round_costs``)."""

    step_s: float
    round_s: Mapping[str, tuple[float, ...]]


def round_costs(timings: PairTimings, drafters: tuple[str, ...], max_k: int, num_context: int) -> RoundCosts:
    return RoundCosts(round_s(timings, DRAFT_MODEL, 0, num_context),
                      {d: tuple(round_s(timings, d, k, num_context) for k in range(max_k + 1)) for d in drafters})


@dataclass(frozen=True)
class PlannerConfig:
    recency: float = 0.1  # weight of each new trial in the request's acceptance estimates
    max_k: int = MAX_DRAFT_LENGTH
    # Speculate only for a predicted gain over a plain step of at least this fraction. The
    # estimate that triggers a round is high because the last trials went well, and what
    # follows is usually worse (regression to the mean); the cost fit leaves out each
    # round's rollback and bookkeeping; and a losing round costs 2-3 steps on a CPU. On
    # the prompt-lookup bench, 0.05 let prose lose 4 % to ar.
    min_gain: float = 0.25

    def __post_init__(self):
        if not 0 < self.recency <= 1 or not 1 <= self.max_k <= MAX_DRAFT_LENGTH:
            raise ValueError(f"need 0 < recency <= 1 and 1 <= max_k <= {MAX_DRAFT_LENGTH}, "
                             f"got {self.recency}, {self.max_k}")


def initial_estimate(drafter: str, signal: int, drafter_estimate: float) -> float:
    """Acceptance under a signal never observed: prompt lookup's prior for the match
    length, or the drafter's overall estimate."""
    return ngram_prior(signal) if drafter == NGRAM else drafter_estimate


class AdaptiveRounds:
    """Each round: the (drafter, k) with the most expected tokens per second under the
    request's own acceptance estimate for each (drafter, signal). Ties go to the smaller
    k, then the earlier drafter.

    The signal splits one drafter's guesses by what is known before they are made:
    prompt lookup after a 3-gram match is right most of the time, after a 1-gram match
    rarely, and with no match it has nothing to propose (signal 0, acceptance 0). An
    unseen signal starts from the policy's running estimate for it, else from
    ``ngram_prior`` (prompt lookup) or the drafter's own estimate.
    Prompt lookup is shadowed whenever it is ready and not drafting: after each round the
    engine reports how much of its proposal the new tokens confirm, so a copy stretch is
    noticed after one step and the estimate decays again once it ends.
    """

    def __init__(self, drafters: tuple[str, ...], priors: Mapping[tuple[str, int], float],
                 fallback: Mapping[str, float], costs: "RoundCosts", config: PlannerConfig = PlannerConfig()):
        self.drafters = drafters
        self.config = config
        self.shadowed = tuple(d for d in drafters if d == NGRAM)
        self.acceptance = dict(priors)  # (drafter, signal) -> per-token acceptance, this request
        self.fallback = dict(fallback)  # per drafter, for a signal not seen before
        self.costs_s = costs.round_s  # per drafter: seconds of a round drafting k = 0..max_k tokens
        self.step_s = costs.step_s
        self._plain_rate = (1.0 + config.min_gain) / self.step_s  # the rate a round must beat
        # Per drafter, the acceptance at or below which none of its rounds can beat that
        # rate: E_k(a) < 1 / (1 - a) for every k, so a round's rate is below
        # 1 / ((1 - a) * its cheapest round). The 1e-9 keeps float rounding on the safe
        # side: this only skips work, every drafter above it is priced exactly.
        self._hopeless = {d: 1.0 - 1.0 / (self._plain_rate * min(self.costs_s[d][1:config.max_k + 1])) - 1e-9
                          for d in drafters}
        self._plain = (drafters[0] if drafters else DRAFT_MODEL, 0)
        self._keep = 1.0 - config.recency
        self._max_k = config.max_k
        self._counts = _Counts()

    def estimate(self, drafter: str, signal: int) -> float:
        if (drafter, signal) in self.acceptance:
            return self.acceptance[drafter, signal]
        return initial_estimate(drafter, signal, self.fallback[drafter])

    def plan(self, signals: Mapping[str, int]) -> tuple[str, int]:
        best_rate, best = self._plain_rate, self._plain
        for drafter in self.drafters:
            signal = signals[drafter]
            a = self.acceptance.get((drafter, signal))
            if a is None:  # kept: the same value ``estimate`` would give on every later call
                a = self.acceptance[drafter, signal] = self.estimate(drafter, signal)
            if a <= self._hopeless[drafter]:
                continue  # no round of this drafter can win (see __init__)
            costs = self.costs_s[drafter]
            progress = progress_by_k(a, self._max_k)
            beat = best_rate * (1 + 1e-9)
            for k in range(1, self._max_k + 1):
                rate = progress[k] / costs[k]
                if rate > beat:
                    best_rate, best, beat = rate, (drafter, k), rate * (1 + 1e-9)
        return best

    def observe(self, drafter: str, signal: int, num_proposed: int, accepted: int) -> None:
        """A round (or a shadowed proposal) of ``drafter`` under ``signal``: ``accepted``
        of ``num_proposed`` verified tokens matched, the first mismatch ending it if
        accepted < num_proposed."""
        if num_proposed == 0:
            return  # nothing proposed (prompt lookup found no match): nothing learned
        self._counts.add(drafter, signal, num_proposed, accepted)
        keep = self._keep
        # ``accepted`` successes then, maybe, one failure, each moving the estimate by recency
        a = self.acceptance.get((drafter, signal))
        miss = 1.0 - (a if a is not None else self.estimate(drafter, signal))
        rate = 1.0 - miss * keep ** accepted
        self.acceptance[drafter, signal] = rate * keep if accepted < num_proposed else rate

    def counts(self) -> tuple[AcceptanceCount, ...]:
        return self._counts.totals()
