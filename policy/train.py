"""``python -m policy.train``: fit, tune and export the learned policy.

    python -m policy.train --trace traces/smollm2-humaneval traces/smollm2-chat --out policies/smollm2
    python -m policy.train --trace traces/qwen-coder-humaneval --timing traces/qwen-coder-ops --out policies/qwen
    python -m policy.train ... --storage postgresql+psycopg://postgres@/optuna?host=/tmp/pg --study shared

Every request of every trace is a group whose choices are labelled (``policy.dataset``);
train, validation and test are split by prefix family. Optuna (seeded TPE, median
pruning) searches the LightGBM parameters, the model kind (regression or lambdarank) and
the controller's EWMA decay and planner margin together, minimising the mean regret on
validation; every trial is stored (a SQLite file beside ``--out`` by default, or any
SQLAlchemy URL, so several machines can tune one study), and a study resumes where it
stopped: ``--trials`` is the total it runs to. The best trial's model is refitted on train
and validation and exported (``save_policy``: the format ``rakv.learned`` loads) with its
test metrics. Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from policy.dataset import SPLITS, build_groups, split_families
from policy.model import KINDS, analytic_scores, metrics, model_scores, train
from profiler.schema import SCHEMA_VERSION, TraceError
from rakv.cli import run_cli
from rakv.controller import ControllerConfig
from rakv.learned import FORMAT, FORMAT_VERSION, MODEL_FILE, SIDECAR_FILE, SIDECAR_KEYS
from rakv.learned_features import FEATURES
from rakv.round_planner import PlannerConfig
from rakv.settings import settings_to_json
from simulator.costs import CostModelError
from simulator.session import SessionError
from simulator.timing import load_timing
from simulator.trace import load_trace

PRUNE_EVERY = 20  # boosting rounds between pruning checks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m policy.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, nargs="+", required=True, help="trace directories to learn from")
    p.add_argument("--timing", type=Path, default=None,
                   help="timing trace for the traces that have no ops table of their own (same model shapes)")
    p.add_argument("--out", type=Path, required=True, help="policy directory to write (model.txt, policy.json)")
    p.add_argument("--trials", type=int, default=40, help="trials the study runs to, in all (default: 40)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///<out>.optuna.db)")
    p.add_argument("--study", default=None, help="study name (default: the --out directory's name)")
    p.add_argument("--resample", type=int, default=200,
                   help="per trace, also this many requests resampled with their prefix families: more store and "
                        "estimate states to learn from (default: 200; 0: the recorded order only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the resampling and the sampler (default: 0)")
    p.add_argument("--worker", type=int, default=0, help="this worker's number: its sampler seed is seed + worker")
    p.add_argument("--no-export", action="store_true", help="tune only (a worker beside another that exports)")
    return p.parse_args(argv)


class Data:
    """The traces and their timings; groups per controller setting, computed once each."""

    def __init__(self, paths: list[Path], timing_path: Path | None, seed: int, resample: int = 0):
        self.sources = []
        for path in paths:
            trace = load_trace(path)
            has_ops = bool(trace.ops)
            if not has_ops and timing_path is None:
                raise TraceError(f"{path}: no ops table: give --timing")
            self.sources.append((trace, load_timing(path if has_ops else timing_path, trace)))
        self.seed, self.resample = seed, resample
        self._cache: dict[ControllerConfig, dict] = {}

    def splits(self, controller: ControllerConfig) -> dict:
        if controller not in self._cache:
            groups = [g for trace, timing in self.sources for g in groups_of(trace, timing, controller, self.resample,
                                                                              self.seed)]
            if len(self._cache) >= 8:  # a few settings at a time: memory
                self._cache.pop(next(iter(self._cache)))
            self._cache[controller] = split_families(groups, self.seed)
        return self._cache[controller]


def groups_of(trace, timing, controller: ControllerConfig | None, resample: int, seed: int) -> list:
    """The trace's groups as recorded, then ``resample`` more (see ``--resample``)."""
    groups = build_groups(trace, timing, controller)
    return groups + (build_groups(trace, timing, controller, resample, seed + 1) if resample else [])


