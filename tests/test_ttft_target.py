"""The TTFT target (``rakv.scheduler``, ``BatchConfig.ttft_target_s``): a waiting request
past it yields its turn to those still in time, first come first served within each, and
is admitted only in a lull (none in time waits or runs); a preempted request keeps its
place at the front; a request waiting in time bounds a round's step to half its time
left; the live engine admits by its arrivals and keeps every output its own greedy one;
a replay under a target serves every request once and a target nobody reaches changes
nothing; a recording under a target replays step for step; bad values are one-line
errors."""
from __future__ import annotations

import time

import pytest

from profiler.record import main as record
from rakv.batch_engine import BatchEngine
from rakv.controller import make_policy
from rakv.engine import Engine
from rakv.scheduler import PREFILL, BatchConfig, Scheduler, Seq
from simulator import serve_validate
from simulator.replay import main as replay
from simulator.serve_sim import run_load
from simulator.step_costs import fit_step_costs
from simulator.trace import load_trace


def _admitted(target_s: float | None, waiting: list[Seq], now_s: float,
              running: tuple[Seq, ...] = ()) -> list[int]:
    """The request ids a step admits, in order, from ``waiting`` beside ``running`` (seats
    and rows for all); each admitted request is marked late or not."""
    scheduler = Scheduler(BatchConfig(max_num_seqs=8, max_num_batched_tokens=256, ttft_target_s=target_s,
                                      max_num_prefills=8),
                          lambda seq: None, lambda seq: None, lambda: 0, lambda: False)
    scheduler.running.extend(running)
    for seq in waiting:
        scheduler.add(seq)
    first_admissions = [seq for seq in waiting if not seq.admitted]
    works = scheduler.schedule(now_s)
    admitted = [w for w in works if w.seq not in running]
    assert all(w.kind == PREFILL for w in admitted)
    assert all(w.seq.late == (target_s is not None and now_s - w.seq.arrival_s > target_s)
               for w in admitted if w.seq in first_admissions)
    return [w.seq.request_id for w in admitted]


def _seqs(arrivals_s: list[float]) -> list[Seq]:
    return [Seq(i, 4, 8, 1, num_tokens=4, prefill_end=4, arrival_s=a) for i, a in enumerate(arrivals_s)]


def test_a_request_past_the_target_yields_to_those_still_in_time():
    arrivals_s = [0.0, 1.0, 4.0, 4.5, 2.5]  # at 5 s, requests 0 and 1 have waited past 3 s
    assert _admitted(None, _seqs(arrivals_s), 5.0) == [0, 1, 2, 3, 4]  # no target: first come first served
    assert _admitted(3.0, _seqs(arrivals_s), 5.0) == [2, 3, 4]  # in time, FCFS; the late wait beside them
    assert _admitted(3.0, _seqs(arrivals_s), 1.0) == [0, 1, 2, 3, 4]  # none late yet
    assert _admitted(3.0, _seqs(arrivals_s), 99.0) == [0, 1, 2, 3, 4]  # all late, a lull: FCFS


def test_a_late_request_runs_only_in_a_lull():
    """A late request is admitted where no request admitted in time runs: beside late ones,
    or none."""
    in_time, late = _seqs([0.0, 0.0])
    in_time.admitted, late.admitted, late.late = True, True, True
    assert _admitted(3.0, _seqs([0.0, 1.0]), 5.0, running=(in_time,)) == []  # waits beside one in time
    assert _admitted(3.0, _seqs([0.0, 1.0]), 5.0, running=(late,)) == [0, 1]  # beside late ones: a lull
    assert _admitted(3.0, _seqs([0.0, 4.0]), 5.0, running=(in_time,)) == [1]  # one in time still comes in


def test_a_preempted_request_keeps_its_place_at_the_front():
    seqs = _seqs([0.0, 9.0])
    seqs[0].admitted = True  # admitted before (a preemption put it back at the front)
    assert _admitted(3.0, seqs, 10.0) == [0, 1]


class _Moves:
    """A planner walk that plans plain steps and records the loads it is shown."""

    def __init__(self, loads: list):
        self.loads = loads

    def plan_move(self, t, max_k=None, load=None):
        self.loads.append(load)
        return "", 0


def _bounds_shown(target_s: float | None, waiting_since_s: float, now_s: float) -> tuple[float, ...]:
    """The pace bounds a decoding request's round is shown beside one waiting request."""
    loads: list = []
    scheduler = Scheduler(BatchConfig(max_num_seqs=1, ttft_target_s=target_s), lambda seq: None,
                          lambda seq: None, lambda: 0, lambda: False)
    scheduler.running.append(Seq(0, 4, 8, 1, num_tokens=5, num_computed=4, prefill_end=4, moves=_Moves(loads),
                                 admitted=True))
    scheduler.add(Seq(1, 4, 8, 1, num_tokens=4, prefill_end=4, arrival_s=waiting_since_s))
    scheduler.schedule(now_s)
    return loads[0].pace_bounds_s


