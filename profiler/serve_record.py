"""Serving under load, recorded: the batching engine (``rakv.batch_engine``) driven at a
fixed concurrency or at Poisson arrivals, each request and each step written to the
``served`` and ``steps`` tables (``profiler.schema``).

A load is ``c=N`` (closed loop: N requests in flight, the next submitted when one
finishes, in request order) or ``rate=R`` (open loop: Poisson arrivals at R requests/s,
from the workload seed's arrival stream, each submitted at the first step boundary after
it arrives, as a server's engine thread takes it). Each (load, policy) runs in a fresh
engine with an empty store, after an untimed warm-up, on the requests the recording's
requests table holds (their prompts, token caps and greedy outputs): every served output
is checked against its greedy output (``identical_to_ar``). A learned policy is served
from a copy in the trace (``pinned_policy``), which its replays read.

Invariants: a (load, policy) is written whole, its steps before its requests, each table
flushed at once; a resumed recording skips the (load, policy) pairs whose requests are
written (so a crash mid-load runs that load again from its start) and writes no step
twice. Times are seconds from the load's start on ``time.perf_counter``.
"""
from __future__ import annotations

import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from profiler.arrivals import arrivals_s
from profiler.run_noise import MachineSpeed, mean_probe_s
from profiler.schema import RequestRow, ServedRow, StepRow, policy_copy_dir


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # closed loop
    rate_per_s: float | None = None  # open loop, Poisson

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate_per_s:g}"

    @property
    def value(self) -> float:
        """Its number: the concurrency of a closed loop, the rate of an open one."""
        return self.concurrency if self.concurrency is not None else self.rate_per_s

    @classmethod
    def of_label(cls, label: str) -> "Load":
        """The load a ``label`` names, ``c=N`` or ``rate=R`` (as a trace's rows and a
        replay's results hold it)."""
        kind, _, value = label.partition("=")
        if kind not in ("c", "rate"):
            raise ValueError(f"a load is c=N or rate=R, got {label!r}")
        return cls(concurrency=int(value)) if kind == "c" else cls(rate_per_s=float(value))


def loads_of(concurrencies: tuple[float, ...] = (), rates: tuple[float, ...] = ()) -> list[Load]:
    return [Load(concurrency=int(c)) for c in concurrencies] + [Load(rate_per_s=r) for r in rates]


@dataclass(frozen=True)
class ServedLoad:
    requests: list[ServedRow]
    steps: list[StepRow]


def serve_load(engine, requests: list[RequestRow], load: Load, policy_name: str, seed: int = 0,
               progress=None) -> ServedLoad:
    """Serve ``requests`` on ``engine`` (a ``BatchEngine``, empty) under ``load``; every
    request and step as rows. ``progress``: a tqdm-like bar, updated per finished request."""
    arrivals = arrivals_s(len(requests), load.rate_per_s, seed) if load.rate_per_s is not None else None
    pending = deque(range(len(requests)))
    submitted: dict[int, tuple[int, float, float]] = {}  # engine id -> (index, arrival_s, submitted_s)
    served: list[ServedRow] = []
    steps: list[StepRow] = []
    start = time.perf_counter()

    def submit(index: int, arrival_s: float) -> None:
        row = requests[index]
        request_id = engine.submit(list(row.prompt_ids), row.max_new_tokens, arrival_s=start + arrival_s)
        submitted[request_id] = (index, arrival_s, time.perf_counter() - start)

    while pending or engine.has_work():
        now = time.perf_counter() - start
        if arrivals is None:
            while pending and len(submitted) - len(served) < load.concurrency:
                submit(pending.popleft(), now)
        else:
            while pending and arrivals[pending[0]] <= now:
                index = pending.popleft()
                submit(index, arrivals[index])
            if not engine.has_work():
                time.sleep(max(arrivals[pending[0]] - now, 0.0))  # idle until the next arrival
                continue
        # the step starts at the boundary its submissions were judged at: a replay admits
        # those arrivals, and only those, before it (and judges a TTFT target's waits there)
        events = engine.step(start + now)
        steps.append(StepRow(load.label, policy_name, len(steps), now, **asdict(engine.last_step)))
        for event in (e for e in events if e.finished):
            index, arrival_s, submitted_s = submitted[event.request_id]
            served.append(served_row(load.label, policy_name, requests[index], event.result, arrival_s, submitted_s))
            if progress is not None:
                progress.update(1)
    return ServedLoad(served, steps)


