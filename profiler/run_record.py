"""The runs phase of ``python -m profiler.record``: every policy end to end on a sample of
the recorded requests, in lockstep, each run checked token for token against the greedy
output and timed beside the machine's speed, with the ops grid's passes spread across
the runs (``profiler.record``'s docstring: the runs and decisions tables). The serving
phase is ``profiler.serve_record``'s.
"""
from __future__ import annotations

import sys
from typing import Callable

from profiler.run_noise import (EngineSnapshot, MachineSpeed, NoiseGuard, SlowRuns, forward_probe, mean_probe_s,
                                median_attempt, priced_s)
from profiler.schema import DecisionRow, RequestRow, RunRow
from profiler.trace_io import TraceWriter
from rakv.choices import ADAPTIVE_NAME, fixed_policy_names
from rakv.settings import DecisionInputs


def pass_starts(num_passes: int, num_rows: int) -> list[int]:
    """Before which of ``num_rows`` runs' requests (or served loads) each ops pass goes
    (``num_rows``: after the last), evenly from the first to after the last."""
    if num_passes == 1:
        return [0]
    return [round(i * num_rows / (num_passes - 1)) for i in range(num_passes)]


def passes_at(position: int, num_rows: int, num_passes: int, ops_pass: Callable[[int], None]) -> None:
    """The ops passes that go before row ``position`` of ``num_rows`` (``pass_starts``)."""
    for i, start in enumerate(pass_starts(num_passes, num_rows)):
        if start == position:
            ops_pass(i)


def sample_requests(requests: dict[int, RequestRow], count: int) -> list[RequestRow]:
    """The first ``count`` requests in workload order, plus the later turns of the
    conversations they belong to (a conversation's prefix reuse needs its earlier turns)."""
    chosen, groups = [], set()
    for row in sorted(requests.values(), key=lambda r: r.request_id):
        if len(chosen) < count or row.group_id in groups:
            chosen.append(row)
            groups.add(row.group_id)
    return chosen


def run_policies(pair, args) -> list[str]:
    """The policies of the runs phase (``--runs-policies``); a name that is neither a fixed
    policy nor ``rakv``, or one that needs a draft model the pair lacks, is a ValueError."""
    if args.runs_policies == "all":
        return list(fixed_policy_names(pair.draft is not None)) + ([args.policy] if args.policy != "none" else [])
    names = [name.strip() for name in args.runs_policies.split(",") if name.strip()]
    known = set(fixed_policy_names(pair.draft is not None)) | {ADAPTIVE_NAME}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"--runs-policies: {unknown[0] if unknown else 'nothing'} is not a policy the runs can "
                         f"record here; choose among {', '.join(sorted(known))}")
    return names