def controller_config(ewma_decay: float, min_gain: float) -> ControllerConfig:
    """The controller settings a trial tunes; the rest are the defaults."""
    return ControllerConfig(ewma_decay=ewma_decay, rounds=PlannerConfig(min_gain=min_gain))


def controller_of(trial) -> ControllerConfig:
    # on a grid: each setting's labels are simulated once, however many trials draw it
    return controller_config(trial.suggest_float("ewma_decay", 0.05, 0.6, step=0.05),
                             trial.suggest_float("min_gain", 0.0, 0.5, step=0.05))


def params_of(trial) -> tuple[str, dict, int]:
    kind = trial.suggest_categorical("kind", KINDS)
    params = {"num_leaves": trial.suggest_int("num_leaves", 4, 31, log=True),
              "learning_rate": trial.suggest_float("learning_rate", 0.01, 0.3, log=True),
              "min_data_in_leaf": trial.suggest_int("min_data_in_leaf", 2, 50, log=True),
              "feature_fraction": trial.suggest_float("feature_fraction", 0.5, 1.0),
              "lambda_l2": trial.suggest_float("lambda_l2", 1e-3, 10.0, log=True)}
    return kind, params, trial.suggest_int("num_rounds", 20, 120, step=20)  # trees cost decision time


def objective(data: Data, seed: int):
    import optuna

    def run(trial) -> float:
        splits = data.splits(controller_of(trial))
        kind, params, num_rounds = params_of(trial)
        validation = splits["validation"]

        def prune(env):
            if env.iteration and env.iteration % PRUNE_EVERY == 0:
                regret = metrics(validation, model_scores(kind, env.model, validation)[0]).mean_regret
                trial.report(regret, env.iteration)
                if trial.should_prune():
                    raise optuna.TrialPruned()

        booster = train(kind, splits["train"], params, num_rounds, seed, callbacks=[prune])
        return metrics(validation, model_scores(kind, booster, validation)[0]).mean_regret
    return run


def open_study(storage: str, name: str, seed: int):
    """The study, created or loaded; its sampler is seeded by ``seed`` and the trials
    already stored, so a resumed study does not draw its first trials' parameters again."""
    import optuna
    from sqlalchemy.exc import IntegrityError
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for attempt in range(5):  # workers starting together race to create the tables and the study
        try:
            study = optuna.create_study(storage=storage, study_name=name, direction="minimize", load_if_exists=True,
                                        pruner=optuna.pruners.MedianPruner(n_startup_trials=5,
                                                                           n_warmup_steps=PRUNE_EVERY))
            break
        except (IntegrityError, optuna.exceptions.DuplicatedStudyError):
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.get_trials(deepcopy=False)))
    return study


FINISHED = ("COMPLETE", "PRUNED")


def finished(study) -> int:
    return sum(t.state.name in FINISHED for t in study.get_trials(deepcopy=False))


def tune(data: Data, storage: str, name: str, trials: int, seed: int):
    """Run trials until the study holds ``trials`` finished ones, whoever ran them. A
    trial is numbered by the storage when it is asked for; one preceded by ``trials``
    finished or running trials is not run (it is told failed, and the worker stops), so
    workers sharing a study finish exactly ``trials`` between them."""
    import optuna
    from tqdm import tqdm
    study = open_study(storage, name, seed)
    bar = tqdm(total=trials, initial=min(finished(study), trials), desc="trials", unit="trial", file=sys.stderr,
               leave=False)
    run_trial = objective(data, seed)
    while True:
        trial = study.ask()
        ahead = sum(t.number < trial.number and (t.state.name in FINISHED or t.state.name == "RUNNING")
                    for t in study.get_trials(deepcopy=False))
        if ahead >= trials:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)  # over the study's total: not run
            break
        try:
            study.tell(trial, run_trial(trial))
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        bar.update(1)
    bar.close()
    return study


