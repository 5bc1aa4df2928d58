"""profiler.record serving under load (the served and steps tables) on the tiny pair: every
served output is the request's greedy output, the steps account for every request's rows
within the step limits, the batched op grid, resume after an interrupt, one-line errors."""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

import profiler.serve_record
from profiler.serve_record import Load
from profiler import serve_summary
from profiler.record import main, parse_args
from profiler.schema import KEY_COLUMNS, META_DECISION_INPUTS, META_FIRST_TOKEN_AT, ServedRow, StepRow, table_to_rows
from profiler.trace_io import final_path, read_meta, read_table

SERVE = ["--pair", "tiny", "--workload", "fixture-chat", "--max-new-tokens", "16", "--grid", "serving",
         "--skip", "runs", "--serve-requests", "6", "--max-num-seqs", "3", "--max-num-batched-tokens", "24"]
LOADS = ["--serve-concurrency", "1,4", "--serve-rate", "40"]


def rows(trace, table):
    return table_to_rows(table, read_table(trace, table))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "tiny"
    assert main(SERVE + LOADS + ["--out", str(out)]) == 0
    return out


def test_every_load_serves_every_request_once_with_its_greedy_output(trace):
    requests = {r.request_id: r for r in rows(trace, "requests")}
    served = rows(trace, "served")
    assert Counter((r.load, r.policy) for r in served) == {
        (load, policy): 6 for load in ("c=1", "c=4", "rate=40") for policy in ("ar", "rakv")}
    for row in served:
        assert row.identical_to_ar and row.output_ids == requests[row.request_id].output_ids
        assert row.arrival_s <= row.admitted_s <= row.first_token_s <= row.finish_s
    rakv = [r for r in served if r.policy == "rakv"]
    assert sum(len(r.k_per_round) for r in rakv) > 0  # the tiny pair's draft is a noisy copy: rounds happen


def test_steps_account_for_every_row_within_the_limits(trace):
    requests = {r.request_id: r for r in rows(trace, "requests")}
    served = {(r.load, r.policy, r.request_id): r for r in rows(trace, "served")}
    by_run = defaultdict(list)
    for step in rows(trace, "steps"):
        by_run[step.load, step.policy].append(step)
    assert len(by_run) == 6
    for (load, policy), steps in by_run.items():
        assert [s.step for s in steps] == list(range(len(steps)))
        assert all(a.start_s <= b.start_s for a, b in zip(steps, steps[1:]))
        prefilled, verifies = Counter(), Counter()
        for s in steps:
            assert sum(s.rows) <= 24 and len(s.request_ids) <= 3 and len(set(s.request_ids)) == len(s.request_ids)
            assert s.kinds.count("prefill") <= 1  # max_num_prefills, as recorded
            assert s.forward_s + s.propose_s <= s.seconds
            for request_id, kind, num_rows, k in zip(s.request_ids, s.kinds, s.rows, s.ks):
                if kind == "prefill":
                    prefilled[request_id] += num_rows
                elif kind == "verify":
                    verifies[request_id] += 1
                    assert 2 <= num_rows <= k + 1
                else:
                    assert kind == "decode" and num_rows == 1
        for request_id, request in requests.items():
            if (load, policy, request_id) not in served:
                continue
            row = served[load, policy, request_id]
            assert row.num_preemptions == 0  # the default memory budget holds them all
            assert prefilled[request_id] == len(request.prompt_ids) - row.reused_tokens
            assert verifies[request_id] == len(row.k_per_round)


def test_the_serving_grid_times_batched_forwards(trace):
    batched = [r for r in rows(trace, "ops") if r.op == "batch"]
    shapes = {(r.model, r.num_requests, r.num_new_tokens, r.num_cached_tokens) for r in batched}
    max_positions = read_meta(trace).config[META_DECISION_INPUTS]["max_positions"]  # the tiny pair's: 256
    steps = {(m, b, r, c) for m in ("target", "draft") for b in (1, 2, 4, 8) for r in (1, 2, 5)
             for c in (128, 512) if c + 5 < max_positions}
    chunks = {(m, 1, r, c) for m in ("target", "draft") for r in (16, 64, 128, 256) for c in (128, 512)
              if c + r < max_positions}  # one request's prefill chunk through the same batched forward
    assert shapes == steps | chunks and (("target", 1, 64, 128) in chunks) == (192 < max_positions)
    assert all(r.seconds > 0 for r in batched)
    assert all(r.probe_s > 0 for r in batched)  # each op beside the machine's speed, as each load


