"""simulator.load_replay through ``python -m simulator.replay`` on a serving trace: the
policies at each load through the batching engine's replay. A recorded load replayed at the
recorded settings is serve_validate's free-running replay; a rate sweep is seeded; goodput
counts the requests meeting every bound over the load's span; the share speculating counts
rounds by the number decoding beside them; a repeat reuses its prompt while it runs; a
draft catch-up waits for a step without another's prefill; bad input is one line."""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from profiler.schema import table_to_rows
from profiler.serve_record import Load
from profiler.serve_summary import Slo, parse_slo
from profiler.trace_io import read_table
from rakv.scheduler import DECODE, PREFILL, VERIFY, Composition
from rakv.settings import Settings, override
from simulator import serve_validate
from simulator.causal_bound import LOAD_GRID, CausalBound, causal_bound, num_settings, tuned
from simulator.load_replay import PROGRESS_MIN_REQUESTS, progress_bar
from simulator.load_result import LoadResult, speculation_by_batch, summarize_load
from simulator.sweep_summary import Shortfall, mark_best_fixed, summary_lines, sweep_summary
from simulator.replay import main as replay_main
from simulator.serve_sim import LoadRun, TimedRequest
from simulator.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
SERVING = TRACES / "smollm2-humaneval-serve"  # recorded at c=1,2,4,8 and rate=2, under ar and rakv


