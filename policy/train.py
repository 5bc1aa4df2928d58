"""``python -m policy.train``: fit, tune and export the learned round planner.

    python -m policy.train --trace traces/smollm2-chat traces/smollm2-humaneval --out policies/smollm2
    python -m policy.train --trace traces/qwen-coder-humaneval traces/qwen-coder-sharegpt --out policies/qwen-coder
    python -m policy.train ... --storage postgresql+psycopg://postgres@/optuna?host=/tmp/pg --study shared

The decision points of every request are labelled with each drafter's run length
(``policy.round_data``: the draft model's and prompt lookup's; the store drafter is left to
the policy's running estimate); families are split train / validation / test, and the test
families never reach fitting or tuning. Per drafter two LightGBM heads are fitted: P(m >= 1)
and P(m >= j + 1 | m >= j) (``rakv.learned_rounds``). Optuna (seeded TPE, median pruning)
tunes the trees and the planner's margin and confidence threshold (``planner.min_gain``,
``planner.draft_confidence``) with the simulator as the
judge: a trial's objective is the replayed tokens per second of service of the learned
policy on the validation families, over ``rakv``'s, averaged over the traces, a loss on any
trace weighing double (``score``; a trial is pruned after any trace). Every trial is stored (a SQLite file beside ``--out`` by
default, or any SQLAlchemy URL, so several machines can tune one study), and a study
resumes where it stopped: ``--trials`` is the total it runs to.

The best trial is refitted on train and validation, with the decision points the learned
planner itself visits added (a second pass), measured on the test families
(``policy.evaluate``), and exported: LightGBM text per head and a JSON sidecar, never a
pickle. Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from policy.evaluate import evaluate_trace, service_tokens_per_s, session_of, share, subset
from policy.load_sweep import LoadSweep, SweepConfig
from policy.round_data import (DrafterRows, collect, draft_acceptance, first_target, further_target, split_families,
                               token_prior)
from profiler.arrivals import parse_loads, parse_seeds, seed_type
from profiler.schema import SCHEMA_VERSION, TraceError
from profiler.serve_summary import slo_option
from rakv.cli import run_cli
from rakv.controller import ControllerConfig
from rakv.learned import (FORMAT, FORMAT_VERSION, SIDECAR_FILE, SIDECAR_KEYS, LearnedPolicy, PolicyFile, head_file,
                          token_priors_to_json)
from rakv.learned_rounds import HEADS, ROUND_FEATURES, RoundModel
from rakv.scheduler import ITL_TARGET_HELP, MAX_NUM_PREFILLS_HELP, TTFT_TARGET_HELP
from rakv.settings import Settings, settings_to_json
from rakv.trees import compile_model
from simulator.costs import CostModelError
from simulator.serve_validate import check_targets
from simulator.session import SessionError
from simulator.timing import load_timing
from simulator.trace import load_trace

MAX_ROUNDS, MAX_LEAVES = 40, 15  # trees cost decision time: 4 heads of 40 trees of depth < 15 take ~20 us


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m policy.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, nargs="+", required=True, help="trace directories of one pair to learn from")
    p.add_argument("--timing", type=Path, default=None,
                   help="timing trace for traces with no ops that name none (same model shapes)")
    p.add_argument("--out", type=Path, required=True, help="policy directory to write")
    p.add_argument("--trials", type=int, default=30, help="trials the study runs to, in all (default: 30)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///<out>.optuna.db)")
    p.add_argument("--study", default=None, help="study name (default: the --out directory's name)")
    p.add_argument("--seed", type=seed_type, default=0, help="seed of the split, the trees and the sampler (default: 0)")
    p.add_argument("--worker", type=int, default=0, help="this worker's number: its sampler seed is seed + worker")
    p.add_argument("--no-export", action="store_true", help="tune only (a worker beside another that exports)")
    load = p.add_argument_group("under load (serving traces: profiler.record --grid serving --serve-rate)")
    load.add_argument("--serve-trace", type=Path, nargs="+", default=[], metavar="TRACE",
                      help="also score each trial by the goodput it serves over a rate sweep of these serving "
                           "traces (policy.load_sweep), beside the traces' tokens per second")
    load.add_argument("--arrival-rate", default=None, metavar="R[,R...]",
                      help="the sweep's Poisson rates, requests per second (needed with --serve-trace)")
    load.add_argument("--slo", default=None, metavar="ttft=S,itl=S,e2e=S",
                      help="the goodput's bounds in seconds, any subset (needed with --serve-trace)")
    load.add_argument("--serve-requests", type=int, default=200, metavar="N",
                      help="requests per rate, resampled with their prefix families (default: 200)")
    load.add_argument("--serve-seeds", default=None, metavar="S[,S...]",
                      help="seeds of the sweep's resampling and arrivals: each rate is replayed under each and "
                           "pooled, a steadier objective than more requests of one seed (default: --seed)")
    load.add_argument("--itl-target", type=float, default=None, metavar="S",
                      help=f"the sweep's server: {ITL_TARGET_HELP}; 0: none (default: each trace's recording's)")
    load.add_argument("--ttft-target", type=float, default=None, metavar="S",
                      help=f"the sweep's server: {TTFT_TARGET_HELP}; 0: none (default: each trace's recording's)")
    load.add_argument("--max-num-prefills", type=int, default=None, metavar="N",
                      help=f"the sweep's server: {MAX_NUM_PREFILLS_HELP} (default: each trace's recording's)")
    return p.parse_args(argv)


def load_sweeps(args: argparse.Namespace, pair: str | None) -> list[LoadSweep]:
    """``--serve-trace``'s sweeps, checked: the rates and SLO given, the traces of ``pair``."""
    if not args.serve_trace:
        return []
    if args.arrival_rate is None or args.slo is None:
        raise ValueError("--serve-trace needs --arrival-rate and --slo: the sweep whose goodput scores a trial")
    if args.serve_requests < 1:
        raise ValueError(f"--serve-requests must be at least 1, got {args.serve_requests}")
    check_targets(args.itl_target, args.ttft_target)
    slo = slo_option(args.slo)
    seeds = (args.seed,) if args.serve_seeds is None else parse_seeds(args.serve_seeds, "--serve-seeds")
    config = SweepConfig(parse_loads(args.arrival_rate, "--arrival-rate", False), slo, args.serve_requests, seeds,
                         args.itl_target, args.ttft_target, args.max_num_prefills)
    sweeps = [LoadSweep(path, config) for path in args.serve_trace]
    for sweep in sweeps:
        if sweep.trace.meta.models.get("pair") != pair:
            raise ValueError(f"{sweep.trace.path}: a serving trace of {sweep.trace.meta.models.get('pair')}, "
                             f"not of {pair}, the pair the policy is trained for")
        if sweep.goodput_per_s("rakv") <= 0:
            raise ValueError(f"{sweep.trace.path}: rakv meets the SLO ({slo.describe()}) at none of the rates, so the "
                             f"sweep cannot score a trial: give lower --arrival-rate or a looser --slo")
    return sweeps


