"""profiler.record end to end on the tiny pair: tables, decision inputs, exact replay of
every recorded run across requests, user workloads, SIGKILL mid-recording then --resume
without duplicates, one-line errors."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rakv.calibrate
from profiler.record import main
from profiler.run_record import pass_starts
from profiler.schema import KEY_COLUMNS, META_DECISION_INPUTS, table_to_rows
from profiler.trace_io import final_path, parts_dir, read_meta, read_table
from rakv.acceptance import replay_request
from rakv.op_timing import CALIBRATION_GRID
from rakv.choices import fixed_policy_names
from rakv.drafters import DRAFT_MODEL, SUFFIX, RunLengths
from rakv.round_planner import FixedRounds, PlannerConfig
from simulator.session import replay_runs, run_mismatch
from simulator.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--pair", "tiny", "--workload", "fixture-chat", "--runs-sample", "3", "--runs-max-new-tokens", "12",
        "--runs-max-wait-s", "0", "--max-new-tokens", "24"]


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
    inputs = meta.config[META_DECISION_INPUTS]  # what a replay decides with
    assert inputs["timings"]["target"]["step_fixed_s"] > 0 and inputs["engine"]["store"]["mode"] == "full"
    assert inputs["engine"]["ngram"] == {"max_ngram": 3, "min_ngram": 1} and inputs["max_positions"] == 256
    assert inputs["target_sizes"]["kv_bytes_per_token"] > 0
    assert inputs["controller"]["rounds"]["min_gain"] == PlannerConfig().min_gain
    assert inputs["controller"]["ready_draft_over_plain"] is True  # recorded, so a replay decides as the engine did
    requests = rows(trace, "requests")
    assert len(requests) == 6
    assert {r.drafter for r in requests[0].run_lengths} == {"ngram", "draft"}
    assert all(d.max_k == 32 for r in requests for d in r.run_lengths)
    assert all(len(r.draft_top1_probs) == len(r.output_ids) and 0 < min(r.draft_top1_probs) <= 1 for r in requests)
    assert {r.max_new_tokens for r in rows(trace, "runs")} == {12}
    assert {r.probe_s for table in ("ops", "runs") for r in rows(trace, table)} == {None}  # --runs-max-wait-s 0
    ops = {(r.model, r.op) for r in rows(trace, "ops")}
    assert {("target", "prefill"), ("target", "decode"), ("target", "verify"), ("draft", "verify"),
            ("store", "clone"), ("store", "lookup"), ("store", "insert"), ("ngram", "propose")} <= ops
    decisions = rows(trace, "decisions")
    assert decisions and all(d.policy == "rakv" and d.predicted_cost_s > 0 for d in decisions)


def test_the_ops_repeats_are_timed_in_passes_spread_across_the_runs(trace):
    assert pass_starts(5, 10) == [0, 2, 5, 8, 10] and pass_starts(3, 1) == [0, 0, 1] and pass_starts(1, 4) == [0]
    repeats = {}
    for r in rows(trace, "ops"):  # every point has every repeat, each once, whichever pass timed it
        repeats.setdefault((r.model, r.op, r.num_new_tokens, r.num_cached_tokens, r.k, r.num_bytes), []).append(r.repeat)
    assert repeats and all(sorted(v) == list(range(CALIBRATION_GRID.repeats)) for v in repeats.values())


def test_every_run_is_identical_and_replays_exactly(trace):
    requests = {r.request_id: r for r in rows(trace, "requests")}
    runs = rows(trace, "runs")
    assert len({(r.r, r.drafter, r.k) for r in runs if r.policy != "rakv"}) == len(fixed_policy_names())
    assert all(r.identical_to_ar for r in runs)
    assert {"miss", "partial"} <= {r.hit_kind for r in runs}
    checked = 0
    for run in runs:
        if SUFFIX in run.drafter_per_round:
            continue  # the store drafter's proposals depend on the store: replayed across requests, below
        request = requests[run.request_id]
        lengths = {d.drafter: RunLengths(d.run_lengths, d.proposal_lengths, [0] * len(d.run_lengths))
                   for d in request.run_lengths}  # a fixed policy's rounds ignore the signal
        rounds = list(zip(run.start_per_round, run.drafter_per_round, run.k_per_round,
                          run.proposed_per_round, run.accepted_per_round))
        for start, drafter, k, proposed, accepted in rounds:  # every policy, rakv included
            at = lengths[drafter]
            if drafter == DRAFT_MODEL and run.policy == "rakv":  # its proposals may stop on confidence
                assert proposed <= min(k, at.proposed[start]) and accepted == min(proposed, at.runs[start])
            else:
                assert (proposed, accepted) == (min(k, at.proposed[start]), min(k, at.runs[start]))
        if run.policy != "rakv":  # a fixed policy's rounds replay from its action alone
            expected = replay_request(FixedRounds(run.drafter, run.k), lengths, run.num_output_tokens,
                                      min(12, request.max_new_tokens))
            assert rounds == [(r.start, r.drafter, r.k, r.num_proposed, r.accepted) for r in expected]
        checked += run.num_rounds
    assert checked > 50


def test_every_policy_replays_across_requests(trace):
    """One session per policy, from the policy's initial state and an empty store, carries
    its state from request to request: every run's action, hit, rounds and output length,
    and the adaptive policy's running estimates at every decision, equal the recording's."""
    loaded = load_trace(trace)
    decisions = {d.request_id: d for d in rows(trace, "decisions")}
    for policy in sorted({r.policy for r in loaded.runs}):
        pairs = replay_runs(loaded, policy)
        assert len(pairs) == 4  # the sample's 3 requests and a later turn of one's conversation
        assert [run_mismatch(run, replayed) for run, replayed in pairs] == [None] * 4
        if policy == "rakv":
            for run, replayed in pairs:
                d = decisions[run.request_id]
                estimates = dict(replayed.estimates)
                assert (estimates["draft"], estimates["ngram"]) == (d.acceptance_draft, d.acceptance_ngram)


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


def test_user_workload_records_end_to_end(tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "User: hello there\\nAssistant:", "group": "a", "arrival_s": 0}\n'
                       '{"prompt_ids": [256, 85, 115, 101, 114], "group": "a", "arrival_s": 1.5, "max_new_tokens": 5}\n'
                       '\n{"prompt": "Another one", "arrival_s": 2}\n')
    out = tmp_path / "trace"
    assert main(["--workload", str(prompts), "--runs-sample", "3", "--runs-max-new-tokens", "6", "--runs-max-wait-s", "1",
                 "--out", str(out)]) == 0
    # probing: every op and run stored beside the machine's speed then (the simulator's usual speed)
    assert all(r.probe_s > 0 for table in ("ops", "runs") for r in rows(out, table))
    requests = rows(out, "requests")
    assert [(r.group_id, r.turn, r.arrival_s, r.workload) for r in requests] == [
        ("a", 0, 0.0, "mine"), ("a", 1, 1.5, "mine"), ("line-4", 0, 2.0, "mine")]
    assert requests[1].prompt_ids == (256, 85, 115, 101, 114) and len(requests[1].output_ids) == 5
    meta = read_meta(out)
    assert meta.config["workload"] == str(prompts) and META_DECISION_INPUTS in meta.config
    loaded = load_trace(out)
    for policy in ("ar", "joint-k4", "ngram-k8", "rakv"):
        assert all(run_mismatch(run, replayed) is None for run, replayed in replay_runs(loaded, policy))


def test_an_int8_recording_is_its_own_model_and_replays_exactly(trace, tmp_path):
    """Run lengths, draft probabilities and runs recorded in int8 replay exactly; the mode
    is in the metadata and the fingerprints."""
    out = tmp_path / "int8"
    assert main(FAST + ["--weights", "int8", "--dtype", "float32", "--skip", "ops", "--out", str(out)]) == 0
    meta = read_meta(out)
    assert meta.models["weights"] == "int8" and meta.config["weights"] == "int8"
    assert meta.models["target"] != read_meta(trace).models["target"]
    loaded = load_trace(out)
    for policy in ("ar", "joint-k4", "ngram-k8", "rakv"):
        assert all(run_mismatch(run, replayed) is None for run, replayed in replay_runs(loaded, policy))


def test_acceptance_alone_names_the_trace_that_holds_its_timing(trace, capsys):
    """--skip ops runs --timing-trace NAME: the facts that need no quiet machine, replayed
    with the sibling's timing and no --timing flag."""
    from simulator.timing import load_timing
    out = trace.parent / "tiny-acceptance"
    assert main(FAST + ["--out", str(out), "--skip", "ops", "runs", "--timing-trace", trace.name]) == 0
    assert rows(out, "ops") == [] and read_meta(out).config["timing_trace"] == trace.name
    timing = load_timing(None, load_trace(out))
    assert timing.source == trace.name and not timing.own
    assert main(FAST + ["--out", str(trace.parent / "x"), "--timing-trace", trace.name]) == 2
    assert "record with --skip ops runs" in capsys.readouterr().err


