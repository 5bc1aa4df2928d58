"""The policy trainer: labels and family splits, training, tuning that resumes and is
shared by two workers through PostgreSQL, export and loading (never a pickle), the
learned policy live in the engine and in the simulator, one-line errors."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_greedy
from engine_checks import assert_rounds_replay, machine_free_prices, run_mix
from policy.evaluate import main as evaluate_main
from policy.round_data import ReadyingAll, collect, further_target, split_families
from policy.train import main as train_main
from profiler import policy_copies
from profiler.record import main as record
from rakv.acceptance import comparable_rounds
from rakv.controller import ControllerConfig
from rakv.cost_model import Action, RequestFeatures
from rakv.learned import LearnedPolicy, PolicyFileError, load_policy
from rakv.learned_rounds import HEADS, ROUND_FEATURES, RoundModel
from rakv.settings import Settings, settings_to_json
from simulator.session import Session
from simulator.replay import main as replay_main
from simulator.timing import load_timing
from simulator.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy") / "tiny-chat"
    assert record(["--workload", "chat", "--max-new-tokens", "10", "--runs-sample", "4", "--runs-max-new-tokens", "10",
                   "--runs-max-wait-s", "0", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def trained(trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("policies") / "tiny"
    out.mkdir()
    (out / "suffix.first.txt").write_text("tree\n")  # an earlier policy's head, which this one has not
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "4"]) == 0
    return out


def test_round_rows_label_every_decision_point_and_families_stay_together(trace):
    loaded = load_trace(trace)
    inputs = load_timing(None, loaded).decision_inputs(loaded, Settings())
    rows = collect(loaded, inputs, ControllerConfig(), 0.5)
    assert set(rows) == {"draft", "ngram"}  # the store drafter is the running estimate's (``LEARNED``)
    for drafter, r in rows.items():
        assert r.x.shape == (len(r.run), len(ROUND_FEATURES)) and len(r.run) > 20
        assert np.all((0 <= r.run) & (r.run <= r.cap)) and np.all((1 <= r.cap) & (r.cap <= 16))
        keep, share, weight = further_target(r)
        assert np.all((0 <= share) & (share <= 1)) and np.all(weight >= 1) and keep.sum() <= (r.run >= 1).sum()
    request = loaded.requests[0]  # a label is the run length at the decision point, from the trace
    policy = ReadyingAll(inputs, ControllerConfig(), 0.5, None)
    Session(policy, inputs, loaded.target_namespace, loaded.draft_namespace).run(request, request.max_new_tokens)
    (planner, log), = policy.logs
    assert [t for t, d, _ in log if d == "draft"][0] == 1  # the draft model needs the first token
    assert planner.drafters == ("draft", "ngram", "suffix")
    counts = {}
    for r in loaded.requests:
        counts[f"x/{r.group_id}"] = counts.get(f"x/{r.group_id}", 0) + 1
    split = split_families(counts)
    assert set(split.values()) == {"train", "validation", "test"} and set(split) == set(counts)


def test_export_is_text_and_json_and_compiled_as_lightgbm_predicts(trained, trace):
    sidecar = json.loads((trained / "policy.json").read_text())
    for key in ("features", "heads", "draft_prior", "schema_version", "hardware", "models", "controller", "metrics",
                "split"):
        assert key in sidecar
    assert sidecar["heads"] and sidecar["split"]["by"] == "prefix family"
    assert not (trained / "suffix.first.txt").exists()  # gone with the policy that had it
    import lightgbm as lgb
    policy = load_policy(trained)
    loaded = load_trace(trace)
    rows = collect(loaded, load_timing(None, loaded).decision_inputs(loaded, Settings()), policy.controller, 0.5)
    for drafter in sidecar["heads"]:
        for head, compiled in zip(HEADS, policy.model.heads[drafter]):
            text = (trained / f"{drafter}.{head}.txt").read_text()
            assert text.startswith("tree")
            want = lgb.Booster(model_str=text).predict(rows[drafter].x, raw_score=True)
            assert [compiled(*x) for x in rows[drafter].x] == list(want)  # bit for bit


def test_tuning_resumes_from_its_storage(trace, tmp_path):
    import optuna
    out = tmp_path / "p"
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "2", "--no-export"]) == 0
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "4"]) == 0
    study = optuna.load_study(study_name="p", storage=f"sqlite:///{tmp_path / 'p.optuna.db'}")
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == 4 and (out / "policy.json").is_file()


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy") / "tiny-serve"
    assert record(["--workload", "chat", "--max-new-tokens", "10", "--grid", "serving", "--skip", "runs",
                   "--serve-requests", "6", "--serve-rate", "40", "--serve-policies", "rakv", "--out", str(out)]) == 0
    return out


def test_a_served_learned_policy_is_kept_in_the_trace_and_replayed_from_it(trained, tmp_path):
    """The recorder serves a learned policy from a copy in the trace; the replay of the
    recording reads that copy, so its closed loop reproduces the recorded steps after the
    policy it was copied from is gone (a shipped policy trained again)."""
    from profiler.schema import policy_copy_dir
    from simulator.serve_validate import validate_serving
    policy_dir = tmp_path / "pol"
    shutil.copytree(trained, policy_dir)
    name = f"learned={policy_dir}"
    out = tmp_path / "tiny-serve"
    assert record(["--workload", "chat", "--max-new-tokens", "10", "--grid", "serving", "--skip", "runs",
                   "--serve-requests", "6", "--serve-concurrency", "2", "--serve-policies", name,
                   "--out", str(out)]) == 0
    copy = policy_copy_dir(out, name)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in policy_dir.iterdir())
    shutil.rmtree(policy_dir)
    rows = [row for row in validate_serving(load_trace(out)) if row.steps is not None]
    assert rows and all(row.steps.first_difference is None for row in rows)
    # held once beside another trace that served the same files, it replays the same
    again = tmp_path / "tiny-serve-again"
    shutil.copytree(out, again)
    assert policy_copies.share(tmp_path) == 2 and policy_copies.share(tmp_path) == 0
    assert copy.is_symlink() and policy_copy_dir(again, name).resolve() == copy.resolve()
    assert [p.name for p in (tmp_path / policy_copies.SHARED).iterdir()] == [policy_copies.digest(copy)]
    rows = [row for row in validate_serving(load_trace(again)) if row.steps is not None]
    assert rows and all(row.steps.first_difference is None for row in rows)


def test_tuning_under_load_scores_a_rate_sweep(trace, serving, tmp_path, capsys):
    """With --serve-trace, each trial is also scored by the goodput it serves over a rate
    sweep, replayed as simulator.replay replays it; the export reports the sweep."""
    from policy.load_sweep import LoadSweep, SweepConfig
    from profiler.serve_summary import parse_slo
    sweep = LoadSweep(serving, SweepConfig((20.0, 40.0), parse_slo("ttft=0.5"), num_requests=12, ttft_target_s=0.5))
    assert replay_main(["--trace", str(serving), "--policy", "rakv", "--arrival-rate", "20,40", "--slo", "ttft=0.5",
                        "--requests", "12", "--seed", "0", "--ttft-target", "0.5", "--json"]) == 0
    replayed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sweep.goodput_per_s("rakv") == pytest.approx(sum(r["goodput_per_s"] for r in replayed))
    out = tmp_path / "p"
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "2", "--serve-trace", str(serving),
                       "--arrival-rate", "20,40", "--slo", "ttft=0.5", "--serve-requests", "12",
                       "--ttft-target", "0.5"]) == 0
    assert ("tiny-serve at 20, 40 req/s (ttft<=0.5s; TTFT target 0.5 s; tuned on it): goodput summed, learned"
            in capsys.readouterr().err)
    (under_load,) = json.loads((out / "policy.json").read_text())["metrics"]["under_load"]
    assert under_load["trace"] == "tiny-serve" and under_load["num_requests"] == 12
    assert under_load["ttft_target_s"] == 0.5 and under_load["itl_target_s"] is None
    assert under_load["goodput_per_s"]["rakv"] == pytest.approx(sweep.goodput_per_s("rakv"))
    assert set(under_load["goodput_per_s"]) == {"learned", "rakv", "kv-only"} and under_load["seeds"] == [0]
    # under several seeds, each rate's runs pooled, as simulator.replay --seed S,S pools them
    pooled = LoadSweep(serving, SweepConfig((20.0, 40.0), parse_slo("ttft=0.5"), 12, (0, 1), ttft_target_s=0.5))
    assert replay_main(["--trace", str(serving), "--policy", "rakv", "--arrival-rate", "20,40", "--slo", "ttft=0.5",
                        "--requests", "12", "--seed", "0,1", "--ttft-target", "0.5", "--json"]) == 0
    replayed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert pooled.goodput_per_s("rakv") == pytest.approx(sum(r["goodput_per_s"] for r in replayed))


def test_tuning_under_load_needs_its_rates_and_slo(trace, serving, tmp_path, capsys):
    argv = ["--trace", str(trace), "--out", str(tmp_path / "p"), "--trials", "1", "--serve-trace", str(serving)]
    assert train_main(argv + ["--slo", "ttft=1"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --serve-trace needs --arrival-rate and --slo: the sweep whose "
                                               "goodput scores a trial")
    assert train_main(argv + ["--arrival-rate", "1", "--slo", "ttft=x"]) == 2
    assert capsys.readouterr().err.strip() == "error: --slo: ttft: 'x' is not a number of seconds"
    assert train_main(argv + ["--arrival-rate", "1", "--slo", "ttft=1", "--serve-seeds", "0,0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --serve-seeds lists a seed twice: '0,0'"
    assert train_main(argv + ["--arrival-rate", "1", "--slo", "ttft=1", "--ttft-target", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ttft-target must be 0 (none) or above, got -1"
    assert train_main(argv + ["--arrival-rate", "1", "--slo", "e2e=1e-9"]) == 2
    assert capsys.readouterr().err.strip().endswith("rakv meets the SLO (e2e<=1e-09s) at none of the rates, so the "
                                                    "sweep cannot score a trial: give lower --arrival-rate or a looser "
                                                    "--slo")
    assert train_main(argv[:-1] + [str(trace), "--arrival-rate", "1", "--slo", "ttft=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not a serving trace" in err and "\n" not in err


def test_an_unreachable_storage_is_one_line(trace, tmp_path, capsys):
    bad = f"postgresql+psycopg://postgres@/optuna?host={tmp_path / 'nosocket'}&port=1"
    assert train_main(["--trace", str(trace), "--out", str(tmp_path / "p"), "--trials", "1", "--storage", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot open Optuna study 'p' at postgresql") and "\n" not in err


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        pytest.fail("PostgreSQL is not installed (scripts/setup.sh --test installs it): the shared-study test needs it")
    return found[-1].parent


@pytest.fixture()
def postgres():
    """A PostgreSQL server of this test's own, on a Unix socket only; as root, run as the
    postgres user (initdb refuses root)."""
    bindir = _postgres_bin()
    home = Path(tempfile.mkdtemp(prefix="rakv-pg-", dir="/tmp"))
    data, sock = home / "data", home / "sock"
    sock.mkdir()
    prefix = []
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
        shutil.chown(sock, "postgres")
        prefix = ["runuser", "-u", "postgres", "--"]
    port = str(20000 + os.getpid() % 20000)
    subprocess.run(prefix + [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True)
    subprocess.run(prefix + [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(home / "log"), "-w", "-o",
                             f"-p {port} -k {sock} -c listen_addresses=''", "start"], check=True, capture_output=True)
    try:
        subprocess.run(prefix + [str(bindir / "createdb"), "-h", str(sock), "-p", port, "-U", "postgres", "optuna"],
                       check=True, capture_output=True)
        yield f"postgresql+psycopg://postgres@/optuna?host={sock}&port={port}"
    finally:
        subprocess.run(prefix + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def test_two_workers_share_one_postgresql_study(trace, tmp_path, postgres):
    import optuna
    argv = [sys.executable, "-m", "policy.train", "--trace", str(trace), "--out", str(tmp_path / "shared"),
            "--trials", "6", "--storage", postgres, "--study", "shared", "--no-export"]
    workers = [subprocess.Popen(argv + ["--worker", str(i)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for i in range(2)]
    for w in workers:
        _, err = w.communicate(timeout=600)
        assert w.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name="shared", storage=postgres)
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == 6 and len({t.number for t in study.trials}) == len(study.trials)


def test_learned_policy_in_the_simulator_and_its_fallback(trained, trace, capsys):
    assert replay_main(["--trace", str(trace), "--policy", f"rakv,learned={trained}", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in rows] == ["rakv", f"learned={trained}"] and rows[1]["num_requests"] == 20
    other = load_trace(ROOT / "traces" / "smollm2-humaneval") if (ROOT / "traces" / "smollm2-humaneval").is_dir() else None
    if other is not None and other.inputs is not None:
        assert replay_main(["--trace", str(other.path), "--policy", f"learned={trained}", "--strict"]) == 2
        assert "trained for other models" in capsys.readouterr().err


class _Drafting(LearnedPolicy):
    """Readies the draft model on every request, and plans with a model that answers every
    feature (the tiny pair's drafters rarely agree, so a trained one never drafts), under
    the default controller rather than the one the trial tuned on this machine's trace."""

    def __init__(self, policy_file, timings):
        policy_file = replace(policy_file, sidecar={**policy_file.sidecar,
                                                    "controller": settings_to_json(ControllerConfig())})
        super().__init__(policy_file, timings)
        at = {name: i for i, name in enumerate(ROUND_FEATURES)}

        def first(*x):
            return 3.0 * math.sin(x[at["position"]] + 1.3 * x[at["last_accepted"]] + 0.7 * x[at["extent"]]
                                  + 2.0 * x[at["draft_prob"]] + 0.5 * x[at["trials"]] + x[at["estimate"]]
                                  + x[at["since_last"]] + x[at["recent_2"]] + x[at["confidence"]]) + 1.0

        def further(*x):
            return math.cos(x[at["proposed"]] + x[at["tokens_left"]] + x[at["signal"]] + x[at["prompt_repeat"]])

        self.file = replace(policy_file, model=RoundModel({"draft": (first, further), "ngram": (first, further)}))

    def decide(self, features):
        return Action(0, 1, "draft")


def _fixed_prices(pair):
    """Prices that do not turn on the machine (``machine_free_prices``), a verify of any
    length at the price of a step (what a GPU sees): then a round pays wherever
    P(m >= 1) > 0.1."""
    from rakv.calibrate import load_or_calibrate
    return machine_free_prices(load_or_calibrate(pair), 0.0)


def test_learned_planner_live_is_greedy_and_its_rounds_replay_exactly(trained, trace, tiny_pair):
    from rakv.engine import Engine
    loaded = load_trace(trace)
    timings = _fixed_prices(tiny_pair)
    engine = Engine(tiny_pair, _Drafting(load_policy(trained), timings), loaded.inputs.engine)
    inputs = replace(loaded.inputs.with_settings(Settings()), timings=timings)
    session = Session(_Drafting(load_policy(trained), timings), inputs, loaded.target_namespace,
                      loaded.draft_namespace)
    drafted = set()
    for request in loaded.requests[:8]:
        live = engine.generate(list(request.prompt_ids), request.max_new_tokens)
        assert list(live.output_ids) == hf_greedy(tiny_pair, list(request.prompt_ids), request.max_new_tokens)
        replayed = session.run(request, request.max_new_tokens)
        recorded, ours = comparable_rounds([(r.start, r.drafter, r.k, r.num_proposed, r.accepted) for r in live.rounds],
                                           replayed.rounds)
        assert recorded == ours
        drafted |= {(r[1], r[2]) for r in ours}
    assert len(drafted) >= 4, drafted  # rounds of both drafters, of several lengths


def test_learned_planner_drafts_from_the_store_and_its_rounds_replay_exactly(trained, tiny_pair):
    """The round models have no store-drafter head; its rounds are priced as ``rakv`` prices
    them, and a repeat drafts its whole output from the store."""
    prompt = tiny_pair.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    prompts = [prompt, tiny_pair.encode("# a\n") + prompt, prompt]
    results, planners = run_mix(tiny_pair, _Drafting(load_policy(trained), _fixed_prices(tiny_pair)), prompts, 24)
    for p, result in zip(prompts, results):
        assert list(result.output_ids) == hf_greedy(tiny_pair, p, 24)
    assert all("suffix" in p.drafters for p in planners)
    assert sum(r.accepted for r in results[2].rounds if r.drafter == "suffix") >= 16
    assert assert_rounds_replay(tiny_pair, prompts, results, planners, 24) >= len(results[2].rounds)


def test_the_store_drafters_rounds_start_from_the_policys_running_estimate(trained, tiny_pair):
    """A drafter without heads (the store drafter: not in ``rakv.learned_rounds.LEARNED``)
    starts each request's rounds from the policy's running estimate by signal, carried
    across requests as ``rakv``'s; the drafters with heads start every request from the
    same priors."""
    policy = _Drafting(load_policy(trained), _fixed_prices(tiny_pair))
    prompt = tiny_pair.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    results, planners = run_mix(tiny_pair, policy, [prompt, prompt, prompt], 24)
    assert sum(r.accepted for r in results[1].rounds if r.drafter == "suffix") >= 16  # the repeat drafts from the store
    assert not planners[0].acceptance  # nothing seen yet
    assert planners[2].acceptance and {d for d, _ in planners[2].acceptance} == {"suffix"}
    seen = policy.analytic.signal_acceptance
    assert {d for d, _ in seen} > {"suffix"}  # the draft model's and prompt lookup's are not carried
    features = RequestFeatures(len(prompt), 24, 0, 0, False, prompt_ids=np.array(prompt))
    planner = LearnedPolicy.planner(policy, features, Action(0, 1, "draft"))
    assert planner.acceptance == {key: a for key, a in seen.items() if key[0] == "suffix"}
    assert planner.memo_key is None  # its rounds depend on the requests before


def test_learned_policy_runs_live(trained, tiny_pair):
    from rakv.calibrate import load_or_calibrate
    from rakv.engine import Engine
    engine = Engine(tiny_pair, LearnedPolicy(load_policy(trained), load_or_calibrate(tiny_pair)))
    prompt = tiny_pair.encode("User: what is a cache?\nAssistant:")
    assert list(engine.generate(prompt, 10).output_ids) == hf_greedy(tiny_pair, prompt, 10)


def test_evaluate_reports_every_metric(trained, trace, capsys):
    assert evaluate_main(["--policy", str(trained), "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["tokens_per_s"]) == {"learned", "rakv", "oracle", "round-oracle"}
    assert report["tokens_per_s"]["round-oracle"] >= max(report["tokens_per_s"][k] for k in ("learned", "rakv"))
    assert "headroom_captured" in report and set(report["prediction"]) <= {"draft", "ngram", "suffix"}
    # the causal bound tries today's settings first, so it is rakv at the least
    assert report["causal"]["score"] >= report["tokens_per_s"]["rakv"] and report["causal"]["num_tried"] == 61
    assert "causal_headroom_captured" in report
    for p in report["prediction"].values():
        assert {"auc", "brier", "ewma_auc", "ewma_brier"} <= set(p)
    assert {"spearman", "mean_regret", "action_accuracy", "k_accuracy", "mape"} <= set(report["paper_actions"])


def test_paper_bound_prices_each_request_with_its_own_acceptance(trace, capsys):
    from bench.paper_bound import ESTIMATES, main as bound_main
    from policy.paper_actions import paper_metrics
    loaded = load_trace(trace)
    timing = load_timing(None, loaded)
    inputs = timing.decision_inputs(loaded, Settings())
    assert bound_main(["--trace", str(trace), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)[trace.name]
    assert set(found) == set(ESTIMATES)
    for m in found.values():
        assert m["num_requests"] == len(loaded.requests) and m["mean_regret"] >= 0 and 0 <= m["action_accuracy"] <= 1
    assert found["running estimate"] == pytest.approx(dataclasses.asdict(paper_metrics(loaded, timing, inputs)),
                                                      nan_ok=True)
    asked = []
    paper_metrics(loaded, timing, inputs, lambda request: asked.append(request.request_id) or 0.5)
    assert sorted(asked) == sorted(r.request_id for r in loaded.requests)  # once per request, before it runs


def _head(policy_dir: Path) -> Path:
    return sorted(policy_dir.glob("*.first.txt"))[0]


@pytest.mark.parametrize("damage, message", [
    (lambda d: _head(d).write_text(_head(d).read_text()[:300]), "not a LightGBM text model"),
    (lambda d: _head(d).write_text(_head(d).read_text().replace("end of trees", "")), "truncated"),
    (lambda d: (d / "policy.json").write_text("{not json"), "not valid JSON"),
    (lambda d: _head(d).unlink(), ".first.txt"),
    (lambda d: (d / "policy.json").write_text(json.dumps({"format": "rakv-learned-policy", "format_version": 1})),
     "format version 1"),
    (lambda d: (d / "policy.json").write_text(json.dumps({"format": "rakv-learned-policy", "format_version": 2})),
     "lacks features"),
])
def test_damaged_policy_is_one_line(trained, tmp_path, capsys, damage, message):
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    damage(copy)
    with pytest.raises(PolicyFileError, match=message):
        load_policy(copy)
    from rakv.generate import main as generate_main
    assert generate_main(["--policy", str(copy), "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