class Data:
    """The traces, their timings and today's decision inputs; the family split; the
    decision points of the first pass (the analytic planner's)."""

    def __init__(self, paths: list[Path], timing_path: Path | None, seed: int):
        self.sources = []
        for path in paths:
            trace = load_trace(path)
            timing = load_timing(timing_path if not trace.ops and timing_path is not None else None, trace)
            self.sources.append((trace, timing, timing.decision_inputs(trace, Settings())))
        pairs = {trace.meta.models.get("pair") for trace, _, _ in self.sources}
        if len(pairs) > 1:
            raise ValueError(f"the traces are of several pairs ({', '.join(map(str, sorted(pairs, key=str)))}); "
                             "a policy is trained for one")
        counts: dict[str, int] = {}
        for trace, _, _ in self.sources:
            for r in trace.requests:
                counts[r.group_id] = counts.get(r.group_id, 0) + 1
        self.split = split_families(counts, seed)
        self.seed = seed
        self._first_pass: dict[tuple, dict[str, DrafterRows]] = {}
        draft_rows = self.rows(None, ("train",), ControllerConfig(), 0.5).get("draft")
        self.draft_prior = draft_acceptance(draft_rows) if draft_rows is not None else 0.5

    def families(self, *splits: str) -> set[str]:
        return {f for f, s in self.split.items() if s in splits}

    def rows(self, model: RoundModel | None, splits: tuple[str, ...], controller: ControllerConfig,
             draft_prior: float) -> dict[str, DrafterRows]:
        """Per drafter, the decision points of the requests of ``splits`` under ``model``
        (None: the analytic planner's, computed once per setting)."""
        key = (splits, controller, draft_prior)
        if model is None and key in self._first_pass:
            return self._first_pass[key]
        families, found = self.families(*splits), {}
        for trace, _, inputs in self.sources:
            for drafter, rows in collect(subset(trace, families), inputs, controller, draft_prior, model).items():
                found.setdefault(drafter, []).append(rows)
        rows = {d: DrafterRows.concat(parts) for d, parts in found.items()}
        if model is None:
            self._first_pass[key] = rows
        return rows


