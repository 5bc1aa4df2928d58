"""``python -m profiler.record``: run the real engine, write timing and acceptance traces.

Four tables go into ``--out`` (see ``profiler.schema``):
- requests: each prompt's target greedy output and, per drafter, the run lengths m_t from
  one teacher-forced pass (the acceptance of every policy replays from these);
- ops: the timing grid of ``profiler.ops`` (prefill, decode, verify, clone, lookup,
  insert, propose);
- runs: end-to-end runs of every action on a sample of requests, each checked token for
  token against the greedy output;
- decisions: the adaptive policy's decisions on that sample (``--policy rakv``).

Rows go out in flushed part files, so Ctrl-C or a crash keeps what was written;
``--resume`` continues without duplicates; a finished recording is finalized atomically.
With ``--random-weights`` only the ops table is recorded, for the real shapes (acceptance
then comes from another trace of the same pair).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from profiler.ops import CALIBRATION_GRID, RECORDING_GRID, measure_pair
from profiler.schema import (DecisionRow, DrafterRunLengths, RequestRow, RunRow, TraceError, TraceMeta,
                             hardware_fingerprint, table_to_rows)
from profiler.trace_io import TraceWriter, read_table
from profiler.workloads import WORKLOAD_NAMES, WorkloadError, load_workload
from rakv.cli import run_cli
from rakv.models import config_identity

MAX_K = 8
GRIDS = {"calibration": CALIBRATION_GRID, "recording": RECORDING_GRID}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m profiler.record",
        description="Record timing and acceptance traces of a model pair on this machine. "
                    "With no arguments: the tiny pair on a small fixture workload, in about a minute.")
    p.add_argument("--pair", default="tiny", help="tiny, smollm2, qwen-coder or TARGET[,DRAFT] (default: tiny)")
    p.add_argument("--workload", default="fixture-chat", help=f"{', '.join(WORKLOAD_NAMES)} (default: fixture-chat)")
    p.add_argument("--requests", type=int, default=None, help="number of requests (default: the workload's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on tokens per request (default: the workload's)")
    p.add_argument("--out", type=Path, default=None, help="trace directory (default: traces/<pair>-<workload>)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted recording in --out")
    p.add_argument("--runs-sample", type=int, default=6, help="requests run end to end under every action (default: 6)")
    p.add_argument("--runs-max-new-tokens", type=int, default=32, help="tokens per end-to-end run (default: 32)")
    p.add_argument("--policy", default="rakv", help="adaptive policy whose decisions are recorded; 'none' to skip")
    p.add_argument("--grid", choices=sorted(GRIDS), default="calibration", help="op timing grid (default: calibration)")
    p.add_argument("--skip", nargs="*", default=(), choices=("requests", "ops", "runs"), help="phases to skip")
    p.add_argument("--random-weights", action="store_true", help="time the pair's real shapes with random weights (ops only)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, help="float32, float16, bfloat16, float64 (default: the pair's)")
    p.add_argument("--max-context", type=int, default=None, help="cap on positions below the model's maximum")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flush-rows", type=int, default=16, help="rows per flushed part file (default: 16)")
    return p.parse_args(argv)


def load(args):
    """The pair (real or random weights) and the workload (None with random weights)."""
    if args.random_weights:
        from rakv.shapes import random_pair
        return random_pair(args.pair, args.dtype or "float16", args.device, args.seed), None
    from rakv.models import load_pair
    pair = load_pair(args.pair, args.dtype, args.max_context)
    if args.device != "cpu":
        raise ValueError("real-weight recording runs on the CPU here; use --random-weights on a GPU machine")
    return pair, load_workload(args.workload, args.requests, args.seed)


def trace_meta(args, pair) -> TraceMeta:
    models = {"pair": args.pair, "target": pair.target_fingerprint, "draft": pair.draft_fingerprint,
              "target_config": config_identity(pair.target.config, diff=True),
              "draft_layers": None if pair.draft is None else pair.draft.config.num_hidden_layers}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("resume", "out", "skip", "flush_rows")}
    config["dtype"] = str(pair.target.dtype)
    config["grid_points"] = asdict(GRIDS[args.grid])
    return TraceMeta(hardware=hardware_fingerprint(), models=models, config=config)


def prompt_ids(pair, request, max_new: int) -> list[int]:
    ids = pair.encode(request.prompt)
    if request.num_prompt_tokens is not None:
        ids = ids[: request.num_prompt_tokens]
    return ids[: max(pair.max_positions - max_new, 1)]


def record_requests(writer: TraceWriter, pair, workload, args, progress) -> dict[int, RequestRow]:
    """Greedy outputs (through a kv-only engine: identical output, cheaper multi-turn) and
    the run lengths of every drafter."""
    from rakv.acceptance import run_lengths
    from rakv.controller import make_policy
    from rakv.decoding import draft_agreement
    from rakv.drafters import DRAFT_MODEL, NGRAM, ngram_run_lengths
    from rakv.engine import Engine

    done = {key[0] for key in writer.existing_keys("requests")}
    engine = Engine(pair, make_policy("kv-only"))
    for request in progress(workload.requests, desc="requests"):
        if request.request_id in done:
            continue
        max_new = min(request.max_new_tokens, args.max_new_tokens or request.max_new_tokens)
        prompt = prompt_ids(pair, request, max_new)
        output = list(engine.generate(prompt, max_new).output_ids)
        ngram = ngram_run_lengths(prompt, output, MAX_K)
        runs = [DrafterRunLengths(NGRAM, MAX_K, ngram.runs, ngram.proposed)]
        if pair.draft is not None:
            agree = draft_agreement(pair.draft, prompt, output)
            runs.append(DrafterRunLengths(DRAFT_MODEL, MAX_K, run_lengths(agree, MAX_K), [MAX_K] * len(output)))
        writer.append("requests", [RequestRow(
            request_id=request.request_id, workload=workload.name, group_id=request.group_id, turn=request.turn,
            arrival_s=request.arrival_s, prompt_ids=prompt, output_ids=output, max_new_tokens=max_new,
            run_lengths=runs)])
    writer.flush()
    rows = table_to_rows("requests", read_table(writer.trace_dir, "requests"))
    return {row.request_id: row for row in rows}


def record_ops(writer: TraceWriter, pair, args, progress) -> None:
    done = frozenset(writer.existing_keys("ops"))
    rows = measure_pair(pair, GRIDS[args.grid], args.device, done)
    for row in progress(rows, desc="ops", unit="op"):
        writer.append("ops", [row])


def sample_requests(requests: dict[int, RequestRow], count: int) -> list[RequestRow]:
    """The first ``count`` requests in workload order, plus the later turns of the
    conversations they belong to (a conversation's prefix reuse needs its earlier turns)."""
    chosen, groups = [], set()
    for row in sorted(requests.values(), key=lambda r: r.request_id):
        if len(chosen) < count or row.group_id in groups:
            chosen.append(row)
            groups.add(row.group_id)
    return chosen


def run_policies(pair, args) -> list[str]:
    from rakv.cost_model import K_CHOICES
    kinds = ["ngram", "joint-ngram"] + (["spec", "joint"] if pair.draft is not None else [])
    names = ["ar", "kv-only"] + [f"{kind}-k{k}" for kind in kinds for k in K_CHOICES[1:]]
    return names + ([args.policy] if args.policy != "none" else [])


def record_runs(writer: TraceWriter, pair, requests: dict[int, RequestRow], args, progress) -> None:
    """Every action on the sample, each in a fresh engine (so hits come from the sample's
    own earlier requests), checked token for token against the greedy output."""
    from rakv.calibrate import load_or_calibrate
    from rakv.controller import CostModelPolicy, make_policy
    from rakv.engine import Engine

    sample = sample_requests(requests, args.runs_sample)
    done_runs = writer.existing_keys("runs")
    done_decisions = writer.existing_keys("decisions")
    timings = load_or_calibrate(pair) if args.policy == "rakv" else None
    for name in progress(run_policies(pair, args), desc="runs", unit="policy"):
        policy = make_policy(name, timings)
        engine = Engine(pair, policy)
        for row in sample:
            max_new = min(args.runs_max_new_tokens, row.max_new_tokens)
            reference = list(row.output_ids[:max_new])
            features, _, _ = engine.features(list(row.prompt_ids), max_new)
            if isinstance(policy, CostModelPolicy):
                acceptance = dict(policy.acceptance)
                predicted = dict((a, c) for c, a in policy.rank(features))
            result = engine.generate(list(row.prompt_ids), max_new)
            action = result.action
            if (row.request_id, name) not in done_runs:
                writer.append("runs", [RunRow(
                    request_id=row.request_id, policy=name, r=action.r, drafter=action.drafter, k=action.k,
                    hit_tokens=result.hit_tokens, reused_tokens=result.reused_tokens, hit_kind=result.hit_kind,
                    ttft_s=result.ttft_s, e2e_s=result.e2e_s, num_output_tokens=len(result.output_ids),
                    num_rounds=len(result.rounds), start_per_round=[r.start for r in result.rounds],
                    drafter_per_round=[r.drafter for r in result.rounds],
                    accepted_per_round=[r.accepted for r in result.rounds],
                    k_per_round=[r.k for r in result.rounds], proposed_per_round=[r.num_proposed for r in result.rounds],
                    identical_to_ar=list(result.output_ids) == reference)])
            if isinstance(policy, CostModelPolicy) and (row.request_id, name) not in done_decisions:
                writer.append("decisions", [DecisionRow(
                    request_id=row.request_id, policy=name, num_prompt_tokens=features.num_prompt_tokens,
                    num_new_tokens=features.num_new_tokens, target_hit_tokens=features.target_hit_tokens,
                    draft_hit_tokens=features.draft_hit_tokens, exact_repeat=features.exact_repeat,
                    acceptance_draft=acceptance.get("draft", 0.0), acceptance_ngram=acceptance.get("ngram", 0.0),
                    r=action.r, drafter=action.drafter, k=action.k, predicted_cost_s=predicted[action],
                    measured_e2e_s=result.e2e_s)])


def run(args) -> int:
    from tqdm import tqdm

    def progress(items, **kwargs):
        return tqdm(items, file=sys.stderr, leave=False, **kwargs)

    start = time.perf_counter()
    pair, workload = load(args)
    out = args.out or Path("traces") / f"{args.pair}-{args.workload if workload else 'random-weights'}"
    with TraceWriter(out, trace_meta(args, pair), resume=args.resume, flush_every_rows=args.flush_rows) as writer:
        if workload is not None and "requests" not in args.skip:
            requests = record_requests(writer, pair, workload, args, progress)
        if "ops" not in args.skip:
            record_ops(writer, pair, args, progress)
        if workload is not None and "runs" not in args.skip and "requests" not in args.skip:
            record_runs(writer, pair, requests, args, progress)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (ValueError, TraceError, WorkloadError, OSError),
                   interrupted="interrupted: the flushed rows are kept; continue with --resume")


if __name__ == "__main__":
    sys.exit(main())
