"""The policy trainer: labels and family splits, training, tuning that resumes and is
shared by two workers through PostgreSQL, export and loading (never a pickle), the
learned policy live in the engine and in the simulator, one-line errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_greedy
from policy.dataset import build_groups, split_families
from policy.evaluate import main as evaluate_main
from policy.model import model_scores
from policy.train import main as train_main
from profiler.record import main as record
from rakv.choices import all_choices
from rakv.learned import LearnedPolicy, PolicyFileError, load_policy
from simulator.replay import main as replay_main
from simulator.timing import load_timing
from simulator.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy") / "tiny-chat"
    assert record(["--workload", "chat", "--max-new-tokens", "10", "--runs-sample", "4", "--runs-max-new-tokens", "10",
                   "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def trained(trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("policies") / "tiny"
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "4"]) == 0
    return out


def test_groups_label_every_choice_and_families_stay_together(trace):
    loaded = load_trace(trace)
    groups = build_groups(loaded, load_timing(trace, loaded))
    assert len(groups) == 20 and all(len(g.choices) == len(all_choices(True)) == 26 for g in groups)
    assert all(np.all(g.cost_s > 0) and g.rows.shape == (26, len(g.rows[0])) for g in groups)
    assert sum(g.measured.sum() for g in groups) > 0  # fixed policies' recorded runs label their choices
    splits = split_families(groups)
    families = [{g.family for g in split} for split in splits.values()]
    assert all(not a & b for i, a in enumerate(families) for b in families[i + 1:])
    assert all(splits[s] for s in splits) and sum(len(v) for v in splits.values()) == 20


def test_export_is_text_and_json_and_decides_as_in_memory(trained, trace):
    assert (trained / "model.txt").read_text().startswith("tree")
    sidecar = json.loads((trained / "policy.json").read_text())
    for key in ("features", "schema_version", "hardware", "models", "controller", "metrics", "split"):
        assert key in sidecar
    assert set(sidecar["controller"]) >= {"ewma_decay", "rounds"} and sidecar["split"]["by"] == "prefix family"
    policy = load_policy(trained)
    loaded = load_trace(trace)
    groups = build_groups(loaded, load_timing(trace, loaded), policy.controller)
    import lightgbm as lgb
    reloaded = lgb.Booster(model_str=policy.booster.model_to_string())
    first, second = model_scores(policy.kind, policy.booster, groups)[0], model_scores(policy.kind, reloaded, groups)[0]
    assert [int(np.argmin(a)) for a in first] == [int(np.argmin(b)) for b in second]
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_tuning_resumes_from_its_storage(trace, tmp_path):
    import optuna
    out = tmp_path / "p"
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "2", "--no-export"]) == 0
    assert train_main(["--trace", str(trace), "--out", str(out), "--trials", "4"]) == 0
    study = optuna.load_study(study_name="p", storage=f"sqlite:///{tmp_path / 'p.optuna.db'}")
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == 4 and (out / "model.txt").is_file()


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


def test_learned_policy_live_is_greedy(trained, tiny_pair):
    from rakv.calibrate import load_or_calibrate
    from rakv.engine import Engine
    policy = LearnedPolicy(load_policy(trained), load_or_calibrate(tiny_pair))
    engine = Engine(tiny_pair, policy)
    prompts = [tiny_pair.encode(t) for t in ("User: what is a cache?\nAssistant:", "User: what is a cache?\nAssistant: it")]
    for prompt in prompts:
        assert list(engine.generate(prompt, 10).output_ids) == hf_greedy(tiny_pair, prompt, 10)


def test_evaluate_reports_every_metric(trained, trace, capsys):
    assert evaluate_main(["--policy", str(trained), "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("spearman", "mean_regret", "p95_regret", "k_accuracy", "action_accuracy", "mape"):
        assert key in report
    assert {"rakv", "oracle"} <= set(report["baselines"]) and report["baselines"]["oracle"]["mean_regret"] == 0


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.txt").write_text((d / "model.txt").read_text()[:200]), "not a LightGBM text model"),
    (lambda d: (d / "policy.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "model.txt").unlink(), "no model.txt"),
    (lambda d: (d / "policy.json").write_text(json.dumps({"format": "rakv-learned-policy", "format_version": 1})),
     "lacks kind"),
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