def lgb_params(params: dict, objective: str, seed: int) -> dict:
    return {"objective": objective, "verbosity": -1, "seed": seed, "deterministic": True, "num_threads": 1,
            "force_row_wise": True, "max_depth": 8, **params}


def fit_heads(rows: dict[str, DrafterRows], params: dict, num_rounds: int, seed: int) -> dict[str, tuple]:
    """Per drafter with rows, its (first, further) boosters."""
    import lightgbm as lgb
    boosters = {}
    for drafter, r in rows.items():
        keep, share, weight = further_target(r)
        if len(r.run) < 20 or keep.sum() < 10:
            continue  # too few to learn from: the EWMA estimate plans this drafter's rounds
        first = lgb.train(lgb_params(params, "binary", seed), lgb.Dataset(r.x, first_target(r)),
                          num_boost_round=num_rounds)
        further = lgb.train(lgb_params(params, "cross_entropy", seed), lgb.Dataset(r.x[keep], share, weight=weight),
                            num_boost_round=num_rounds)
        boosters[drafter] = (first, further)
    return boosters


def round_model(boosters: dict[str, tuple], priors: dict) -> RoundModel:
    return RoundModel({d: tuple(compile_model(b.model_to_string(), len(ROUND_FEATURES)) for b in pair)
                       for d, pair in boosters.items()}, priors)


def with_priors(rows: dict[str, DrafterRows]) -> tuple[dict[str, DrafterRows], dict]:
    """First-pass rows with their token priors filled in, and the priors (from these rows)."""
    priors = {d: token_prior(r) for d, r in rows.items()}
    return {d: r.with_token_prior(priors[d]) for d, r in rows.items()}, priors


def trial_settings(trial) -> tuple[dict, int, ControllerConfig]:
    params = {"num_leaves": trial.suggest_int("num_leaves", 4, MAX_LEAVES),
              "learning_rate": trial.suggest_float("learning_rate", 0.03, 0.3, log=True),
              "min_data_in_leaf": trial.suggest_int("min_data_in_leaf", 5, 200, log=True),
              "lambda_l2": trial.suggest_float("lambda_l2", 1e-3, 10.0, log=True)}
    num_rounds = trial.suggest_int("num_rounds", 10, MAX_ROUNDS, step=10)
    return params, num_rounds, controller_config(trial.suggest_float("min_gain", 0.0, 0.3, step=0.05),
                                                 trial.suggest_float("draft_confidence", 0.0, 0.8, step=0.1))


def controller_config(min_gain: float, draft_confidence: float) -> ControllerConfig:
    """The planner settings a trial tunes (on grids: each setting's first pass is collected
    once, however many trials draw it); the rest are today's defaults."""
    base = ControllerConfig()  # rounded: a grid step of 0.1 draws 0.30000000000000004, which settings print
    return replace(base, rounds=replace(base.rounds, min_gain=round(min_gain, 6),
                                        draft_confidence=round(draft_confidence, 6)))