def rows_of(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_recorded_loads_replay_as_serve_validate_does(capsys):
    """At the recorded settings, requests, limits and seed, every recorded load (closed and
    open) gives the free-running latencies of serve_validate, which overheads are fitted on
    the same steps (``fit_serving_costs``)."""
    assert replay_main(["--trace", str(SERVING), "--as-recorded", "--policy", "ar,rakv", "--json"]) == 0
    got = {(r["load"], r["policy"]): r for r in rows_of(capsys)}
    expected = serve_validate.validate_serving(load_trace(SERVING))
    assert set(got) == {(row.load, row.policy) for row in expected} and any(k[0] == "rate=2" for k in got)
    for row in expected:
        mine, sim = got[row.load, row.policy], row.simulated
        for metric in ("ttft", "itl", "e2e"):
            assert mine[metric] == asdict(getattr(sim, metric)), (row.load, metric)
        assert mine["output_tok_per_s"] == sim.output_tok_per_s
        assert mine["num_requests"] == 16 and mine["goodput_per_s"] is None


def test_a_rate_sweep_is_seeded(capsys):
    argv = ["--trace", str(SERVING), "--policy", "ar,rakv", "--arrival-rate", "1,4", "--requests", "40", "--json"]
    assert replay_main(argv + ["--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert replay_main(argv + ["--seed", "3"]) == 0
    assert capsys.readouterr().out == first
    assert replay_main(argv + ["--seed", "4"]) == 0
    other = capsys.readouterr().out
    assert other != first
    rows = [json.loads(line) for line in first.splitlines()]
    assert [(r["load"], r["policy"]) for r in rows] == [("rate=1", "ar"), ("rate=1", "rakv"), ("rate=4", "ar"),
                                                        ("rate=4", "rakv")]
    assert all(r["num_requests"] == 40 for r in rows)
    by = {(r["load"], r["policy"]): r for r in rows}
    assert by["rate=4", "ar"]["ttft"]["p90_s"] >= by["rate=1", "ar"]["ttft"]["p90_s"]  # more load, more queueing


def test_goodput_counts_the_requests_meeting_every_bound_over_the_span():
    requests = [TimedRequest(0, 0.0, 0.5, 2.5, 5),  # TTFT 0.5, ITL 0.5, e2e 2.5
                TimedRequest(1, 1.0, 3.0, 4.0, 3),  # TTFT 2.0: too slow
                TimedRequest(2, 2.0, 2.2, 6.2, 3),  # ITL 2.0: too slow
                TimedRequest(3, 3.0, 3.5, 3.5, 1)]  # one token: no ITL to exceed
    steps = [type("Step", (), {"composition": c})() for c in (
        Composition((0, 1, 2), (DECODE, VERIFY, PREFILL), (1, 5, 30), (10, 20, 0), ("", "ngram", ""), (0, 4, 0)),
        Composition((1,), (VERIFY,), (3,), (40,), ("draft",), (2,)),
        Composition((3,), (PREFILL,), (12,), (0,), ("",), (0,)))]
    run = LoadRun(steps, requests)
    result = summarize_load("c=2", "ar", [run], parse_slo("ttft=1,itl=1"))
    assert (result.num_meeting_slo, result.span_s) == (2, pytest.approx(6.2))
    assert result.goodput_per_s == pytest.approx(2 / 6.2) and result.slo == "ttft<=1s, itl<=1s"
    assert summarize_load("c=2", "ar", [run], parse_slo("ttft=1,itl=1,e2e=2")).num_meeting_slo == 1
    assert summarize_load("c=2", "ar", [run], None).goodput_per_s is None
    assert summarize_load("c=2", "ar", [run], Slo()).goodput_per_s is None  # nothing stated: no goodput
    assert result.output_tok_per_s == pytest.approx(12 / 6.2) and result.ttft.p50_s == pytest.approx(0.5)
    # rounds by the decode and verify works beside them; a prefill chunk is no round
    assert [(a.batch_size, a.num_rounds, a.num_speculating) for a in speculation_by_batch(steps)] == [(1, 1, 1),
                                                                                                    (2, 2, 1)]
    assert result.share_speculating == pytest.approx(2 / 3)


def test_runs_under_several_seeds_are_pooled_as_if_served_one_after_another():
    """Percentiles over every request; counts summed; the rates per second over the runs'
    spans summed (so are their arrivals' spans)."""
    step = type("Step", (), {"composition": Composition((0,), (DECODE,), (1,), (10,), ("",), (0,))})()
    # spans 4 and 3 s, arrivals' spans 1 and 2 s
    first = LoadRun([step], [TimedRequest(0, 0.0, 0.5, 2.5, 5), TimedRequest(1, 1.0, 3.0, 4.0, 3)])
    second = LoadRun([], [TimedRequest(0, 0.5, 0.7, 1.7, 3), TimedRequest(1, 2.5, 2.6, 3.5, 2)])
    slo = parse_slo("ttft=1,itl=1")
    pooled = summarize_load("rate=1", "ar", [first, second], slo)
    assert (pooled.num_requests, pooled.num_steps, pooled.num_meeting_slo) == (4, 1, 3)
    assert (pooled.span_s, pooled.arrivals_span_s) == (pytest.approx(7.0), pytest.approx(3.0))
    assert pooled.goodput_per_s == pytest.approx(3 / 7) and pooled.output_tok_per_s == pytest.approx(13 / 7)
    assert pooled.ttft.p50_s == pytest.approx(0.35)  # of 0.5, 2.0, 0.2 and 0.1
    alone = [summarize_load("rate=1", "ar", [run], slo) for run in (first, second)]
    assert pooled.num_meeting_slo == sum(r.num_meeting_slo for r in alone)
    assert pooled.span_s == pytest.approx(sum(r.span_s for r in alone))


def test_a_sweep_under_several_seeds_pools_each_seeds_replay(capsys):
    """--seed 3,4 replays each load under seed 3's requests and arrivals and seed 4's, and
    counts both: the same requests as each seed alone."""
    argv = ["--trace", str(SERVING), "--policy", "ar,rakv", "--arrival-rate", "1,4", "--requests", "20",
            "--slo", "ttft=1,itl=0.2", "--json"]
    alone = []
    for seed in ("3", "4"):
        assert replay_main(argv + ["--seed", seed]) == 0
        alone.append({(r["load"], r["policy"]): r for r in rows_of(capsys)})
    assert replay_main(argv + ["--seed", "3,4"]) == 0
    pooled = {(r["load"], r["policy"]): r for r in rows_of(capsys)}
    assert set(pooled) == set(alone[0])
    for key, row in pooled.items():
        assert row["num_requests"] == 40
        for count in ("num_meeting_slo", "num_steps", "num_output_tokens"):
            assert row[count] == alone[0][key][count] + alone[1][key][count], (key, count)
        assert row["span_s"] == pytest.approx(alone[0][key]["span_s"] + alone[1][key]["span_s"])
    assert replay_main(argv[:-1] + ["--seed", "3,4"]) == 0
    assert "20 requests under each of seeds 3, 4, pooled" in capsys.readouterr().out


def test_long_replays_show_progress_on_stderr(capsys):
    """A bar where the work replays ``PROGRESS_MIN_REQUESTS`` requests or more, counted in
    its own units (a capacity's: policies); none below."""
    assert progress_bar(PROGRESS_MIN_REQUESTS - 1, "replay") is None
    assert progress_bar(3, "capacity", "policy", PROGRESS_MIN_REQUESTS - 1) is None
    bar = progress_bar(3, "capacity", "policy", PROGRESS_MIN_REQUESTS)
    bar.update()
    bar.close()
    assert "capacity" in capsys.readouterr().err


def test_the_best_fixed_policy_is_marked_per_load():
    base = summarize_load("c=1", "ar", [LoadRun([], [TimedRequest(0, 0.0, 1.0, 2.0, 3)])], None)
    results = [base, LoadResult(**{**base.__dict__, "policy": "spec-k4", "output_tok_per_s": 2.0}),
               LoadResult(**{**base.__dict__, "policy": "rakv", "output_tok_per_s": 9.0}),
               LoadResult(**{**base.__dict__, "load": "c=2"})]
    marked = mark_best_fixed(results)
    assert [(r.load, r.policy) for r in marked if r.best_fixed] == [("c=1", "spec-k4"), ("c=2", "ar")]


def test_a_sweep_is_summed_against_the_best_single_fixed_policy():
    """Goodput summed over the loads: the best fixed policy over the whole sweep (not per
    load), each adaptive policy against it, the best of all at each load in hindsight, and
    the loads where an adaptive policy met the SLO less often than ``kv-only``."""
    base = summarize_load("rate=1", "kv-only", [LoadRun([], [TimedRequest(0, 0.0, 1.0, 2.0, 3)])], parse_slo("ttft=5"))
    met = {("rate=1", "kv-only"): 10, ("rate=1", "joint-suffix-k8"): 9, ("rate=1", "joint-suffix-k1"): 12,
           ("rate=1", "rakv"): 9, ("rate=2", "kv-only"): 2, ("rate=2", "joint-suffix-k8"): 20,
           ("rate=2", "joint-suffix-k1"): 4, ("rate=2", "rakv"): 24}
    results = [LoadResult(**{**base.__dict__, "load": load, "policy": policy, "num_meeting_slo": n,
                             "num_requests": 30, "goodput_per_s": n / 10}) for (load, policy), n in met.items()]
    summary = sweep_summary(results)
    assert summary.best_fixed == "joint-suffix-k8"  # 2.9 req/s over the sweep; joint-suffix-k1 1.6, best at rate=1
    assert summary.over_best_fixed(summary.goodput_per_s["rakv"]) == pytest.approx(3.3 / 2.9 - 1)
    assert summary.envelope_per_s == pytest.approx(1.2 + 2.4)
    assert summary.below_kv_only == {"rakv": (Shortfall("rate=1", 9, 10, 30),)}
    lines = summary_lines(summary)
    assert "joint-suffix-k8 2.900; rakv 3.300 (+13.8 %)" in lines[0]
    assert lines[1].endswith("rakv at rate=1 (9 of 30 against 10)")
    assert sweep_summary(results[:4]) is None  # one load
    assert sweep_summary([replace(r, goodput_per_s=None) for r in results]) is None  # no SLO
    none_fixed = sweep_summary([r if r.policy == "rakv" else replace(r, goodput_per_s=0.0) for r in results])
    assert none_fixed.over_best_fixed(3.3) is None  # no margin over nothing, and no division by it
    assert "rakv 3.300 (no fixed policy within the SLO)" in summary_lines(none_fixed)[0]


def test_a_sweep_lists_its_references_apart_from_the_policies():
    """``foresight`` is summed but in neither the envelope nor the policies, and never
    below ``kv-only`` as a policy is; over open loops the ceiling is every request within
    the SLO over each load's arrivals' span, over closed loops there is none."""
    base = summarize_load("rate=1", "kv-only", [LoadRun([], [TimedRequest(0, 0.0, 1.0, 2.0, 3),
                                                             TimedRequest(1, 5.0, 6.0, 9.0, 3)])], parse_slo("ttft=5"))
    assert base.arrivals_span_s == 5.0 and base.num_requests == 2
    met = {("rate=1", "kv-only"): 2, ("rate=1", "rakv"): 1, ("rate=1", "foresight"): 2,
           ("rate=2", "kv-only"): 0, ("rate=2", "rakv"): 2, ("rate=2", "foresight"): 2}
    results = [replace(base, load=load, policy=policy, num_meeting_slo=n, goodput_per_s=n / 10,
                       arrivals_span_s={"rate=1": 5.0, "rate=2": 2.5}[load]) for (load, policy), n in met.items()]
    summary = sweep_summary(results)
    assert set(summary.goodput_per_s) == {"kv-only", "rakv"}
    assert summary.references_per_s == {"foresight": pytest.approx(0.4)}
    assert summary.envelope_per_s == pytest.approx(0.4)  # kv-only at rate=1, rakv at rate=2; not foresight
    assert summary.below_kv_only == {"rakv": (Shortfall("rate=1", 1, 2, 2),)}
    assert summary.ceiling_per_s == pytest.approx(2 / 5.0 + 2 / 2.5)
    lines = summary_lines(summary)
    # kv-only 0.2 the best fixed, rakv 0.3: half of foresight's gain of 0.2
    assert lines[-1].startswith("References, not policies: foresight (rakv knowing each round's outcome before it "
                                "drafts) 0.400 (+100.0 %; rakv 50 % of its gain); every request within the SLO")
    assert "1.200 (+500.0 %)" in lines[-1]
    assert summary.shares_of(0.2, ["rakv"]) == []  # a reference that gains nothing shares nothing
    closed = [replace(r, load=r.load.replace("rate", "c")) for r in results]
    assert sweep_summary(closed).ceiling_per_s is None  # a closed loop's arrivals follow the policy


def test_the_causal_bound_takes_the_best_setting_and_the_first_tried_on_a_tie():
    """The base first (so the bound is rakv at the least), then the grid in order; the
    grid's point equal to the base is not scored again."""
    scored = []

    def score_under(settings: Settings) -> float:
        scored.append(settings)
        return {2: 3.5, 8: 3.5, 16: 3.0}[settings.controller.rounds.max_k] + settings.controller.rounds.min_gain
    grid = {"planner.max_k": (2, 8, 16), "planner.min_gain": (0.0, 0.1)}
    ticks = []
    found = causal_bound(score_under, grid=grid, done=lambda: ticks.append(1))
    assert found == CausalBound(3.6, ("planner.max_k=2", "planner.min_gain=0.1"), 7)  # ties (8, 0.1)
    assert len(scored) == 6 and len(ticks) == num_settings(grid) == 6  # (16, 0.1) is the base: scored once
    assert tuned(Settings(), found.assignments).controller.rounds.max_k == 2


def test_the_causal_bound_under_load_is_rakv_under_its_tuned_settings(capsys):
    """``--policy causal-bound`` replays rakv under every setting of ``LOAD_GRID`` and stands
    beside the policies as rakv under the best: its summed goodput is the bound's score, at
    least rakv's, and rakv replayed with those settings serves each load as it does."""
    argv = ["--trace", str(SERVING), "--arrival-rate", "2,6", "--requests", "40", "--slo", "ttft=0.3,itl=0.01"]
    assert replay_main(argv + ["--policy", "kv-only,rakv,causal-bound", "--json"]) == 0
    rows = rows_of(capsys)
    bound = next(r for r in rows if "assignments" in r)
    assert bound["num_tried"] == 1 + num_settings(LOAD_GRID)
    by = {(r["load"], r["policy"]): r for r in rows if "load" in r}
    causal = [by[load, "causal-bound"] for load in ("rate=2", "rate=6")]
    assert sum(r["goodput_per_s"] for r in causal) == pytest.approx(bound["score"])
    assert bound["score"] > by["rate=2", "rakv"]["goodput_per_s"] + by["rate=6", "rakv"]["goodput_per_s"]
    assert bound["assignments"]  # here another setting serves better than the defaults
    sets = [arg for assignment in bound["assignments"] for arg in ("--set", assignment)]
    assert replay_main(argv + ["--policy", "rakv", "--json"] + sets) == 0
    for mine, theirs in zip(rows_of(capsys), causal):
        assert {k: v for k, v in mine.items() if k != "policy"} == {k: v for k, v in theirs.items() if k != "policy"}
    assert replay_main(argv + ["--policy", "kv-only,rakv,causal-bound"]) == 0
    out = capsys.readouterr().out
    assert f"the best of {bound['num_tried']} settings" in out
    assert "References, not policies: causal-bound (rakv under the settings that serve this sweep best" in out


def test_policy_all_under_load_leaves_the_oracles_out_and_foresight_in(capsys):
    assert replay_main(["--trace", str(SERVING), "--policy", "all", "--concurrency", "2", "--json"]) == 0
    policies = [r["policy"] for r in rows_of(capsys)]
    assert "rakv" in policies and "learned" in policies and "ar" in policies and policies[-1] == "foresight"
    assert not {"oracle", "round-oracle"} & set(policies)


@pytest.mark.parametrize("trace, argv, message", [
    (SERVING, ["--policy", "ar,oracle", "--concurrency", "1"], "oracle replays at batch 1 only"),
    (SERVING, ["--policy", "round-oracle"], "round-oracle replays at batch 1 only"),
    (TRACES / "smollm2-chat", ["--policy", "rakv,foresight"], "foresight replays under load only"),
    (TRACES / "smollm2-chat", ["--policy", "rakv,causal-bound"], "causal-bound replays under load only"),
    (SERVING, ["--slo", "ttft=x"], "--slo: ttft: 'x' is not a number"),
    (SERVING, ["--slo", "tpot=1"], "got 'tpot=1'"),
    (SERVING, ["--concurrency", "2,zero"], "--concurrency: 'zero' is not a number"),
    (SERVING, ["--arrival-rate", "-1"], "--arrival-rate: '-1' must be > 0"),
    (SERVING, ["--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
    (SERVING, ["--max-num-prefills", "0"], "max_num_prefills must be at least 1"),
    (TRACES / "smollm2-chat", ["--max-num-prefills", "1"], "--max-num-prefills needs a serving trace"),
    (SERVING, ["--timing", str(SERVING)], "--timing is for batch-1 replays"),
    (TRACES / "smollm2-chat", ["--concurrency", "1,2"], "--concurrency needs a serving trace"),
    (TRACES / "smollm2-chat", ["--slo", "ttft=1"], "--slo needs a serving trace"),
    (TRACES / "smollm2-chat", ["--arrival-rate", "1,2"], "a sweep of --arrival-rate values needs a serving trace"),
    (SERVING, ["--seed", "0,one"], "--seed takes non-negative integers, comma-separated (e.g. 0,1,2), got '0,one'"),
    (SERVING, ["--seed=-1,2"], "--seed takes non-negative integers, comma-separated (e.g. 0,1,2), got '-1,2'"),
    (SERVING, ["--seed", "1,2,1"], "--seed lists a seed twice: '1,2,1'"),
    (TRACES / "smollm2-chat", ["--seed", "0,1"], "several --seed values pool loads under load; at batch 1 give one"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, trace, argv, message):
    assert replay_main(["--trace", str(trace)] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if "needs a serving trace" in message:
        assert "--grid serving" in err


def test_slo_parse_errors_name_the_bad_part():
    assert parse_slo("ttft=2, itl=0.3") == Slo(ttft_s=2.0, itl_s=0.3)
    for bad, part in (("ttft=2,e2e=oops", "'oops'"), ("ttft", "'ttft'"), ("itl=0", "'0'"), ("p99=1", "'p99=1'")):
        with pytest.raises(ValueError, match=part) as caught:
            parse_slo(bad)
        assert "\n" not in str(caught.value)


def test_the_plots_are_written(tmp_path, capsys):
    assert replay_main(["--trace", str(SERVING), "--policy", "ar,rakv", "--concurrency", "1,4", "--arrival-rate", "2",
                        "--slo", "ttft=0.5", "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "goodput (req/s)" in out and all(f"| {load} | ar * |" in out for load in ("c=1", "c=4", "rate=2"))
    for name in ("latency_vs_load.png", "speculation_vs_batch.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_a_repeat_arriving_while_its_prompt_runs_reuses_it(capsys):
    """100 requests drawn from 16 code prompts at 1.4 req/s, past the knee: with prompts kept
    as their prefill ends, every repeat reuses the store and only each prompt's first arrival
    misses, as the engine did live; kept only at the finish, repeats that arrive while their
    prompt still runs prefill it again."""
    trace = TRACES / "qwen-coder-humaneval-serve-amx-knee"
    argv = ["--trace", str(trace), "--policy", "kv-only", "--arrival-rate", "1.4", "--requests", "100", "--json"]
    assert replay_main(argv) == 0
    (early,) = rows_of(capsys)
    assert replay_main(argv + ["--set", "store.early_prompts=false"]) == 0
    (late,) = rows_of(capsys)
    served = [r for r in table_to_rows("served", read_table(trace, "served"))
              if r.load == "rate=1.4" and r.policy == "kv-only"]
    assert sum(r.reused_tokens > 0 for r in served) == 84  # live: 16 distinct prompts
    assert early["num_reused"] == 84 > late["num_reused"]


def test_a_draft_catch_up_waits_for_a_step_that_prefills_no_other_request(capsys):
    """Code at 0.1 req/s, seed 1: the load's first request probes the draft model, whose
    first round catches the draft's cache up over the whole prompt. Planned beside another
    request's prefill (the setting off, as engines before it), that forward delayed the other's
    first token past the 3 s bound, and `rakv` fell one request below `kv-only`; held to a
    step without a prefill, no draft round catches up more than the limit beside one."""
    trace = load_trace(TRACES / "qwen-coder-humaneval-serve")
    costs = serve_validate.fit_serving_costs(trace)
    limit = Settings().controller.rounds.max_catch_up_beside_prefill

    def catch_ups_beside_prefill(settings: Settings) -> list[int]:
        serving = serve_validate.ServingReplay(trace, trace.decision_inputs(settings), 400, seed=1)
        run = serving.run(Load(rate_per_s=0.1), "rakv", costs)
        return [rows for step in run.steps if PREFILL in step.composition.kinds for rows in step.draft_rows if rows]

    assert all(rows <= limit for rows in catch_ups_beside_prefill(Settings()))
    assert max(catch_ups_beside_prefill(override(Settings(), "planner.max_catch_up_beside_prefill=null"))) > 100
    argv = ["--trace", str(TRACES / "qwen-coder-humaneval-serve"), "--policy", "kv-only,rakv", "--arrival-rate", "0.1",
            "--requests", "400", "--seed", "1", "--slo", "ttft=3,itl=0.2", "--json"]
    met = {}
    for extra in ([], ["--set", "planner.max_catch_up_beside_prefill=null"]):
        assert replay_main(argv + extra) == 0
        met[bool(extra)] = {row["policy"]: row["num_meeting_slo"] for row in rows_of(capsys)}
    assert met[False] == {"kv-only": 399, "rakv": 399}
    assert met[True] == {"kv-only": 399, "rakv": 398}


def test_a_recording_made_before_max_num_prefills_replays_as_its_engine_prefilled():
    """Its engine prefilled as many requests a step as rows and seats allowed; a replay
    given the option serves under it."""
    trace = load_trace(SERVING)
    assert "max_num_prefills" not in trace.meta.config
    seats = int(trace.meta.config["max_num_seqs"])
    assert serve_validate.ServingReplay(trace).batch.max_num_prefills == seats
    assert serve_validate.ServingReplay(trace, max_num_seqs=2).batch.max_num_prefills == 2
    assert serve_validate.ServingReplay(trace, max_num_prefills=1).batch.max_num_prefills == 1
