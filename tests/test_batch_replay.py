"""simulator.batch_replay: the engine's own scheduler over a serving trace's facts gives the
steps the batching engine ran, step for step, on a fresh recording (the tiny pair, under
several policies, a row budget that clips rounds and chunks prefills) and on the shipped
serving traces; a step that differs is named. simulator.step_costs prices a step from the
op grid; simulator.serve_sim runs a load on that clock; simulator.serve_validate reports
all three; bad input is one line."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from profiler.record import main as record
from profiler.serve_summary import load_latencies
from rakv.op_timing import OpRow
from simulator import serve_validate
from simulator.serve_sim import run_load
from simulator.step_costs import fit_forward, fit_step_costs, load_speeds
from simulator.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
SERVING_TRACES = sorted(p.name for p in TRACES.glob("*-serve*") if p.is_dir() and not p.name.startswith("."))
POLICIES = "ar,spec-k4,ngram-k4,joint-k4,rakv"
RATE = 300.0  # req/s: the tiny pair's steps take milliseconds, so arrivals land among running steps


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("replayed") / "tiny"
    assert record(["--pair", "tiny", "--workload", "fixture-chat", "--max-new-tokens", "16", "--grid", "serving",
                   "--skip", "runs", "--serve-requests", "6", "--max-num-seqs", "3", "--max-num-batched-tokens",
                   "12", "--serve-concurrency", "1,2,4", "--serve-rate", str(RATE), "--serve-policies", POLICIES,
                   "--out", str(out)]) == 0
    return load_trace(out)


def test_a_fresh_recording_replays_step_for_step(recorded):
    """Closed loops, and the open loop in its recorded admission order: each arrival
    submitted before the first step the recording started after it."""
    rows = serve_validate.validate_serving(recorded)
    loads = [f"c={c}" for c in (1, 2, 4)] + [f"rate={RATE:g}"]
    assert {(r.load, r.policy) for r in rows} == {(load, p) for load in loads for p in POLICIES.split(",")}
    for row in rows:
        assert row.steps.first_difference is None, (row.load, row.policy, row.steps.first_difference)
        assert row.steps.num_equal == row.steps.num_recorded > 0
    # the row budget of 12 clipped some rounds and split prefills: the replay reproduced those too
    steps = serve_validate.recorded_table(recorded, "steps")
    assert any(sum(row.rows) == 12 for rows in steps.values() for row in rows)


@pytest.mark.parametrize("name", SERVING_TRACES)
def test_the_shipped_serving_traces_replay_step_for_step(name):
    for row in serve_validate.validate_serving(load_trace(TRACES / name)):
        assert row.steps.first_difference is None, (name, row.load, row.policy, row.steps.first_difference)


def test_a_step_that_differs_is_named(recorded):
    (load, policy), rows = next(iter(serve_validate.recorded_table(recorded, "steps").items()))
    replayed = serve_validate.ServingReplay(recorded).replay(load, policy, None).steps
    assert serve_validate.compare_steps(rows, replayed).first_difference is None
    altered = list(rows)
    altered[3] = replace(rows[3], num_cached=tuple(c + 1 for c in rows[3].num_cached))
    check = serve_validate.compare_steps(altered, replayed)
    assert check.num_equal == 3 and check.first_difference.startswith("step 3: replayed")
    check = serve_validate.compare_steps(rows + rows[-1:], replayed)
    assert check.first_difference == f"{len(rows)} steps replayed, {len(rows) + 1} recorded"


def exact_seconds(b: int, r: int, c: int) -> float:
    """A forward of b requests of r rows after c positions on a grid timed exactly so."""
    return 0.1 + 0.01 * b * r + 0.002 * (b - 1) + 1e-6 * b * r * c


def exact_grid() -> list[OpRow]:
    """Batched points of 1, 2 and 4 requests of 1 and 2 rows after 128 and 512 positions,
    three repeats each, and prefills of 4 and 16 tokens, all at ``exact_seconds``."""
    ops = [OpRow("target", "batch", r, c, 0, 0, i, exact_seconds(b, r, c), num_requests=b)
           for b in (1, 2, 4) for r in (1, 2) for c in (128, 512) for i in range(3)]
    return ops + [OpRow("target", "prefill", n, 0, 0, 0, 0, exact_seconds(1, n, 0)) for n in (4, 16)]


def test_a_forward_is_priced_by_its_rows_requests_and_contexts():
    """On a grid whose times are rows, requests and positions exactly, a mixed step is priced exactly."""
    ops = exact_grid()
    forward = fit_forward(ops, "target")
    assert forward.per_request(1, 2) == pytest.approx(0.002) == forward.per_request(2, 4)
    assert forward.per_position == pytest.approx(1e-6)
    works = [(1, 100), (5, 300), (2, 40)]
    assert forward.seconds(works) == pytest.approx(0.1 + 0.01 * 8 + 0.002 * 2 + 1e-6 * (100 + 1500 + 80))
    costs = fit_step_costs(ops, [], [])
    assert costs.draft is None and costs.overhead.per_step_s == costs.overhead.per_work_s == 0.0


def test_a_prompt_row_is_priced_at_what_the_recorded_forwards_add_to_the_grid():
    """Steps that prefill ran their forwards 0.5 ms a prompt row above the grid's price (one
    step at 3 ms, an outlier the median leaves out): the fit prices a prompt row at that,
    the step's other rows as the grid does, and the overheads on what is left; with no
    forwards given, or forwards the grid prices exactly, nothing is added."""
    from rakv.scheduler import Composition
    ops = exact_grid()
    steps = [Composition((1, 2), ("prefill", "decode"), (n, 1), (0, 200), ("", ""), (0, 0)) for n in (4, 8, 16)]
    steps += [Composition((1, 2), ("decode", "decode"), (1, 1), (40, 200), ("", ""), (0, 0))] * 3
    grid = fit_step_costs(ops, [], [])
    forwards = [grid.forward_s(c) + (0.003 if i == 0 else 0.0005) * c.rows[0] * (c.kinds[0] == "prefill")
                for i, c in enumerate(steps)]
    costs = fit_step_costs(ops, steps, [f + 0.004 for f in forwards], forward_s=forwards)
    assert costs.overhead.per_prompt_row_s == pytest.approx(0.0005)
    assert [costs.forward_s(c) for c in steps[1:]] == pytest.approx(forwards[1:])
    assert costs.overhead.per_step_s + 2 * costs.overhead.per_work_s == pytest.approx(0.004, rel=0.01)
    for given in ((), [grid.forward_s(c) for c in steps]):
        assert fit_step_costs(ops, steps, forwards, forward_s=given).overhead.per_prompt_row_s == 0.0


def test_a_logits_row_no_grid_point_holds_is_priced_at_what_the_recorded_forwards_add():
    """The grid's 1- and 2-row points compute every row's logits, its prefills one: a
    verification of 9 or 17 rows after them has 8 or 16 logits rows the rows curve lacks,
    two requests of 17 rows 30 beyond the further request's points of 2 rows each. Steps
    whose forwards ran 3 ms a missing row above the grid fit 3 ms; a decode has none."""
    from rakv.scheduler import Composition
    ops = exact_grid()
    grid = fit_step_costs(ops, [], [])
    shapes = ((1, (9,)), (1, (17,)), (2, (17, 17)), (2, (1, 1)), (1, (2,)))
    assert [grid.target.unpriced_logits(b, sum(rows), sum(rows)) for b, rows in shapes] == [8, 16, 30, 0, 0]
    steps = [Composition(tuple(range(len(rows))), ("verify",) * len(rows), rows, (100,) * len(rows),
                         ("suffix",) * len(rows), tuple(r - 1 for r in rows))
             for rows in ((9,), (17,), (13,), (17, 17))]
    steps.append(Composition((0,), ("decode",), (1,), (100,), ("",), (0,)))
    forwards = [grid.forward_s(c) + 0.003 * grid.target.unpriced_logits(len(c.rows), sum(c.rows), sum(c.rows))
                for c in steps]
    costs = fit_step_costs(ops, steps, forwards, forward_s=forwards)
    assert costs.overhead.per_logits_row_s == pytest.approx(0.003)
    assert [costs.forward_s(c) for c in steps] == pytest.approx(forwards)

def test_a_grid_point_above_its_longer_contexts_is_taken_as_noise():
    """More cached positions never cost less: a point after the smallest context that
    measured above the same point after the largest is priced as that one (a Qwen
    ShareGPT grid: 1 x 1 at 82.8 ms after 128 positions, 72.6 after 512)."""
    def seconds(b, r, c):
        return 0.1 + 0.01 * b * r + 0.002 * (b - 1) + 1e-6 * b * r * c
    ops = [OpRow("target", "batch", r, c, 0, 0, i, seconds(b, r, c) * (1.2 if (b, r, c) == (1, 1, 128) else 1.0),
                 num_requests=b) for b in (1, 2) for r in (1, 2) for c in (128, 512) for i in range(3)]
    forward = fit_forward(ops, "target")
    assert forward.seconds([(1, 128)]) == pytest.approx(seconds(1, 1, 512), rel=1e-3)
    assert forward.seconds([(2, 128)]) == pytest.approx(seconds(1, 2, 128), rel=1e-3)


def test_a_further_request_costs_by_its_rows():
    """Where each further request in a forward costs more with more logits rows, the grid's
    batched points are priced exactly, a step between them by its mean logits rows, a step
    of more each than the grid holds at the grid's most, and a prefill chunk (one logits
    row at most) by the rows that compute logits."""
    def seconds(b, r, c):
        return 0.1 + 0.01 * b * r + (0.002 + 0.003 * r) * (b - 1) + 1e-6 * b * r * c
    ops = [OpRow("target", "batch", r, c, 0, 0, i, seconds(b, r, c), num_requests=b)
           for b in (1, 2, 4, 8) for r in (1, 2, 5) for c in (128, 512) for i in range(3)]
    ops += [OpRow("target", "prefill", n, 0, 0, 0, 0, seconds(1, n, 0)) for n in (16, 64)]
    forward = fit_forward(ops, "target")
    for b in (2, 4, 8):
        for r in (1, 2, 5):
            assert forward.seconds([(r, 128)] * b) == pytest.approx(seconds(b, r, 128))
    assert forward.seconds([(1, 0), (3, 0), (1, 0)]) == pytest.approx(0.1 + 0.05 + (0.002 + 0.003 * 5 / 3) * 2)
    assert forward.seconds([(40, 0), (1, 0)]) == pytest.approx(0.1 + 0.41 + 0.002 + 0.003 * 5)
    assert forward.seconds([(40, 0), (1, 0)], num_logits=2) == pytest.approx(0.1 + 0.41 + 0.002 + 0.003)
    from rakv.scheduler import Composition
    step = Composition((0, 1, 2), ("prefill", "decode", "verify"), (40, 1, 3), (0, 0, 0), ("", "", "ngram"), (0, 0, 2))
    assert fit_step_costs(ops, [], []).forward_s(step) == pytest.approx(forward.seconds([(40, 0), (1, 0), (3, 0)], 5))


def test_a_draft_round_first_catches_its_draft_cache_up():
    """The first draft forward of a step feeds each drafting request the rows its draft
    cache lacks (the replay's ``draft_rows``); the later ones one row each."""
    from rakv.scheduler import Composition
    ops = [OpRow(model, "batch", r, 128, 0, 0, i, 0.05 + 0.001 * r * b, num_requests=b)
           for model in ("target", "draft") for b in (1, 2) for r in (1, 2, 5) for i in range(3)]
    ops += [OpRow("draft", "prefill", n, 0, 0, 0, 0, 0.05 + 0.001 * n) for n in (16, 64)]
    costs = fit_step_costs(ops, [], [])
    step = Composition((0, 1), ("verify", "decode"), (4, 1), (128, 128), ("draft", ""), (3, 0))
    one_row = costs.propose_s(step)  # three forwards of one row
    assert one_row == pytest.approx(3 * costs.draft.rows(1))
    assert costs.propose_s(step, (40, 0)) == pytest.approx(costs.draft.rows(40) + 2 * costs.draft.rows(1))
    assert costs.seconds(step, (40, 0)) - costs.seconds(step) == pytest.approx(costs.draft.rows(40) - costs.draft.rows(1))


def test_a_load_runs_on_the_modelled_clock(recorded):
    """Each request's first token and finish fall at the end of the step that made them, on
    a clock that moves by each step's modelled seconds; an open loop idles to its arrivals."""
    loads = serve_validate.ServingReplay(recorded)
    steps = serve_validate.recorded_table(recorded, "steps")
    costs = fit_step_costs(recorded.ops, [], [])
    run = loads.replay("c=2", "ar", costs)
    ends, clock = [], 0.0
    for step in run.steps:
        clock += costs.seconds(step.composition, step.draft_rows)
        ends.append(clock)
    assert len(run.requests) == 6 and sorted(r.index for r in run.requests) == list(range(6))
    assert all(r.arrival_s <= r.first_token_s <= r.finish_s and r.finish_s in ends for r in run.requests)
    assert max(r.finish_s for r in run.requests) == pytest.approx(ends[-1])
    assert len(run.steps) == len(steps["c=2", "ar"])
    late = [0.0, 0.0, 0.0, 100.0, 100.0, 100.0]  # the second half arrives long after the first is done
    opened = run_load(loads.fresh("ar"), loads.requests, loads.max_new, costs, arrivals_s=late)
    assert all(r.first_token_s > 100.0 for r in opened.requests if r.index >= 3)
    with pytest.raises(ValueError, match="not both"):
        run_load(loads.fresh("ar"), loads.requests, loads.max_new, costs)
    with pytest.raises(ValueError, match="needs step costs"):
        run_load(loads.fresh("ar"), loads.requests, loads.max_new, None, arrivals_s=late)


def test_the_validation_reports_every_load(recorded, capsys):
    rows = serve_validate.validate_serving(recorded)
    assert len(rows) == 4 * len(POLICIES.split(","))  # three closed loops and an open one
    assert all(row.step_errors.step_mape is not None for row in rows)
    assert serve_validate.main(["--trace", str(TRACES / "smollm2-humaneval-serve")]) == 0
    out = capsys.readouterr().out
    for load in ("c=8", "rate=2"):  # every step reproduced, the open loop's in its recorded admission order
        assert re.search(rf"\| {load} \| rakv \| (\d+) of \1 \|", out), load
    # the shipped trace free-running: deterministic figures, a guard on the model, not the machine
    for row in serve_validate.validate_serving(load_trace(TRACES / "smollm2-humaneval-serve")):
        assert row.simulated.output_tok_per_s == pytest.approx(row.recorded.output_tok_per_s, rel=0.25)


def test_a_load_run_on_a_slow_machine_is_named_and_priced_at_its_speed(recorded, capsys):
    """Each load's probe against the loads' median: how much slower the machine ran it. The
    step costs are fitted at the usual speed, so a load timed 1.2x slower beside a probe
    1.2x slower fits as if it ran at the usual speed, and each load is priced at its own."""
    steps = serve_validate.recorded_table(recorded, "steps")
    assert all(rows[0].probe_s is not None for rows in steps.values())
    first, second = list(steps)[:2]
    usual = steps[first][0].probe_s

    def slowed(factor: float) -> dict:  # the second load run (and probed) ``factor`` times slower
        def scale(key):
            return factor if key == second else 1.0
        return {key: [replace(r, probe_s=usual * scale(key), seconds=r.seconds * scale(key),
                              forward_s=r.forward_s * scale(key)) for r in rows]
                for key, rows in steps.items()}
    speeds = load_speeds(slowed(1.2))
    assert speeds[first] == 1.0 and speeds[second] == pytest.approx(1.2)
    assert load_speeds({key: [replace(r, probe_s=None) for r in rows]
                        for key, rows in steps.items()}) == {}  # recorded before schema 1.5
    as_usual, slow = serve_validate.fit_serving_costs(recorded, slowed(1.0)), serve_validate.fit_serving_costs(
        recorded, slowed(1.2))
    assert slow.overhead.per_step_s == pytest.approx(as_usual.overhead.per_step_s, abs=1e-9)
    assert slow.overhead.per_work_s == pytest.approx(as_usual.overhead.per_work_s, abs=1e-9)
    assert slow.overhead.per_prompt_row_s == pytest.approx(as_usual.overhead.per_prompt_row_s, abs=1e-12)
    assert slow.overhead.per_logits_row_s == pytest.approx(as_usual.overhead.per_logits_row_s, abs=1e-12)
    step = serve_validate.replayed_steps(recorded, {second: steps[second]})[second][0]
    assert replace(slow, speed=1.2).seconds(step.composition) == pytest.approx(1.2 * slow.seconds(step.composition))
    assert serve_validate.main(["--trace", str(recorded.path)]) == 0
    assert "| the machine, slower % |" in capsys.readouterr().out


def test_a_load_is_also_replayed_at_its_own_pace(recorded, capsys):
    """A machine that slows during a load, which no probe before and after it sees: the
    load's steps' recorded seconds over their price is its pace, and the replay at that
    pace (out of sample) sets the replay's own error apart from the machine's."""
    steps = serve_validate.recorded_table(recorded, "steps")
    key = next(iter(steps))
    replayed = serve_validate.replayed_steps(recorded, {key: steps[key]})[key]
    costs = replace(serve_validate.fit_serving_costs(recorded, steps, key[0]), speed=load_speeds(steps)[key])
    pace = serve_validate.own_pace(costs, steps[key], replayed)
    assert pace > 0
    slowed = [replace(r, seconds=1.3 * r.seconds) for r in steps[key]]
    assert serve_validate.own_pace(costs, slowed, replayed) == pytest.approx(1.3 * pace)
    assert serve_validate.own_pace(costs, [], []) is None
    [row] = [r for r in serve_validate.validate_serving(recorded) if (r.load, r.policy) == key]
    assert row.pace == pytest.approx(pace)
    again = serve_validate.ServingReplay(recorded).replay(*key, replace(costs, speed=costs.speed * pace))
    assert row.at_pace == load_latencies(again.times())
    assert serve_validate.main(["--trace", str(recorded.path)]) == 0
    out = capsys.readouterr().out
    assert "| its steps, slower % |" in out and "| at its pace: TTFT |" in out
    assert re.search(r"out of sample at each load's own pace .* \d+\.$", out.rstrip())


def test_a_probed_load_replays_at_its_speed_as_serve_validate_prices_it(recorded, capsys):
    """``simulator.replay`` over a trace's own loads prices each recorded (load, policy) at
    the machine's speed as it ran, so its latencies are ``serve_validate``'s free-running
    ones; a sweep of its own at the same rate is priced at the usual speed."""
    from simulator.replay import main as replay_main
    speeds = load_speeds(serve_validate.recorded_table(recorded, "steps"))
    assert speeds and any(abs(s - 1.0) > 1e-6 for s in speeds.values())  # a real recording's probes differ
    assert replay_main(["--trace", str(recorded.path), "--as-recorded", "--policy", POLICIES, "--json"]) == 0
    got = {(r["load"], r["policy"]): r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    for row in serve_validate.validate_serving(recorded):
        assert got[row.load, row.policy]["ttft"] == asdict(row.simulated.ttft), (row.load, row.policy)
        assert got[row.load, row.policy]["e2e"] == asdict(row.simulated.e2e), (row.load, row.policy)


def test_again_sets_another_recording_of_the_loads_beside_this_one(recorded, capsys):
    """``--again``: each figure of another recording of the same loads against this one's,
    counted as the replay's are; a recording against itself agrees on every figure."""
    num_figures = 7 * len(serve_validate.validate_serving(recorded))
    assert serve_validate.main(["--trace", str(recorded.path), "--again", str(recorded.path)]) == 0
    out = capsys.readouterr().out
    assert "the same loads recorded again" in out and f"of {num_figures} in sample" in out
    assert out.rstrip().endswith(f"; the recording made again {num_figures}.")
    # the shipped trace's loads (rate=2 among them) are not all in the fixture's recording
    assert serve_validate.main(["--trace", str(TRACES / "smollm2-humaneval-serve"), "--again",
                                str(recorded.path)]) == 2
    err = capsys.readouterr().err
    assert "no recording of" in err and "rate=2" in err and len(err.strip().splitlines()) == 1


def test_a_trace_without_steps_is_a_one_line_error(capsys):
    assert serve_validate.main(["--trace", str(TRACES / "smollm2-chat")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no steps table" in err and len(err.strip().splitlines()) == 1


def test_loads_that_ran_the_same_steps_are_set_side_by_side():
    """The retrained policy drafted nothing at 4 and 8 in flight: its steps there are
    kv-only's, step for step, and their measured seconds are the machine's spread."""
    steps = serve_validate.recorded_table(load_trace(TRACES / "qwen-coder-chat-serve-learned"), "steps")
    same = {(s.load, s.policies): s for s in serve_validate.same_steps(steps)}
    assert set(same) == {("c=4", ("kv-only", "learned")), ("c=8", ("kv-only", "learned"))}
    c8 = same["c=8", ("kv-only", "learned")]
    assert c8.num_steps == len(steps["c=8", "learned"]) == 97
    assert c8.seconds == tuple(sum(r.seconds for r in steps["c=8", policy]) for policy in ("kv-only", "learned"))
    assert c8.apart == pytest.approx(c8.seconds[1] / c8.seconds[0] - 1) and c8.apart < -0.05


def test_a_resampled_recording_serves_repeats_and_replays_them_step_for_step(tmp_path):
    """``--serve-resample N``: N requests drawn with their prefix families from the
    recording's seed, repeats and all; the replay draws the same N and reproduces every
    step, and the store drafter drafts a repeat from the stored answer."""
    out = tmp_path / "resampled"
    assert record(["--pair", "tiny", "--workload", "fixture-chat", "--max-new-tokens", "12", "--grid", "serving",
                   "--skip", "runs", "--serve-requests", "4", "--serve-resample", "10", "--serve-concurrency", "2",
                   "--serve-rate", str(RATE), "--serve-policies", "ar,joint-suffix-k4", "--out", str(out)]) == 0
    trace = load_trace(out)
    served = serve_validate.recorded_table(trace, "served")
    assert set(served) == {(load, p) for load in ("c=2", f"rate={RATE:g}") for p in ("ar", "joint-suffix-k4")}
    ids = [row.request_id for row in served["c=2", "ar"]]
    assert len(ids) == 10 and len(set(ids)) < 10  # a family drawn twice
    replay = serve_validate.ServingReplay(trace)
    assert sorted(r.request_id for r in replay.requests) == sorted(ids)
    for row in serve_validate.validate_serving(trace):
        assert row.steps.first_difference is None, (row.load, row.policy, row.steps.first_difference)
    assert any(d == "suffix" and a > 0 for row in served["c=2", "joint-suffix-k4"]
               for d, a in zip(row.drafter_per_round, row.accepted_per_round))