def objective(data: Data, sweeps: list[LoadSweep]):
    import optuna
    validation = data.families("validation")
    baseline = {}  # per trace: rakv's tokens per second of service on the validation families

    def run(trial) -> float:
        params, num_rounds, controller = trial_settings(trial)
        rows, priors = with_priors(data.rows(None, ("train",), controller, data.draft_prior))
        model = round_model(fit_heads(rows, params, num_rounds, data.seed), priors)
        policy_file = PolicyFile.in_memory(model, controller, data.draft_prior)
        ratios = []
        for step, (trace, timing, inputs) in enumerate(data.sources):
            held = subset(trace, validation)
            if not held.requests:
                continue
            if trace.path not in baseline:
                baseline[trace.path] = service_tokens_per_s(held, timing, session_of("rakv", None, held, timing, inputs))
            learned = service_tokens_per_s(held, timing, session_of("learned", policy_file, held, timing, inputs))
            ratios.append(learned / baseline[trace.path])
            trial.report(score(ratios), step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        for step, sweep in enumerate(sweeps, start=len(data.sources)):
            ratios.append(sweep_ratio(sweep, policy_file))
            trial.report(score(ratios), step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return score(ratios) if ratios else 1.0
    return run


def learned_goodput_per_s(sweep: LoadSweep, policy_file: PolicyFile) -> float:
    """The goodput ``policy_file``'s learned planner serves over the sweep."""
    return sweep.goodput_per_s(lambda: LearnedPolicy(policy_file, sweep.inputs.timings))


def sweep_ratio(sweep: LoadSweep, policy_file: PolicyFile) -> float:
    """The learned planner's goodput over the sweep, over ``rakv``'s (``load_sweeps``
    checked it is not 0)."""
    return learned_goodput_per_s(sweep, policy_file) / sweep.goodput_per_s("rakv")


LOSS_WEIGHT = 2.0  # a trace where the learned planner loses to rakv costs this much more than a gain earns


def score(ratios: list[float]) -> float:
    """A trial's objective from its learned / rakv ratios per trace: their mean, less
    ``LOSS_WEIGHT`` times the mean shortfall below 1 (the learned planner should never be
    slower than the analytic one on any workload)."""
    shortfall = [max(0.0, 1.0 - r) for r in ratios]
    return float(np.mean(ratios) - LOSS_WEIGHT * np.mean(shortfall))


def open_study(storage: str, name: str, seed: int):
    """The study, created or loaded; its sampler is seeded by ``seed`` and the trials
    already stored, so a resumed study does not draw its first trials' parameters again."""
    import optuna
    from sqlalchemy.exc import DBAPIError
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Workers starting together on a fresh database race to create its tables (a duplicate
    # key, or a duplicate table such as alembic_version) and the study: the loser retries.
    for attempt in range(5):
        try:
            study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True,
                                        pruner=optuna.pruners.MedianPruner(n_startup_trials=5))
            break
        except (DBAPIError, optuna.exceptions.StorageInternalError, optuna.exceptions.DuplicatedStudyError) as e:
            if attempt == 4:
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"cannot open Optuna study {name!r} at {storage}: {first_line}") from None
            time.sleep(0.2 * (attempt + 1))
    study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.get_trials(deepcopy=False)))
    return study


FINISHED = ("COMPLETE", "PRUNED")


def finished(study) -> int:
    return sum(t.state.name in FINISHED for t in study.get_trials(deepcopy=False))


def tune(data: Data, sweeps: list[LoadSweep], storage: str, name: str, trials: int, seed: int):
    """Run trials until the study holds ``trials`` finished ones, whoever ran them. A
    trial is numbered by the storage when it is asked for; one preceded by ``trials``
    finished or running trials is not run (it is told failed, and the worker stops), so
    workers sharing a study finish exactly ``trials`` between them."""
    import optuna
    from tqdm import tqdm
    study = open_study(storage, name, seed)
    bar = tqdm(total=trials, initial=min(finished(study), trials), desc="trials", unit="trial", file=sys.stderr,
               leave=False)
    run_trial = objective(data, sweeps)
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


def save_policy(path: Path, boosters: dict[str, tuple], sidecar: dict) -> None:
    """Write each head's model, then the sidecar, each atomically (temp file, then rename):
    the sidecar last, so a directory with a sidecar has its models."""
    path.mkdir(parents=True, exist_ok=True)
    sidecar = {"format": FORMAT, "format_version": FORMAT_VERSION, "features": list(ROUND_FEATURES),
               "heads": sorted(boosters), **sidecar}
    missing = [k for k in SIDECAR_KEYS if k not in sidecar]
    if missing:
        raise ValueError(f"policy sidecar lacks {', '.join(missing)}")
    files = [(head_file(d, head), b.model_to_string()) for d, pair in boosters.items() for head, b in zip(HEADS, pair)]
    for name, text in files + [(SIDECAR_FILE, json.dumps(sidecar, indent=1))]:
        tmp = path / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(path / name)
    for stale in path.glob("*.txt"):  # a format 1 policy's model, or a head this one lacks
        if stale.name not in {name for name, _ in files}:
            stale.unlink()