def test_revision_turns_continue_the_models_own_answer(tmp_path):
    from profiler.prompt_texts import REVISE
    from rakv.models import load_pair
    out = tmp_path / "chat"
    assert main(["--workload", "chat", "--requests", "4", "--max-new-tokens", "8", "--skip", "ops", "runs",
                 "--out", str(out)]) == 0
    first, revision = rows(out, "requests")[:2]
    assert (first.group_id, first.turn, revision.group_id, revision.turn) == ("chat-0", 0, "chat-0", 1)
    assert revision.prompt_ids == (first.prompt_ids + first.output_ids
                                   + tuple(load_pair("tiny").encode_continuation(REVISE)))


def test_resume_refuses_changed_decision_inputs(trace, monkeypatch, capsys):
    calibrated = rakv.calibrate.load_or_calibrate

    def recalibrated(pair, refresh=False):
        timings = calibrated(pair)
        return dataclasses.replace(timings, lookup_s=timings.lookup_s * 2)

    monkeypatch.setattr(rakv.calibrate, "load_or_calibrate", recalibrated)
    assert main(FAST + ["--out", str(trace), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.decision_inputs.timings.lookup_s differs" in err


def test_recalibrate_measures_the_timings_again_and_is_not_part_of_the_recording(tmp_path, calibration_refreshes):
    """``--recalibrate`` asks for fresh timings; a recording resumed without it still
    matches (the option is not in the trace's config)."""
    refreshes = calibration_refreshes
    out = tmp_path / "x"
    argv = ["--workload", "fixture-chat", "--requests", "2", "--max-new-tokens", "4", "--skip", "ops", "runs",
            "--out", str(out)]
    assert main(argv + ["--recalibrate"]) == 0
    assert refreshes == [True] and "recalibrate" not in load_trace(out).meta.config
    assert main(argv + ["--resume"]) == 0 and refreshes == [True, False]


def test_a_workload_line_may_carry_fields_it_does_not_use_with_one_warning(tmp_path):
    """Data sets carry an id, a source: such lines are read, their extra fields ignored,
    and one warning names them all."""
    from rakv.prompt_file import read_prompt_file
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"id": 1, "source": "web", "prompt": "a"}\n{"id": 2, "source": "web", "lang": "en", '
                       '"prompt": "b"}\n')
    with pytest.warns(UserWarning) as caught:
        lines = read_prompt_file(prompts)
    assert [line.prompt for line in lines] == ["a", "b"] and len(caught) == 1
    assert "ignoring fields 'id', 'lang', 'source'" in str(caught[0].message)


@pytest.mark.parametrize("lines, message", [
    ('{"prompt": 5}\n', "mine.jsonl:1: 'prompt' must be non-empty text"),
    ('{"prompt": "ok"}\n{"prompt_ids": [1, -2]}\n', "mine.jsonl:2: 'prompt_ids' must be"),
    ('{"prompt": "ok", "arrival_s": 3}\n{"prompt": "b", "arrival_s": 1}\n', "mine.jsonl:2: 'arrival_s' 1.0 is earlier"),
    ('{"prompt": "ok"\n', "mine.jsonl:1: not valid JSON"),
    ('{"prompt": "ok"}\n{"prompt_ids": [99999]}\n', "mine.jsonl:2: token id 99999 is outside the vocabulary"),
    ('\n\n', "no prompts"),
])
def test_bad_user_workload_is_one_line(tmp_path, capsys, lines, message):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(lines)
    assert main(["--workload", str(prompts), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "unknown workload"),
    (["--workload", "missing.jsonl"], "prompts file not found"),
    (["--pair", "nope-model"], "cannot load"),
    (["--recalibrate", "--resume"], "--recalibrate cannot go with --resume"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    assert main(argv + ["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_refuses_to_overwrite_without_resume(trace, capsys):
    assert main(FAST + ["--out", str(trace), "--skip", "runs"]) == 2
    assert "--resume" in capsys.readouterr().err
