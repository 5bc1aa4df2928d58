"""The simulator: exact replay of every shipped trace's runs, the replay command's output,
determinism, the store budget, fidelity against measured runs, one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from profiler.record import main as record
from profiler.trace_io import read_table
from rakv.choices import fixed_policy_names
from simulator.costs import fit_op_costs
from simulator.crossover import break_even
from simulator.replay import main as replay_main
from simulator.schedule import schedule
from simulator.session import Session, replay_runs, run_mismatch
from simulator.timing import load_timing
from simulator.trace import load_trace
from simulator.validate import main as validate_main, spearman, validate

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WITH_RUNS = sorted(p for p in (ROOT / "traces").iterdir()
                           if (p / "runs.parquet").is_file() and read_table(p, "runs").num_rows)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "tiny"
    assert record(["--workload", "fixture-chat", "--runs-sample", "4", "--runs-max-new-tokens", "12",
                   "--max-new-tokens", "16", "--runs-max-wait-s", "0", "--out", str(out)]) == 0
    return out


def run_json(capsys, *argv) -> list[dict]:
    assert replay_main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("path", SHIPPED_WITH_RUNS, ids=lambda p: p.name)
def test_every_shipped_run_replays_exactly(path):
    loaded = load_trace(path)
    checked = 0
    for policy in sorted({r.policy for r in loaded.runs}):
        for run, replayed in replay_runs(loaded, policy):
            assert run_mismatch(run, replayed) is None
            assert run.identical_to_ar and replayed.num_output_tokens == run.num_output_tokens
            checked += 1
    assert checked == len(loaded.runs) >= 3 * 23  # every policy on 3 prompts at least


def test_json_fields_and_the_same_seed_gives_the_same_numbers(trace, capsys):
    argv = ["--trace", str(trace), "--policy", "ar,joint-k4,rakv", "--requests", "50", "--seed", "3", "--json"]
    first, second = run_json(capsys, *argv), run_json(capsys, *argv)
    assert first == second and [r["policy"] for r in first] == ["ar", "joint-k4", "rakv"]
    for row in first:
        for key in ("mean_e2e_s", "p50_e2e_s", "p99_e2e_s", "mean_ttft_s", "tokens_per_s", "hit_rate",
                    "mean_accepted_per_round", "action_histogram", "regret_vs_oracle"):
            assert key in row
        assert row["num_requests"] == 50 and sum(row["action_histogram"].values()) == 50
        assert row["regret_vs_oracle"] >= 0  # the oracle prices every action, these included
    assert run_json(capsys, *argv[:-2], "4", "--json") != first


def test_tokens_out_equal_the_recorded_tokens(trace):
    loaded = load_trace(trace)
    timing = load_timing(trace, loaded)
    session = Session.for_policy("rakv", timing.decision_inputs(loaded, None), loaded.target_namespace,
                                 loaded.draft_namespace)
    for arrival in schedule(loaded):
        request = arrival.request
        assert session.run(request, request.max_new_tokens).num_output_tokens == len(request.output_ids)


def test_the_budget_holds_at_every_step(trace):
    loaded = load_trace(trace)
    inputs = loaded.require_inputs()
    budget = 500_000  # a few entries of the tiny pair (2 KiB per token)
    small = replace(inputs, engine=replace(inputs.engine, store=replace(inputs.engine.store, budget_bytes=budget)))
    session = Session.for_policy("joint-k4", small, loaded.target_namespace, loaded.draft_namespace)
    for arrival in schedule(loaded, 200, seed=1):
        session.run(arrival.request, arrival.request.max_new_tokens)
        assert session.store.total_bytes <= budget
    assert session.store.num_evictions > 0


def test_table_and_plots(trace, capsys, tmp_path):
    assert replay_main(["--trace", str(trace), "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "| rakv |" in out and "| oracle |" in out and "| joint-ngram-k8 |" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["actions.png", "crossover.png", "latency_cdf.png"]


def test_validate_reports_exact_rounds_and_fidelity(trace, capsys):
    fidelity = validate(trace)
    assert fidelity.split == "leave one request out" and fidelity.first_mismatch is None
    assert set(fidelity.policies) == {*fixed_policy_names(), "rakv"}  # the store drafter's fixed policies too
    assert all(p.round_mismatches == 0 and p.rounds_off_min_k_mt == 0 for p in fidelity.policies.values())
    assert sum(p.num_rounds for p in fidelity.policies.values()) > 100
    assert validate_main(["--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]["rakv"]) >= {"e2e_mape", "ttft_mape", "round_mismatches"} and "spearman" in report
    steady = fidelity.steadiness  # measured over op costs: around 1 on a steady machine, anything on a busy one
    assert 0 < steady.request_median_low <= steady.request_median_high and steady.within_request_spread >= 1


def test_validate_at_the_usual_speed_sees_through_a_slow_phase_the_probes_saw(trace, tmp_path):
    """The same trace, with one request's runs timed beside probes 1.5x slower and their
    streaming part (every forward at one row, the store's copies) 1.5x slower, the rest as
    fast: as measured its MAPE moves; at the usual speed it is the original's."""
    import shutil
    import pyarrow as pa
    import pyarrow.parquet as pq
    from simulator.timing import overhead_samples
    slowed = tmp_path / "slowed"
    shutil.copytree(trace, slowed)
    ops = pq.read_table(slowed / "ops.parquet")
    ops = ops.set_column(ops.schema.get_field_index("probe_s"), "probe_s", pa.array([0.01] * ops.num_rows))
    pq.write_table(ops, slowed / "ops.parquet")
    loaded = load_trace(slowed)  # each run priced at its streaming part: every forward at one row
    part = {(run.policy, run.request_id): sample.cost
            for run, sample in overhead_samples(loaded, fit_op_costs(loaded.ops).streamed())}
    runs = pq.read_table(slowed / "runs.parquet")
    keys = list(zip(runs.column("policy").to_pylist(), runs.column("request_id").to_pylist()))
    slow = runs.column("request_id").to_numpy() == runs.column("request_id")[0].as_py()
    extra = np.where(slow, 0.5, 0.0)  # the streaming part (at most all of the run: the tiny
    # model's op costs exceed some of its runs) takes 1.5x as long
    e2e_s, ttft_s = runs.column("e2e_s").to_numpy(), runs.column("ttft_s").to_numpy()
    for name, values in (("probe_s", 0.01 * (1 + extra)),
                         ("e2e_s", e2e_s + extra * np.minimum([part[k].e2e_s for k in keys], e2e_s)),
                         ("ttft_s", ttft_s + extra * np.minimum([part[k].ttft_s for k in keys], ttft_s))):
        runs = runs.set_column(runs.schema.get_field_index(name), name, pa.array(values))
    pq.write_table(runs, slowed / "runs.parquet")
    before, after = validate(trace), validate(slowed)
    assert not before.probed and after.probed
    for name, p in after.policies.items():
        assert p.e2e_mape_usual_speed == pytest.approx(before.policies[name].e2e_mape)
        assert p.ttft_mape_usual_speed == pytest.approx(before.policies[name].ttft_mape)
        assert before.policies[name].e2e_mape_usual_speed == before.policies[name].e2e_mape  # unprobed: as measured
    # as measured, the slowed request's runs are compared as they were timed: its MAPE moves
    assert any(p.e2e_mape != pytest.approx(p.e2e_mape_usual_speed, abs=1e-4) for p in after.policies.values())


def test_steadiness_separates_drift_between_requests_from_noise_within_one():
    from simulator.validate import steadiness
    steady = steadiness({0: [1.0, 1.0, 1.0, 1.0], 1: [1.5, 1.5, 1.5, 1.5]})  # drift: request 1 ran slow
    assert (steady.request_median_low, steady.request_median_high, steady.within_request_spread) == (1.0, 1.5, 1.0)
    noisy = steadiness({0: [0.8, 1.0, 1.0, 1.25], 1: [0.8, 1.0, 1.0, 1.25]})
    assert noisy.request_median_low == noisy.request_median_high == 1.0 and noisy.within_request_spread > 1.0


def test_crossover_and_paper_commands(trace, capsys, tmp_path):
    from simulator.crossover import main as crossover_main
    from simulator.paper import main as paper_main
    assert crossover_main(["--timing", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| ngram | 8 |" in out and "| draft | 1 |" in out
    # two timings (say two weights modes) side by side, and their figure
    plot = tmp_path / "modes.png"
    assert crossover_main(["--timing", str(trace), "--timing", "traces/smollm2-general-int8", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-general-int8: plain step" in out and plot.stat().st_size > 10_000
    assert paper_main([]) == 0  # the shipped traces
    out = capsys.readouterr().out
    assert "| paper (Joint-k4 and KV-only baselines) |" in out


def test_spearman_and_break_even():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert break_even(1.0, 1.0, 1) == pytest.approx(0.0, abs=1e-9)
    assert break_even(1.5, 1.0, 1) == pytest.approx(0.5)  # E_1(a) = 1 + a
    assert break_even(3.0, 1.0, 1) is None


def test_op_costs_interpolate_the_grid(trace):
    from rakv.op_timing import OpRow
    rows = [OpRow("target", "decode", 1, c, 0, 0, i, s) for c, s in ((16, 0.010), (256, 0.012), (1024, 0.020))
            for i in range(3)]
    ops = [r for r in load_trace(trace).ops if r.model != "target" or r.op not in ("decode", "prefill")]
    prefill = [OpRow("target", "prefill", n, 0, 0, 0, 0, 0.001 * n) for n in (1, 8)]
    decode = fit_op_costs(ops + rows + prefill).target.decode  # the medians of repeats
    assert decode(16) == pytest.approx(0.010) and decode(136) == pytest.approx(0.011)
    assert decode(2048) == pytest.approx(0.020 + 1024 * 0.008 / 768)  # beyond: along the last segment
    assert decode(0) == pytest.approx(0.001)  # a prefill of 1 token is the same call as a step
    same = [OpRow("target", "prefill", 1, 256, 0, 0, i, 0.030) for i in range(4)]
    assert fit_op_costs(ops + rows + prefill + same).target.decode(256) == pytest.approx(0.030)  # 7 samples pooled


def test_ops_timed_beside_a_slow_probe_are_priced_at_the_usual_speed(trace):
    from rakv.op_timing import OpRow
    from simulator.costs import at_usual_speed
    ops = [replace(r, probe_s=0.1) for r in load_trace(trace).ops if r.model != "target" or r.op != "decode"]
    # the same step timed three times: twice at the usual speed, once while the probe ran 1.5x slower
    decode = [OpRow("target", "decode", 1, 256, 0, 0, i, s, probe_s=p) for i, (s, p) in
              enumerate(((0.010, 0.1), (0.011, 0.1), (0.015, 0.15)))]
    costs = fit_op_costs(ops + decode)
    assert costs.usual_probe_s == pytest.approx(0.1)
    assert costs.target.decode(256) == pytest.approx(0.010)  # the median of 0.010, 0.011 and 0.015 / 1.5
    assert costs.at_usual_speed(3.0, 0.15) == pytest.approx(2.0) and costs.at_usual_speed(3.0, None) == 3.0
    assert at_usual_speed(3.0, 0.15, None) == 3.0  # a trace without probes is priced as timed
    unprobed = fit_op_costs([replace(r, probe_s=None) for r in ops + decode])
    assert unprobed.usual_probe_s is None and unprobed.target.decode(256) == pytest.approx(0.011)


def test_a_slow_phase_slows_a_forwards_streaming_not_its_rows(trace):
    """Of a forward of many rows timed beside a slow probe, only its one-row part (the
    weights and caches it streams) is scaled back; a store copy is all streaming."""
    from rakv.op_timing import OpRow
    from simulator.costs import at_usual_speed
    ops = [replace(r, probe_s=0.1) for r in load_trace(trace).ops
           if r.model != "target" or r.op not in ("decode", "prefill") or r.num_cached_tokens != 256]
    decode = [OpRow("target", "decode", 1, 256, 0, 0, i, 0.010, probe_s=0.1) for i in range(3)]
    prefill = [OpRow("target", "prefill", 64, 256, 0, 0, i, s, probe_s=p) for i, (s, p) in
               enumerate(((0.200, 0.1), (0.200, 0.1), (0.205, 0.15), (0.205, 0.15), (0.205, 0.15)))]
    costs = fit_op_costs(ops + decode + prefill)
    assert costs.target.prefill(64, 256) == pytest.approx(0.200)  # 0.205 - 0.010 x 0.5: the median
    assert costs.streamed().target.prefill(64, 256) == costs.streamed().target.verify(9, 256) == pytest.approx(0.010)
    assert at_usual_speed(3.0, 0.15, 0.1, 0.6) == pytest.approx(2.7)  # 0.6 s streamed took 0.9
    assert at_usual_speed(3.0, 0.15, 0.1, 5.0) == pytest.approx(2.0)  # never below the whole scaled
    assert at_usual_speed(3.0, 0.05, 0.1, 0.3) == pytest.approx(3.15)  # a fast phase: 0.3 s streamed took 0.15
    assert at_usual_speed(3.0, 0.05, 0.1, 10.0) == pytest.approx(6.0)  # never above the whole scaled


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/nonexistent"], "no such trace"),
    (["--policy", "fastest"], "unknown policy 'fastest'"),
    (["--requests", "0"], "--requests must be at least 1"),
    (["--arrival-rate", "-1"], "--arrival-rate must be a positive number"),
    (["--budget-mib", "0"], "--budget-mib must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(trace, capsys, argv, message):
    args = argv if argv[0] == "--trace" else ["--trace", str(trace)] + argv
    assert replay_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_mismatched_timing_trace_is_refused(trace, tmp_path, capsys):
    """A timing trace of the same shapes joins; one of other shapes (here, the same ops
    relabelled as a wider model) is refused."""
    import pyarrow.parquet as pq
    from profiler.schema import TraceMeta
    data = pq.read_table(trace / "ops.parquet")
    meta = TraceMeta.from_metadata(data.schema.metadata)
    for name, hidden in (("same", None), ("wider", 4096)):
        config = dict(meta.models["target_config"], **({"hidden_size": hidden} if hidden else {}))
        other = TraceMeta(meta.hardware, dict(meta.models, target_config=config), meta.config)
        (tmp_path / name).mkdir()
        pq.write_table(data.replace_schema_metadata(other.to_metadata("ops")), tmp_path / name / "ops.parquet")
    assert replay_main(["--trace", str(trace), "--timing", str(tmp_path / "same"), "--policy", "rakv"]) == 0
    capsys.readouterr()
    assert replay_main(["--trace", str(trace), "--timing", str(tmp_path / "wider")]) == 2
    err = capsys.readouterr().err
    assert "timing trace of other model shapes" in err and len(err.strip().splitlines()) == 1


def test_command_line_imports_no_torch(trace):
    code = ("import sys; from simulator.replay import main; main(['--trace', sys.argv[1], '--policy', 'rakv']); "
            "assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code, str(trace)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_trace_holding_shorter_run_lengths_is_refused_naming_the_fix(trace, tmp_path):
    """Facts a setting needs and a trace lacks are never filled in: rounds of 16 need run
    lengths to 16; the error names the re-record command and the setting that fits."""
    loaded = load_trace(trace)
    short = replace(loaded, requests=tuple(replace(r, max_k=8) for r in loaded.requests))
    short = replace(short, by_id={r.request_id: r for r in short.requests})
    timing = load_timing(trace, loaded)
    from rakv.settings import Settings, override
    from simulator.replay import replay
    from simulator.session import SessionError
    with pytest.raises(SessionError, match=r"record_traces\.sh.*--set planner\.max_k=8"):
        replay(short, timing, ["rakv"], schedule(short))
    assert replay(short, timing, ["rakv"], schedule(short), override(Settings(), "planner.max_k=8"))


def test_replay_runs_todays_settings_unless_as_recorded_and_says_which(trace, capsys, tmp_path):
    assert replay_main(["--trace", str(trace), "--policy", "rakv"]) == 0
    assert "settings: today's engine defaults" in capsys.readouterr().out
    assert replay_main(["--trace", str(trace), "--policy", "rakv", "--as-recorded"]) == 0
    assert "settings: as recorded" in capsys.readouterr().out
    file = tmp_path / "settings.json"
    file.write_text(json.dumps({"planner": {"min_gain": 0.5}}))
    rows = run_json(capsys, "--trace", str(trace), "--policy", "rakv", "--settings", str(file),
                    "--set", "store.mode=off", "--json")
    assert rows[0]["settings"]["controller"]["rounds"]["min_gain"] == 0.5
    assert rows[0]["settings"]["engine"]["store"]["mode"] == "off" and rows[0]["hit_rate"] == 0
    for argv, message in ((["--set", "planner.nope=1"], "no such setting"),
                          (["--settings", str(tmp_path / "absent.json")], "absent.json"),
                          (["--set", "store.budget_bytes=0"], "budget must be positive")):
        assert replay_main(["--trace", str(trace), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_an_older_engines_trace_replays_todays_settings_with_a_warning_and_refuses_as_recorded(trace, tmp_path,
                                                                                            capsys):
    import pyarrow.parquet as pq
    old = tmp_path / "old"
    old.mkdir()
    for table in ("requests", "ops", "runs", "decisions"):
        data = pq.read_table(trace / f"{table}.parquet")
        meta = dict(data.schema.metadata)
        config = json.loads(meta[b"rakv.config"])
        del config["decision_inputs"]["controller"]["probe_margin"]
        meta[b"rakv.config"] = json.dumps(config).encode()
        pq.write_table(data.replace_schema_metadata(meta), old / f"{table}.parquet")
    with pytest.warns(UserWarning, match="older engine.*probe_margin.*record_traces.sh old"):
        assert replay_main(["--trace", str(old), "--policy", "rakv"]) == 0
    capsys.readouterr()
    with pytest.warns(UserWarning):
        assert replay_main(["--trace", str(old), "--policy", "rakv", "--as-recorded"]) == 2
    err = capsys.readouterr().err
    assert "record_traces.sh old" in err and len(err.strip().splitlines()) == 1


def test_another_ngram_setting_recomputes_prompt_lookups_run_lengths(trace):
    """Prompt lookup's run lengths are facts of the tokens under an n-gram config: a replay
    under another config recomputes them, and under the recorded one keeps them."""
    from rakv.drafters import NGRAM, NgramConfig, ngram_run_lengths
    from simulator.trace import under_ngram
    loaded = load_trace(trace)
    assert under_ngram(loaded, loaded.inputs.engine.ngram) is loaded
    other = NgramConfig(max_ngram=1, min_ngram=1)
    moved = under_ngram(loaded, other)
    for request in moved.requests:
        want = ngram_run_lengths(request.prompt_ids, request.output_ids, request.max_k, other)
        assert (moved.by_id[request.request_id].lengths[NGRAM].runs, request.lengths[NGRAM].signals) == (
            want.runs, want.signals)


def test_validate_out_of_sample_fits_the_overhead_on_other_traces_only(trace):
    inside, outside = validate(trace), validate(trace, fit_on=(trace,))
    assert outside.split == f"on {trace.name} only" and inside.split == "leave one request out"
    assert outside.settings == "as recorded" and outside.policies.keys() == inside.policies.keys()