def export(data: Data, sweeps: list[LoadSweep], study, out: Path) -> dict:
    """Refit the best trial on train and validation (both passes), measure it on the test
    families and the sweeps (which tuned it: not held out), write the policy."""
    best = study.best_trial
    params = {k: best.params[k] for k in ("num_leaves", "learning_rate", "min_data_in_leaf", "lambda_l2")}
    controller = controller_config(best.params["min_gain"], best.params["draft_confidence"])
    first_pass, priors = with_priors(data.rows(None, ("train", "validation"), controller, data.draft_prior))
    model = round_model(fit_heads(first_pass, params, best.params["num_rounds"], data.seed), priors)
    second_pass = data.rows(model, ("train", "validation"), controller, data.draft_prior)
    both = {d: DrafterRows.concat([first_pass[d], second_pass[d]]) for d in first_pass if d in second_pass}
    boosters = fit_heads(both, params, best.params["num_rounds"], data.seed)
    policy_file = PolicyFile.in_memory(round_model(boosters, priors), controller, data.draft_prior)
    test = data.families("test")
    evaluations = [asdict(evaluate_trace(policy_file, trace, timing, test)) for trace, timing, _ in data.sources
                   if subset(trace, test).requests]
    under_load = [{"trace": sweep.trace.path.name, "rates_per_s": list(sweep.config.rates_per_s),
                   "slo": sweep.config.slo.describe(), "num_requests": sweep.config.num_requests,
                   "seeds": list(sweep.config.seeds),
                   "itl_target_s": sweep.batch.itl_target_s, "ttft_target_s": sweep.batch.ttft_target_s,
                   "max_num_prefills": sweep.batch.max_num_prefills,
                   "goodput_per_s": {"learned": learned_goodput_per_s(sweep, policy_file),
                                     **{name: sweep.goodput_per_s(name) for name in ("rakv", "kv-only")}}}
                  for sweep in sweeps]
    report = {"best_trial": best.number, "validation_vs_rakv": best.value, "params": best.params, "test": evaluations,
              "under_load": under_load, "num_rows": {d: int(len(r.run)) for d, r in both.items()}}
    traces = [trace for trace, _, _ in data.sources]
    save_policy(out, boosters, {
        "token_priors": token_priors_to_json({d: priors[d] for d in boosters}), "draft_prior": data.draft_prior, "schema_version": SCHEMA_VERSION,
        "hardware": [t.meta.hardware for t in traces],
        "models": [{"target": t.target_namespace, "draft": t.draft_namespace} for t in traces],
        "controller": settings_to_json(controller), "metrics": report,
        "split": {"seed": data.seed, "by": "prefix family", "traces": [t.path.name for t in traces],
                  "test_families": sorted(test)}})
    return report


def run(args: argparse.Namespace) -> int:
    if args.trials < 1:
        raise ValueError(f"--trials must be at least 1, got {args.trials}")
    start = time.perf_counter()
    data = Data(args.trace, args.timing, args.seed)
    sweeps = load_sweeps(args, data.sources[0][0].meta.models.get("pair"))
    storage = args.storage or f"sqlite:///{args.out.parent.resolve() / (args.out.name + '.optuna.db')}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    study = tune(data, sweeps, storage, args.study or args.out.name, args.trials, args.seed + args.worker)
    print(f"study {study.study_name}: {finished(study)} trials; best validation tokens/s {study.best_value:.3f}x "
          f"rakv's (trial {study.best_trial.number})", file=sys.stderr)
    if not args.no_export:
        report = export(data, sweeps, study, args.out)
        for e in report["test"]:
            rates = e["tokens_per_s"]
            print(f"wrote {args.out}: {e['trace']} test families ({e['num_requests']} requests): learned "
                  f"{rates['learned']:.2f} tok/s, rakv {rates['rakv']:.2f}, round oracle {rates['round-oracle']:.2f}, "
                  f"causal bound {e['causal']['score']:.2f}; headroom captured "
                  f"{share(e['headroom_captured'])} (causal: {share(e['causal_headroom_captured'])})", file=sys.stderr)
        for e in report["under_load"]:
            goodput = e["goodput_per_s"]
            rates = ", ".join(f"{r:g}" for r in e["rates_per_s"])
            targets = "".join(f"; {name} target {e[key]:g} s"
                              for name, key in (("ITL", "itl_target_s"), ("TTFT", "ttft_target_s")) if e[key])
            print(f"{e['trace']} at {rates} req/s ({e['slo']}{targets}; tuned on it): goodput summed, learned "
                  f"{goodput['learned']:.3f} req/s, rakv {goodput['rakv']:.3f}, kv-only {goodput['kv-only']:.3f}",
                  file=sys.stderr)
        print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (ValueError, TraceError, CostModelError, SessionError, OSError))


if __name__ == "__main__":
    sys.exit(main())