def test_each_loads_steps_hold_the_machines_speed_while_it_ran(trace):
    """Every step of a load holds the load's probe (the mean of one just before it, after
    any wait for a slow phase to pass, and one just after): what ``serve_validate`` sets
    beside the load's time error."""
    probes = defaultdict(set)
    for r in rows(trace, "steps"):
        probes[r.load, r.policy].add(r.probe_s)
    assert len(probes) == 6 and all(len(p) == 1 and next(iter(p)) > 0 for p in probes.values())


def test_an_interrupted_serving_recording_resumes_without_running_a_load_twice(tmp_path, monkeypatch):
    out = tmp_path / "interrupted"
    real, calls = profiler.serve_record.serve_load, []

    def interrupting(engine, requests, load, policy, *args, **kwargs):
        calls.append((load.label, policy))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(engine, requests, load, policy, *args, **kwargs)
    monkeypatch.setattr(profiler.serve_record, "serve_load", interrupting)
    argv = SERVE + ["--serve-concurrency", "1,2", "--out", str(out)]
    assert main(argv) == 130
    assert {(r.load, r.policy) for r in rows(out, "served")} == {("c=1", "ar"), ("c=1", "rakv")}
    calls.clear()
    assert main(argv + ["--resume"]) == 0
    assert calls == [("c=2", "ar"), ("c=2", "rakv")]
    for table in ("served", "steps"):
        keys = [tuple(getattr(r, c) for c in KEY_COLUMNS[table]) for r in rows(out, table)]
        assert len(keys) == len(set(keys)) and final_path(out, table).is_file()
    assert len(rows(out, "served")) == 4 * 6


def test_the_grid_is_timed_in_passes_spread_across_the_loads(tmp_path, monkeypatch):
    """Serving without runs, the op grid's repeats go in passes before the first load,
    between the loads and after the last, so a point's median spans the machine the
    loads ran on, not one block of minutes."""
    import profiler.record
    events, real_ops, real_load = [], profiler.record.record_ops, profiler.serve_record.serve_load

    def ops(writer, pair, args, progress, repeats=None, *rest):
        events.append(("ops", None if repeats is None else repeats.start))
        return real_ops(writer, pair, args, progress, repeats, *rest)

    def load(engine, requests, load, policy, *args, **kwargs):
        events.append((load.label, policy))
        return real_load(engine, requests, load, policy, *args, **kwargs)
    monkeypatch.setattr(profiler.record, "record_ops", ops)
    monkeypatch.setattr(profiler.serve_record, "serve_load", load)
    out = tmp_path / "spread"
    assert main(SERVE + ["--serve-concurrency", "1,2", "--out", str(out)]) == 0
    assert events == [("ops", 0), ("c=1", "ar"), ("c=1", "rakv"), ("ops", 1), ("c=2", "ar"), ("c=2", "rakv"),
                      ("ops", 2)]
    assert sorted({r.repeat for r in rows(out, "ops")}) == [0, 1, 2]


