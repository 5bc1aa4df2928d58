"""simulator.batch_replay: the engine's own scheduler over a serving trace's facts gives the
steps the batching engine ran, step for step, on a fresh recording (the tiny pair, under
several policies, a row budget that clips rounds and chunks prefills) and on the shipped
serving traces; a step that differs is named. simulator.step_costs prices a step from the
op grid; simulator.serve_validate reports both; bad input is one line."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from profiler.record import main as record
from rakv.op_timing import OpRow
from simulator import batch_replay, serve_validate
from simulator.step_costs import fit_forward, fit_step_costs
from simulator.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
SERVING_TRACES = sorted(p.name for p in TRACES.glob("*-serve") if p.is_dir())
POLICIES = "ar,spec-k4,ngram-k4,joint-k4,rakv"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("replayed") / "tiny"
    assert record(["--pair", "tiny", "--workload", "fixture-chat", "--max-new-tokens", "16", "--grid", "serving",
                   "--skip", "runs", "--serve-requests", "6", "--max-num-seqs", "3", "--max-num-batched-tokens",
                   "12", "--serve-concurrency", "1,2,4", "--serve-policies", POLICIES, "--out", str(out)]) == 0
    return load_trace(out)


def test_a_fresh_recording_replays_step_for_step(recorded):
    checks = batch_replay.check_trace(recorded)
    assert {(c.load, c.policy) for c in checks} == {(f"c={c}", p) for c in (1, 2, 4) for p in POLICIES.split(",")}
    for check in checks:
        assert check.first_difference is None, (check.load, check.policy, check.first_difference)
        assert check.num_equal == check.num_recorded > 0
    # the row budget of 12 clipped some rounds and split prefills: the replay reproduced those too
    steps = batch_replay.recorded_steps(recorded)
    assert any(sum(row.rows) == 12 for rows in steps.values() for row in rows)


@pytest.mark.parametrize("name", SERVING_TRACES)
def test_the_shipped_serving_traces_replay_step_for_step(name):
    for check in batch_replay.check_trace(load_trace(TRACES / name)):
        assert check.first_difference is None, (name, check.load, check.policy, check.first_difference)


def test_a_step_that_differs_is_named(recorded):
    (load, policy), rows = next(iter(batch_replay.recorded_steps(recorded).items()))
    requests = list(recorded.requests[:6])
    config = recorded.meta.config
    replay = batch_replay.BatchReplay(
        batch_replay.resolve_policy(policy, recorded.inputs.timings, recorded.inputs.controller,
                                    recorded.target_namespace, recorded.draft_namespace, "tiny"),
        recorded.inputs, batch_replay.BatchConfig(int(config["max_num_seqs"]), int(config["max_num_batched_tokens"])),
        recorded.target_namespace, recorded.draft_namespace)
    replayed = batch_replay.replay_closed_loop(replay, requests, int(config["max_new_tokens"]), int(load[2:]))
    assert batch_replay._compare(load, policy, rows, replayed).first_difference is None
    altered = list(rows)
    altered[3] = replace(rows[3], num_cached=tuple(c + 1 for c in rows[3].num_cached))
    check = batch_replay._compare(load, policy, altered, replayed)
    assert check.num_equal == 3 and check.first_difference.startswith("step 3: replayed")
    check = batch_replay._compare(load, policy, rows + rows[-1:], replayed)
    assert check.first_difference == f"{len(rows)} steps replayed, {len(rows) + 1} recorded"


def test_a_forward_is_priced_by_its_rows_requests_and_contexts():
    """On a grid whose times are rows, requests and positions exactly, a mixed step is priced exactly."""
    def seconds(b, r, c):
        return 0.1 + 0.01 * b * r + 0.002 * (b - 1) + 1e-6 * b * r * c
    ops = [OpRow("target", "batch", r, c, 0, 0, i, seconds(b, r, c), num_requests=b)
           for b in (1, 2, 4) for r in (1, 2) for c in (128, 512) for i in range(3)]
    ops += [OpRow("target", "prefill", n, 0, 0, 0, 0, seconds(1, n, 0)) for n in (4, 16)]
    forward = fit_forward(ops, "target")
    assert forward.per_request == pytest.approx(0.002) and forward.per_position == pytest.approx(1e-6)
    works = [(1, 100), (5, 300), (2, 40)]
    assert forward.seconds(works) == pytest.approx(0.1 + 0.01 * 8 + 0.002 * 2 + 1e-6 * (100 + 1500 + 80))
    costs = fit_step_costs(ops, [], [])
    assert costs.draft is None and costs.overhead.per_step_s == costs.overhead.per_work_s == 0.0


def test_the_validation_reports_every_closed_loop_load(recorded, capsys):
    rows = serve_validate.validate_serving(recorded)
    assert len(rows) == 3 * len(POLICIES.split(","))
    for row in rows:
        assert row.first_difference is None and row.num_equal == row.num_steps
        assert row.in_sample.step_mape is not None and row.out_of_sample.step_mape is not None
    assert serve_validate.main(["--trace", str(TRACES / SERVING_TRACES[0])]) == 0
    out = capsys.readouterr().out
    assert "| c=8 | rakv |" in out and "steps reproduced" in out


def test_a_trace_without_steps_is_a_one_line_error(capsys):
    assert serve_validate.main(["--trace", str(TRACES / "smollm2-chat")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no steps table" in err and len(err.strip().splitlines()) == 1