def served_row(load: str, policy: str, request: RequestRow, result, arrival_s: float,
               submitted_s: float) -> ServedRow:
    """``result`` (a ``RequestResult``, timed from its submission) as a row timed from the
    load's start."""
    action, rounds = result.action, result.rounds
    return ServedRow(
        load=load, policy=policy, request_id=request.request_id, arrival_s=arrival_s,
        admitted_s=submitted_s + result.queue_s, first_token_s=submitted_s + result.ttft_s,
        finish_s=submitted_s + result.e2e_s, num_preemptions=result.num_preemptions, r=action.r,
        drafter=action.drafter, k=action.k, hit_tokens=result.hit_tokens, reused_tokens=result.reused_tokens,
        output_ids=result.output_ids, identical_to_ar=tuple(result.output_ids) == tuple(request.output_ids),
        start_per_round=[r.start for r in rounds], drafter_per_round=[r.drafter for r in rounds],
        accepted_per_round=[r.accepted for r in rounds], k_per_round=[r.k for r in rounds],
        proposed_per_round=[r.num_proposed for r in rounds])


def pinned_policy(trace_dir: Path, name: str, pair: str) -> str:
    """The name to serve ``name`` by: a learned policy is copied into the trace first
    (``profiler.schema.policy_copy_dir``; whole, then renamed into place, and a resumed
    recording keeps the copy it began with) and served from the copy; any other name as
    it is."""
    from rakv.policies import LEARNED, policy_path
    source = policy_path(name, pair)
    if source is None:
        return name
    copy = policy_copy_dir(trace_dir, name)
    if not copy.is_dir():
        part = copy.with_name(copy.name + ".partial")
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(source, part)
        part.rename(copy)
    return f"{LEARNED}={copy}"


def record_serving(writer, pair, requests: list[RequestRow], inputs, batch, loads: list[Load],
                   policies: list[str], seed: int, progress,
                   before_load: Callable[[int, int], None] | None = None,
                   speed: MachineSpeed | None = None) -> None:
    """Every load under every policy (a name ``rakv.policies.resolve_policy`` takes: fixed,
    ``rakv`` or learned), each in a fresh ``BatchEngine`` with
    ``batch`` (a ``BatchConfig``) and the recording's decision inputs; the (load, policy)
    pairs already written are skipped. A request whose served output differs from its
    greedy output is reported on stderr (it would be a bug: batching never changes a token).
    ``before_load(i, n)`` goes before the i-th of the n (load, policy) pairs to serve, and
    once more after the last (i = n): the recorder's ops passes, spread across the loads.
    ``speed``: before each load, wait while it says the machine is in a slow phase
    (``MachineSpeed.wait``); the mean of that probe and one right after the load is every
    step's ``probe_s``, the machine's speed while the load ran."""
    from rakv.batch_engine import BatchEngine
    from rakv.policies import resolve_policy

    done = {(load, policy) for load, policy, _ in writer.existing_keys("served")}
    written_steps = writer.existing_keys("steps")

    def engine_for(name: str) -> BatchEngine:
        policy = resolve_policy(pinned_policy(writer.trace_dir, name, pair.name), inputs.timings, inputs.controller,
                                pair.target_fingerprint, pair.draft_fingerprint, pair.name)
        return BatchEngine(pair, policy, inputs.engine, batch, timings=inputs.timings)
    todo = [(load, name) for load in loads for name in policies if (load.label, name) not in done]
    if todo:  # warm-up, untimed: the first steps of a process pay for lazy setup
        engine_for(policies[0]).run([(list(r.prompt_ids), min(r.max_new_tokens, 8)) for r in requests[:2]])
    for position, (load, name) in enumerate(todo):
        if before_load is not None:
            before_load(position, len(todo))
        engine = engine_for(name)
        before_s = speed.wait() if speed is not None else None
        bar = progress(total=len(requests), desc=f"served {load.label} {name}", unit="request")
        result = serve_load(engine, requests, load, name, seed, bar)
        bar.close()
        probe_s = mean_probe_s(before_s, speed.probe() if speed is not None else None)
        writer.append("steps", [replace(s, probe_s=probe_s) for s in result.steps
                                if (s.load, s.policy, s.step) not in written_steps])
        writer.flush()
        writer.append("served", result.requests)
        writer.flush()
        differ = sum(not r.identical_to_ar for r in result.requests)
        if differ:
            print(f"warning: served {load.label} {name}: {differ} of {len(result.requests)} outputs differ from "
                  "their greedy outputs", file=sys.stderr)
    if before_load is not None:
        before_load(len(todo), len(todo))  # after the last
