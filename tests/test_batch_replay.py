"""simulator.batch_replay: the engine's own scheduler over a serving trace's facts gives the
steps the batching engine ran, step for step, on a fresh recording (the tiny pair, under
several policies, a row budget that clips rounds and chunks prefills) and on the shipped
serving traces; a step that differs is named; bad input is one line."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from profiler.record import main as record
from simulator import batch_replay
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


def test_a_trace_without_steps_is_a_one_line_error(capsys):
    assert batch_replay.main(["--trace", str(TRACES / "smollm2-chat")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no steps table" in err and len(err.strip().splitlines()) == 1


def test_the_command_line_reports_each_load(capsys):
    assert batch_replay.main(["--trace", str(TRACES / SERVING_TRACES[0])]) == 0
    out = capsys.readouterr().out
    assert "c=8" in out and "every step reproduced" in out