@pytest.mark.parametrize("argv, message", [
    (["--serve-concurrency", "0"], "--serve-concurrency: '0' must be a whole number >= 1"),
    (["--serve-rate", "fast"], "--serve-rate: 'fast' is not a number"),
    (["--serve-concurrency", "2", "--serve-policies", "ar,nope"], "--serve-policies: unknown policy 'nope'"),
    (["--serve-concurrency", "2", "--skip", "requests"], "serving under load serves the recorded requests"),
    (["--serve-concurrency", "2", "--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
    (["--serve-concurrency", "2", "--max-num-prefills", "0"], "max_num_prefills must be at least 1"),
    (["--serve-concurrency", "2", "--itl-target", "-0.1"], "--itl-target must be positive, got -0.1"),
])
def test_bad_serving_arguments_are_one_line(tmp_path, capsys, argv, message):
    try:  # argparse's own errors exit with status 2 after its usage line
        status = main(["--pair", "tiny"] + argv + ["--out", str(tmp_path / "x")])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err


def test_every_command_of_the_scripted_recorder_parses():
    script = (Path(__file__).resolve().parents[1] / "scripts" / "record_traces.sh").read_text()
    entries = re.findall(r'^  "([\w-]+)\|([^"]+)"$', script, re.M)
    assert {"smollm2-humaneval-serve", "qwen-coder-humaneval-serve"} <= {name for name, _ in entries}
    for _, args in entries:
        parse_args(args.split())


def test_the_summary_has_a_row_per_load_and_policy(trace, capsys):
    assert serve_summary.main(["--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    for load in ("c=1", "c=4", "rate=40"):
        for policy in ("ar", "rakv"):
            assert f"| {load} | {policy} |" in out and "| 6 of 6 | 0 |" in out
    # ar never reuses stored KV (r = 0): its rows say no request did
    assert all(line.endswith("| 6 of 6 | 0 | 0 of 6 |") for line in out.splitlines() if "| ar |" in line)
    assert "| target | 128 | 8 x 5 |" in out


def test_the_summary_counts_the_requests_meeting_an_slo(trace, capsys):
    assert serve_summary.main(["--trace", str(trace), "--slo", "ttft=1000,itl=1000"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| c=1 | ar |")]
    assert rows and rows[0].endswith("(6 of 6) |")
    assert serve_summary.main(["--trace", str(trace), "--slo", "ttft=1e-9"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rate=40 | rakv |")]
    assert rows and rows[0].endswith("| 0.000 (0 of 6) |")
    assert serve_summary.main(["--trace", str(trace), "--slo", "ttft=soon"]) == 2
    assert capsys.readouterr().err.strip() == "error: --slo: ttft: 'soon' is not a number of seconds"


def test_the_summary_of_a_trace_without_serving_is_one_line(tmp_path, capsys):
    assert serve_summary.main(["--trace", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_a_load_is_read_back_from_its_label():
    for load, value in ((Load(concurrency=4), 4), (Load(rate_per_s=0.7), 0.7), (Load(rate_per_s=1.25), 1.25)):
        assert Load.of_label(load.label) == load and load.value == value
    with pytest.raises(ValueError, match="a load is c=N or rate=R, got 'qps=2'"):
        Load.of_label("qps=2")


def test_a_recording_times_first_tokens_at_their_delivery(trace):
    """Today's recordings say so in their config; each first token comes after a step's
    forward and before the next step starts, and reads back as recorded."""
    config = read_meta(trace).config
    assert config[META_FIRST_TOKEN_AT] == "delivery"
    served, steps = serve_summary.read_served(trace, config)
    assert served == rows(trace, "served")
    by_run = defaultdict(list)
    for step in steps:
        by_run[step.load, step.policy].append(step)
    for row in served:
        run = by_run[row.load, row.policy]
        nexts = [s.start_s for s in run[1:]] + [float("inf")]
        assert any(s.start_s + s.propose_s + s.forward_s <= row.first_token_s <= after
                   for s, after in zip(run, nexts))


def test_an_older_recordings_first_tokens_move_to_the_end_of_the_step_that_delivered_them():
    def step(i):
        return StepRow(load="c=2", policy="kv-only", step=i, start_s=1.0 * i, seconds=0.5, propose_s=0.0,
                       forward_s=0.4, request_ids=[0], kinds=["decode"], rows=[1], num_cached=[9], drafters=[""],
                       ks=[0])

    def served(request_id, first_token_s, finish_s):
        return ServedRow(load="c=2", policy="kv-only", request_id=request_id, arrival_s=0.0, admitted_s=0.0,
                         first_token_s=first_token_s, finish_s=finish_s, num_preemptions=0, r=1, drafter="", k=0,
                         hit_tokens=9, reused_tokens=9, output_ids=[1, 2], identical_to_ar=True, start_per_round=[],
                         drafter_per_round=[], accepted_per_round=[], k_per_round=[], proposed_per_round=[])
    steps = [step(i) for i in range(3)]
    rows_in = [served(0, 1.0001, 2.49),  # an exact repeat, timed at its admission before step 1 ran
               served(1, 0.45, 0.49),  # made after step 0's forward, finished in the same step
               served(2, 2.5, 2.5),  # at step 2's end already
               served(3, 1.5002, 2.9),  # made in step 1, timed just past its recorded end: step 1's still
               served(4, 3.2, 3.3)]  # after the last step: that step's
    got = [r.first_token_s for r in serve_summary.delivered(rows_in, steps)]
    assert got == [1.5, 0.49, 2.5, 1.5002, 3.2]