def record_runs(writer: TraceWriter, pair, requests: dict[int, RequestRow], inputs: DecisionInputs, args,
                progress, ops_pass: Callable[[int, Callable[[], None]], None] | None = None,
                num_passes: int = 1) -> None:
    """Every policy on the sample, each in its own engine (so hits come from the sample's
    own earlier requests), in lockstep: each request under every policy before the next,
    so drift in the machine's load falls on every policy alike. Every run and op first
    waits while a probe says the machine is in a slow phase; a run that its siblings
    say was slowed is timed again from the same state (``profiler.run_noise``). Each
    output is checked token for token against the greedy output. A resumed recording
    runs the recorded requests again (the engines' stores and the adaptive policy's
    state need them) and writes only the missing rows. ``ops_pass(i, wait)`` times the ops
    grid's repeat i of ``num_passes``, waiting with the given callable before each op; the
    passes go at ``pass_starts``."""
    from rakv.controller import make_policy
    from rakv.engine import Engine

    guard = NoiseGuard(args.runs_noise_tolerance, args.runs_max_attempts, args.runs_max_wait_s)
    slowed = SlowRuns(guard.tolerance)
    speed = MachineSpeed(forward_probe(pair.target), guard.tolerance, guard.max_wait_s)
    sample = sample_requests(requests, args.runs_sample)
    done_runs = writer.existing_keys("runs")
    done_decisions = writer.existing_keys("decisions")
    engines = {name: Engine(pair, make_policy(name, inputs.timings, inputs.controller), inputs.engine)
               for name in run_policies(pair, args)}
    bar = progress(total=len(sample) * len(engines), desc="runs", unit="run")
    num_repeated = 0

    def passes_before(position: int) -> None:  # the ops passes that go before request ``position``
        if ops_pass is not None:
            passes_at(position, len(sample), num_passes, lambda i: ops_pass(i, speed.wait))
    for index, row in enumerate(sample):
        passes_before(index)
        max_new = min(args.runs_max_new_tokens, row.max_new_tokens)
        prompt = list(row.prompt_ids)
        guarded = guard.max_attempts > 1 and any((row.request_id, name) not in done_runs for name in engines)
        snapshots, results, decisions = {}, {}, {}

        def timed(engine) -> tuple:  # (result, probe_s)
            before = speed.wait()
            result = engine.generate(prompt, max_new)
            return result, mean_probe_s(before, speed.probe())
        for name, engine in engines.items():
            snapshots[name] = EngineSnapshot(engine) if guarded else None
            decisions[name] = decision_before(engine, prompt, max_new)
            if (row.request_id, name) not in done_runs:
                results[name] = timed(engine)
            else:  # a resumed recording's written runs are not timed
                results[name] = engine.generate(prompt, max_new), None
            bar.update(1)
        ratios = {name: r.e2e_s / priced_s(r, inputs.timings) for name, (r, _) in results.items()}
        for name in slowed(ratios) if guarded else ():  # a resumed recording's rows are written
            attempts = [results[name]]
            for _ in range(guard.max_attempts - 1):
                snapshots[name].restore(engines[name])
                attempts.append(timed(engines[name]))
            results[name] = median_attempt(attempts)
            num_repeated += 1
        reference = list(row.output_ids[:max_new])
        for name, (result, probe_s) in results.items():
            if (row.request_id, name) not in done_runs:
                writer.append("runs", [run_row(row.request_id, name, max_new, result, reference, probe_s)])
            if decisions[name] is not None and (row.request_id, name) not in done_decisions:
                writer.append("decisions", [decision_row(row.request_id, name, decisions[name], result)])
    bar.close()
    passes_before(len(sample))  # after the last
    print(f"timed {num_repeated} of {len(sample) * len(engines)} runs again: their siblings said they were slowed; "
          f"{speed.summary()}", file=sys.stderr)


def decision_before(engine, prompt: list[int], max_new: int):
    """(features, acceptance estimates, predicted seconds by action) the adaptive policy
    decides the next request from; None for a fixed policy."""
    from rakv.controller import CostModelPolicy
    if not isinstance(engine.policy, CostModelPolicy):
        return None
    features, _, _ = engine.features(prompt, max_new)
    return features, dict(engine.policy.acceptance), {a: c for c, a in engine.policy.rank(features)}


def run_row(request_id: int, name: str, max_new: int, result, reference: list[int],
            probe_s: float | None = None) -> RunRow:
    action = result.action
    return RunRow(
        request_id=request_id, policy=name, r=action.r, drafter=action.drafter, k=action.k,
        max_new_tokens=max_new, hit_tokens=result.hit_tokens, reused_tokens=result.reused_tokens,
        hit_kind=result.hit_kind, ttft_s=result.ttft_s, e2e_s=result.e2e_s,
        num_output_tokens=len(result.output_ids), num_rounds=len(result.rounds),
        start_per_round=[r.start for r in result.rounds], drafter_per_round=[r.drafter for r in result.rounds],
        accepted_per_round=[r.accepted for r in result.rounds], k_per_round=[r.k for r in result.rounds],
        proposed_per_round=[r.num_proposed for r in result.rounds],
        identical_to_ar=list(result.output_ids) == reference, probe_s=probe_s)


def decision_row(request_id: int, name: str, decision, result) -> DecisionRow:
    features, acceptance, predicted = decision
    action = result.action
    return DecisionRow(
        request_id=request_id, policy=name, num_prompt_tokens=features.num_prompt_tokens,
        num_new_tokens=features.num_new_tokens, target_hit_tokens=features.target_hit_tokens,
        draft_hit_tokens=features.draft_hit_tokens, exact_repeat=features.exact_repeat,
        acceptance_draft=acceptance.get("draft", 0.0), acceptance_ngram=acceptance.get("ngram", 0.0),
        r=action.r, drafter=action.drafter, k=action.k, predicted_cost_s=predicted[action],
        measured_e2e_s=result.e2e_s)