def save_policy(path: Path, booster, sidecar: dict) -> None:
    """Write the model and its sidecar, each atomically (temp file, then rename)."""
    path.mkdir(parents=True, exist_ok=True)
    sidecar = {"format": FORMAT, "format_version": FORMAT_VERSION, "features": list(FEATURES), **sidecar}
    missing = [k for k in SIDECAR_KEYS if k not in sidecar]
    if missing:
        raise ValueError(f"policy sidecar lacks {', '.join(missing)}")
    for name, text in ((MODEL_FILE, booster.model_to_string()), (SIDECAR_FILE, json.dumps(sidecar, indent=1))):
        tmp = path / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(path / name)


def export(data: Data, study, out: Path, seed: int) -> dict:
    """Refit the best trial on train and validation, measure it on test, write the policy."""
    best = study.best_trial
    controller = controller_config(best.params["ewma_decay"], best.params["min_gain"])
    splits = data.splits(controller)
    kind = best.params["kind"]
    params = {k: best.params[k] for k in ("num_leaves", "learning_rate", "min_data_in_leaf", "feature_fraction",
                                          "lambda_l2")}
    booster = train(kind, splits["train"] + splits["validation"], params, best.params["num_rounds"], seed)
    test = splits["test"]
    by_kind = {}
    for trial_kind in KINDS:
        values = [t.value for t in study.trials if t.value is not None and t.params.get("kind") == trial_kind]
        by_kind[trial_kind] = min(values) if values else None
    report = {"kind": kind, "best_trial": best.number, "validation_mean_regret": best.value,
              "validation_mean_regret_by_kind": by_kind,
              "test": asdict(metrics(test, *model_scores(kind, booster, test))),
              "test_rakv": asdict(metrics(test, *analytic_scores(test), chosen_per_group=[g.analytic_choice for g in test])),
              "num_requests": {s: len(splits[s]) for s in SPLITS},
              "num_labels": {"measured": int(sum(g.measured.sum() for s in SPLITS for g in splits[s])),
                             "simulated": int(sum((~g.measured).sum() for s in SPLITS for g in splits[s]))}}
    traces = [trace for trace, _ in data.sources]
    save_policy(out, booster, {
        "kind": kind, "schema_version": SCHEMA_VERSION, "choices": [str(c) for c in test[0].choices] if test else [],
        "hardware": [t.meta.hardware for t in traces],
        "models": [{"target": t.target_namespace, "draft": t.draft_namespace} for t in traces],
        "controller": settings_to_json(controller), "metrics": report,
        "split": {"seed": seed, "by": "prefix family", "resample": data.resample,
                  "traces": [str(t.path.name) for t in traces],
                  "test_families": sorted({g.family for g in test})}})
    return report


def run(args: argparse.Namespace) -> int:
    if args.trials < 1:
        raise ValueError(f"--trials must be at least 1, got {args.trials}")
    start = time.perf_counter()
    if args.resample < 0:
        raise ValueError(f"--resample must be at least 0, got {args.resample}")
    data = Data(args.trace, args.timing, args.seed, args.resample)
    storage = args.storage or f"sqlite:///{args.out.parent.resolve() / (args.out.name + '.optuna.db')}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    study = tune(data, storage, args.study or args.out.name, args.trials, args.seed + args.worker)
    print(f"study {study.study_name}: {finished(study)} trials; best mean validation regret "
          f"{study.best_value:.4%} (trial {study.best_trial.number}, {study.best_trial.params['kind']})", file=sys.stderr)
    if not args.no_export:
        report = export(data, study, args.out, args.seed)
        test = report["test"]
        print(f"wrote {args.out}: test regret {test['mean_regret']:.4%} (p95 {test['p95_regret']:.4%}), "
              f"choice accuracy {test['action_accuracy']:.1%}, Spearman {test['spearman']:.3f}; analytic rakv "
              f"regret {report['test_rakv']['mean_regret']:.4%}; {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (ValueError, TraceError, CostModelError, SessionError, OSError))


if __name__ == "__main__":
    sys.exit(main())
