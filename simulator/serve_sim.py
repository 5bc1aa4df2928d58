"""Serving under load, simulated: the batched replay's steps (``simulator.batch_replay``)
on a clock, each priced by ``simulator.step_costs``. Imports no torch.

The loop is the engine's as ``profiler.serve_record`` drives it: before each step, the
requests that have arrived are submitted (a closed loop ``c=N`` submits in request order
while fewer than N are in flight; an open loop ``rate=R`` submits every request whose
arrival time has passed, on the modelled clock or, replaying a recording step for step, by
its recorded step starts, and idles to the next arrival when nothing runs); the step runs
and the clock moves by its modelled seconds; a request's first token and its finish are
at the end of the step that made them. Between steps the engine spent under a millisecond
on the recorded traces (the scheduling and admissions), which is left out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from simulator.batch_replay import BatchReplay
from simulator.step_costs import StepCosts
from simulator.trace import RecordedRequest


@dataclass(frozen=True)
class TimedRequest:
    """One request as simulated; times from the load's start."""

    index: int  # its place in the load's requests (submission order in a closed loop)
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_output_tokens: int
    num_reused_tokens: int = 0  # prompt positions it reused from the store


@dataclass(frozen=True)
class LoadRun:
    steps: list  # ReplayedStep, in order
    requests: list[TimedRequest]  # in finish order

    def times(self) -> list[tuple[float, float, float, int]]:
        """(arrival, first token, finish, output tokens) per request, as
        ``profiler.serve_summary.load_latencies`` takes them."""
        return [(r.arrival_s, r.first_token_s, r.finish_s, r.num_output_tokens) for r in self.requests]


def run_load(replay: BatchReplay, requests: list[RecordedRequest], max_new_tokens: int,
             costs: StepCosts | None, concurrency: int | None = None,
             arrivals_s: list[float] | None = None, step_starts_s: Sequence[float] | None = None) -> LoadRun:
    """``requests`` served by ``replay`` (fresh) at a fixed ``concurrency`` (closed loop)
    or at ``arrivals_s`` (open loop, one time per request); each step priced by ``costs``
    (None: no clock, every time 0; a closed loop's steps do not depend on it).
    ``step_starts_s``: an open loop's recorded steps' start times, its admission order:
    before step n the requests that had arrived by the recorded step n's start are
    submitted, whatever the modelled clock says, so the recorded steps are the replay's
    (past them, the modelled clock admits)."""
    if (concurrency is None) == (arrivals_s is None):
        raise ValueError("give a concurrency or arrival times, not both")
    if arrivals_s is not None and costs is None and step_starts_s is None:
        raise ValueError("an open loop needs step costs or the recorded step starts: its arrivals meet the steps "
                         "in time")
    pending = deque(range(len(requests)))
    index_of: dict[int, int] = {}  # the replay's request id -> index in requests
    arrival: dict[int, float] = {}
    first: dict[int, float] = {}
    steps, timed = [], []
    clock = 0.0

    def submit(index: int, at_s: float) -> None:
        request_id = replay.submit(requests[index], max_new_tokens, at_s)
        index_of[request_id], arrival[request_id] = index, at_s

    while pending or replay.has_work():
        admit_s = clock
        if arrivals_s is None:
            while pending and len(arrival) - len(timed) < concurrency:
                submit(pending.popleft(), clock)
        else:
            admit_s = (step_starts_s[len(steps)] if step_starts_s is not None and len(steps) < len(step_starts_s)
                       else clock)
            if not replay.has_work():  # idle until the next arrival
                clock = max(clock, arrivals_s[pending[0]])
                admit_s = max(admit_s, clock)
            while pending and arrivals_s[pending[0]] <= admit_s:
                index = pending.popleft()
                submit(index, arrivals_s[index])
        step = replay.step(admit_s)  # the step boundary its admissions were judged at
        steps.append(step)
        if costs is not None:
            clock += costs.seconds(step.composition, step.draft_rows)
        for request_id in step.first_tokens:
            first[request_id] = clock
        for request_id, num_output, reused in step.finished:
            timed.append(TimedRequest(index_of[request_id], arrival[request_id], first[request_id], clock,
                                      num_output, reused))
    return LoadRun(steps, timed)
