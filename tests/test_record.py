"""profiler.record end to end on the tiny pair: tables, exact acceptance replay of every
recorded run, SIGKILL mid-recording then --resume without duplicates, one-line errors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.record import main
from profiler.schema import KEY_COLUMNS, table_to_rows
from profiler.trace_io import final_path, parts_dir, read_meta, read_table
from rakv.acceptance import replay_request
from rakv.drafters import RunLengths
from rakv.round_planner import FixedRounds

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--pair", "tiny", "--workload", "fixture-chat", "--runs-sample", "3", "--runs-max-new-tokens", "12",
        "--max-new-tokens", "24"]


def rows(trace, table):
    return table_to_rows(table, read_table(trace, table))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "tiny"
    assert main(FAST + ["--out", str(out)]) == 0
    return out


def test_tables_and_metadata(trace):
    for table in ("requests", "ops", "runs", "decisions"):
        assert final_path(trace, table).is_file() and not parts_dir(trace, table).exists()
    meta = read_meta(trace)
    assert meta.config["pair"] == "tiny" and meta.models["target"] and meta.hardware["python"]
    requests = rows(trace, "requests")
    assert len(requests) == 6
    assert {r.drafter for r in requests[0].run_lengths} == {"ngram", "draft"}
    ops = {(r.model, r.op) for r in rows(trace, "ops")}
    assert {("target", "prefill"), ("target", "decode"), ("target", "verify"), ("draft", "verify"),
            ("store", "clone"), ("store", "lookup"), ("store", "insert"), ("ngram", "propose")} <= ops
    decisions = rows(trace, "decisions")
    assert decisions and all(d.policy == "rakv" and d.predicted_cost_s > 0 for d in decisions)


def test_every_run_is_identical_and_replays_exactly(trace):
    requests = {r.request_id: r for r in rows(trace, "requests")}
    runs = rows(trace, "runs")
    assert len({(r.r, r.drafter, r.k) for r in runs if r.policy != "rakv"}) == 22  # every fixed action
    assert all(r.identical_to_ar for r in runs)
    assert {"miss", "partial"} <= {r.hit_kind for r in runs}
    checked = 0
    for run in runs:
        request = requests[run.request_id]
        lengths = {d.drafter: RunLengths(d.run_lengths, d.proposal_lengths, [0] * len(d.run_lengths))
                   for d in request.run_lengths}  # a fixed policy's rounds ignore the signal
        rounds = list(zip(run.start_per_round, run.drafter_per_round, run.k_per_round,
                          run.proposed_per_round, run.accepted_per_round))
        for start, drafter, k, proposed, accepted in rounds:  # every policy, rakv included
            at = lengths[drafter]
            assert (proposed, accepted) == (min(k, at.proposed[start]), min(k, at.runs[start]))
        if run.policy != "rakv":  # a fixed policy's rounds replay from its action alone
            expected = replay_request(FixedRounds(run.drafter, run.k), lengths, run.num_output_tokens,
                                      min(12, request.max_new_tokens))
            assert rounds == [(r.start, r.drafter, r.k, r.num_proposed, r.accepted) for r in expected]
        checked += run.num_rounds
    assert checked > 50


def test_sigkill_then_resume_has_no_duplicates(tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "profiler.record", *FAST, "--out", str(out), "--flush-rows", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs_parts = parts_dir(out, "runs")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(runs_parts.glob("part-*.parquet"))) < 3:
        assert proc.poll() is None, "the recording finished before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    flushed = rows(out, "runs")  # the interrupted trace reads, with every flushed part
    assert len(flushed) >= 3 and len(rows(out, "requests")) == 6
    assert not final_path(out, "runs").exists()

    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for table in ("requests", "ops", "runs", "decisions"):
        data = rows(out, table)
        keys = [tuple(getattr(r, c) for c in KEY_COLUMNS[table]) for r in data]
        assert len(keys) == len(set(keys)), f"duplicate {table} rows after resume"
        assert final_path(out, table).is_file()
    assert set(flushed) <= set(rows(out, "runs"))


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "unknown workload"),
    (["--pair", "nope-model"], "cannot load"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    assert main(argv + ["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_refuses_to_overwrite_without_resume(trace, capsys):
    assert main(FAST + ["--out", str(trace), "--skip", "runs"]) == 2
    assert "--resume" in capsys.readouterr().err
