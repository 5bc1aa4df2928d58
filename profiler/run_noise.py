"""Guarding the runs table against a busy machine: a run that something else on the
machine slowed is timed again, from the same engine state, and the median attempt is kept.

Which runs were slowed? The runs of one request under every policy (its *siblings*, run
in lockstep) did different work, so their times are compared after dividing each by the
calibrated price of the work it did (``priced_s``: its prefill, plain steps and rounds).
The calibration prices some policies' work a little high or low, the same way on every
request, so each policy's ratio is compared with the siblings' median times what that
policy's ratio usually is (its median over the earlier requests, ``SlowRuns``). A run
more than ``tolerance`` above that is an outlier (noise only ever adds time). It is run
again from a snapshot of its engine taken before it, up to ``max_attempts`` times in
all, and the attempt with the median end-to-end time is kept.

Siblings cannot tell a slow phase of the whole machine: a shared host runs for seconds
to minutes at 1.3-1.5x its usual times (a 16-token prefill measured 66 and 132 ms in one
recording's ops passes, docs/results.md section 2), and every sibling timed in it is
slowed alike. So before every run and every op, ``MachineSpeed`` times a
short probe (one forward of the target) and waits while it is slower than usual. What
a wait lets through, the probes still see (a phase 10 % slower is within the tolerance),
so each timing is stored beside the probe's seconds (``probe_s``): the simulator prices
ops and compares runs at the recording's usual speed (``simulator.costs.at_usual_speed``).

Invariant: an engine's decisions are functions of the tokens and its settings, never of
time, so every attempt makes the same decisions, rounds, output and store contents, and
the engine after a repeat is the engine after the first attempt.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from statistics import median
from typing import Callable

from rakv.cost_model import PairTimings, round_s


@dataclass(frozen=True)
class NoiseGuard:
    tolerance: float = 0.15  # a run this much slower than its siblings' median, per priced second, is repeated
    max_attempts: int = 3  # attempts in all, the first included; 1: never repeat
    max_wait_s: float = 120.0  # the longest wait for a slow machine before a timing; 0: never probe nor wait

    def __post_init__(self):
        if self.tolerance <= 0 or self.max_attempts < 1 or self.max_wait_s < 0:
            raise ValueError(f"need a positive tolerance, at least 1 attempt and a wait of 0 s or more, got "
                             f"{self.tolerance}, {self.max_attempts}, {self.max_wait_s}")


def priced_s(result, timings: PairTimings) -> float:
    """The calibrated seconds of the work a run did (``rakv.engine.RequestResult``): the
    target's prefill of what it did not reuse, then every plain step and round, at the
    context halfway through the output."""
    n = result.num_prompt_tokens
    context = n + len(result.output_ids) // 2
    total = timings.target.prefill_s(n - result.reused_tokens, result.reused_tokens)
    advanced = 1 + sum(r.accepted + 1 for r in result.rounds)
    for r in result.rounds:
        total += round_s(timings, r.drafter, max(r.num_proposed, 1), context)
    total += max(len(result.output_ids) - advanced, 0) * timings.target.step_s(context)
    return total


class SlowRuns:
    """Picks the slowed runs of each request, learning from earlier requests how each
    policy's time usually compares with its siblings' (a calibration that misprices one
    policy's work must not make every one of its runs look slowed)."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance
        self._usual: dict[str, list[float]] = {}  # policy -> its unslowed runs' ratio over their siblings' median

    def __call__(self, ratios: dict[str, float]) -> list[str]:
        """The names whose seconds per priced second exceed the siblings' median times
        their usual share by more than ``tolerance`` (none with fewer than 3 siblings:
        no median to trust)."""
        if len(ratios) < 3:
            return []
        middle = median(ratios.values())
        slow = [name for name, ratio in ratios.items()
                if ratio > middle * median(self._usual.get(name) or [1.0]) * (1 + self.tolerance)]
        for name, ratio in ratios.items():
            if name not in slow:
                self._usual.setdefault(name, []).append(ratio / middle)
        return slow


class EngineSnapshot:
    """An engine's state between requests (its store's index and its policy), to run a
    request again from. Stored tensors are never mutated, so they are shared, not copied."""

    def __init__(self, engine):
        self._memo = {id(entry.payload): entry.payload for entry in engine.store.index.entries()}
        self._state = copy.deepcopy((engine.store.model, engine.policy, engine.num_requests), dict(self._memo))

    def restore(self, engine) -> None:
        engine.store.model, engine.policy, engine.num_requests = copy.deepcopy(self._state, dict(self._memo))


def median_attempt(attempts: list[tuple]) -> tuple:
    """The (result, probe seconds) attempt whose result has the median end-to-end time (the
    lower middle of an even count)."""
    ordered = sorted(attempts, key=lambda a: a[0].e2e_s)
    return ordered[(len(ordered) - 1) // 2]


def mean_probe_s(before: float | None, after: float | None) -> float | None:
    """A run's ``probe_s``: the mean of the probes on either side of it, None if unprobed."""
    return None if before is None or after is None else (before + after) / 2


class MachineSpeed:
    """The machine's speed now against its usual, from ``probe`` (seconds of a fixed piece
    of work), probed where a timing is about to start. Usual: the median of the first probe
    before each timing (most fall in the usual phase, so a recording that starts in a slow
    phase learns the usual one once it comes; a wait's own probes would drag it into the
    phase waited out); nothing counts as slow before ``num_first`` timings. Slow:
    two probes in a row more than ``tolerance`` above usual (the first after a run can be
    cold: a small model's weights left the cache). A wait keeps probing, never sleeps: an
    idle core comes back cold and slow, which a tiny model's probe reads as a slow phase."""

    def __init__(self, probe: Callable[[], float], tolerance: float, max_wait_s: float, num_first: int = 5,
                 clock: Callable[[], float] = time.monotonic):
        self._probe, self._clock = probe, clock
        self.tolerance, self.max_wait_s, self.num_first = tolerance, max_wait_s, num_first
        self.probes_s: list[float] = []  # the first probe before each timing
        self.waited_s = 0.0
        self.num_waits = 0  # times the machine was found slow before timing
        self.num_unsettled = 0  # waits that ran out with the machine still slow
        self.last_s: float | None = None  # the latest probe's seconds

    def usual_s(self) -> float:
        return median(self.probes_s)

    def probe(self) -> float | None:
        """The machine's speed now (seconds of the probe), outside the usual's sample; None
        when not probing (``max_wait_s`` 0)."""
        if not self.max_wait_s:
            return None
        self.last_s = self._probe()
        return self.last_s

    def _probe_is_slow(self, first: bool) -> bool:
        seconds = self.last_s = self._probe()
        if first:
            self.probes_s.append(seconds)
        return len(self.probes_s) > self.num_first and seconds > self.usual_s() * (1 + self.tolerance)

    def is_slow(self, first: bool = False) -> bool:
        """Is the machine more than ``tolerance`` slower than usual now? ``first``: the first
        look before a timing, which joins the usual's sample."""
        return self._probe_is_slow(first) and self._probe_is_slow(False)

    def wait(self) -> float | None:
        """Returns once the machine is at its usual speed, or after ``max_wait_s`` (then the
        timing goes ahead: the siblings' guard still sees a run slowed alone), with the
        last probe's seconds: the speed the timing starts at. With ``max_wait_s`` 0 it
        returns None at once, probing nothing."""
        if not self.max_wait_s:
            return None
        if not self.is_slow(first=True):
            return self.last_s
        self.num_waits += 1
        start = self._clock()
        while self.is_slow():
            if self._clock() - start >= self.max_wait_s:
                self.num_unsettled += 1
                break
        self.waited_s += self._clock() - start
        return self.last_s

    def summary(self) -> str:
        if not self.max_wait_s:
            return "the machine's speed was not probed"
        return (f"the machine was slower than usual before {self.num_waits} timings: waited {self.waited_s:.0f} s"
                + (f", {self.num_unsettled} times in vain" if self.num_unsettled else ""))


def forward_probe(model, num_tokens: int = 8, min_s: float = 0.01) -> Callable[[], float]:
    """Seconds per no-cache forward of ``num_tokens`` fixed tokens, over as many forwards as
    fill ``min_s`` (a small model's millisecond is mostly timer noise): the same weights
    streamed as in a decode step, so it slows as the runs do."""
    import torch
    ids = torch.arange(1, num_tokens + 1, device=model.device)[None]  # [1, num_tokens]

    @torch.inference_mode()
    def probe() -> float:
        start, num_forwards = time.perf_counter(), 0
        while (elapsed := time.perf_counter() - start) < min_s or not num_forwards:
            model(input_ids=ids, use_cache=False)
            num_forwards += 1
        return elapsed / num_forwards
    return probe