def test_a_request_waiting_in_time_bounds_the_step_to_half_its_time_left():
    assert _bounds_shown(3.0, 0.0, 1.0) == (1.0,)  # 2 s left: this step and its own prefill's within it
    assert _bounds_shown(3.0, 0.0, 3.5) == ()  # late: it bounds nothing
    assert _bounds_shown(None, 0.0, 1.0) == ()  # no target


def test_a_bad_target_is_a_one_line_error(capsys):
    with pytest.raises(ValueError, match="ttft_target_s must be above 0, got 0"):
        BatchConfig(ttft_target_s=0)
    assert replay(["--trace", "traces/qwen-coder-chat-serve", "--policy", "rakv", "--ttft-target", "-1"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--ttft-target must be 0 (none) or above, got -1" in err and "\n" not in err


def test_the_engine_admits_by_arrival_and_keeps_each_output_greedy(tiny_pair):
    """One seat: a request that arrived long ago waits behind one still in time, and each
    output is its batch-1 greedy one."""
    prompts = [tiny_pair.encode("def add(a, b):\n    return"), tiny_pair.encode("Once upon a time")]
    want = [Engine(tiny_pair, make_policy("ar")).generate(p, 8).output_ids for p in prompts]
    engine = BatchEngine(tiny_pair, make_policy("ar"), batch=BatchConfig(max_num_seqs=1, ttft_target_s=3.0))
    now_s = time.perf_counter()
    late = engine.submit(prompts[0], 8, arrival_s=now_s - 10.0)
    in_time = engine.submit(prompts[1], 8, arrival_s=now_s)
    assert engine.stats().num_waiting_late == 1 and engine.stats().num_late == 0
    first, outputs = [], {}
    while engine.has_work():
        for event in engine.step(now_s):
            if event.request_id not in first:
                first.append(event.request_id)
            if event.finished:
                outputs[event.request_id] = event.result.output_ids
    assert first == [in_time, late]
    assert [outputs[late], outputs[in_time]] == want
    assert engine.stats().num_waiting_late == 0 and engine.stats().num_late == 1


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The tiny pair at 300 req/s on one seat: a queue, its waits past a 5 ms target."""
    out = tmp_path_factory.mktemp("ttft") / "tiny"
    assert record(["--pair", "tiny", "--workload", "fixture-chat", "--max-new-tokens", "8", "--grid", "serving",
                   "--skip", "runs", "--serve-requests", "6", "--max-num-seqs", "1", "--max-num-batched-tokens",
                   "64", "--serve-rate", "300", "--serve-policies", "ar,rakv",
                   "--ttft-target", "0.005", "--out", str(out)]) == 0
    return load_trace(out)


def test_a_recording_under_a_target_replays_step_for_step(recorded):
    assert recorded.meta.config["ttft_target"] == 0.005
    rows = [row for row in serve_validate.validate_serving(recorded) if row.steps is not None]
    assert rows and all(row.steps.first_difference is None for row in rows)


def test_a_replay_under_a_target_serves_every_request_once(recorded):
    """On the modelled clock, one seat, two bursts of three: the second comes while the
    first request runs, and when it finishes the first burst has waited past the target
    and the second has not; a target nobody reaches is no target."""
    costs = fit_step_costs(recorded.ops, [], [])

    def served(target_s: float | None, arrivals_s: list[float]):
        loads = serve_validate.ServingReplay(recorded, ttft_target_s=target_s or 0)
        run = run_load(loads.fresh("rakv"), loads.requests, loads.max_new, costs, arrivals_s=arrivals_s)
        assert sorted(r.index for r in run.requests) == list(range(6))  # never lost, never duplicated
        return run

    def by_first(run) -> list[int]:
        return [r.index for r in sorted(run.requests, key=lambda r: r.first_token_s)]

    one_burst = served(None, [0.0] * 6)
    first_finish_s = min(r.finish_s for r in one_burst.requests)
    arrivals_s = [0.0] * 3 + [first_finish_s / 2] * 3
    fcfs, late = served(None, arrivals_s), served(0.75 * first_finish_s, arrivals_s)
    assert by_first(fcfs) == list(range(6))
    assert by_first(late)[:2] == [0, 3]
    assert {r.index: r.num_output_tokens for r in late.requests} == {r.index: r.num_output_tokens
                                                                     for r in fcfs.requests}
    unreached = served(1e6, arrivals_s)
    assert [s.composition for s in unreached.steps] == [s.composition for s in fcfs.steps]
