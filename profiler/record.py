"""``python -m profiler.record``: run the real engine, write timing and acceptance traces.

Four tables go into ``--out`` (see ``profiler.schema``):
- requests: each prompt's target greedy output and, per drafter, the run lengths m_t (up
  to ``RECORDED_MAX_K``) from one teacher-forced pass, plus the draft model's probability
  of its own token at every position (the acceptance of every policy replays from these);
- ops: the timing grid of ``rakv.op_timing`` (prefill, decode, verify, clone, lookup,
  insert, propose). With runs, the grid is timed in passes of one repeat each, spread
  across them (before the first run, between, after the last), so a point's median
  spans the conditions the runs were timed in: timed in one block, a slow few minutes of
  a shared machine moved every op (a 16-token prefill 72 ms in the ops, 50 in the runs).
  Serving without runs, the passes are spread across the served loads alike;
- runs: end-to-end runs of every policy on a sample of requests, in lockstep (each
  request under every policy before the next), each checked token for token against the
  greedy output; every run and op waits out a slow phase of the machine, and a run
  its siblings say was slowed is timed again (``profiler.run_record``, ``profiler.run_noise``);
- decisions: the adaptive policy's decisions on that sample (``--policy rakv``);
- served and steps: with ``--serve-concurrency`` or ``--serve-rate``, the batching engine
  serving the first ``--serve-requests`` requests (or ``--serve-resample`` N of them
  resampled with their prefix families, repeats and all) at each load under each
  ``--serve-policies`` policy: every request's times, preemptions, output and rounds,
  and every step's requests, kinds, rows and seconds (``profiler.serve_record``).

Every file's metadata holds the decision inputs (``rakv.settings.DecisionInputs``: the
engine's store and n-gram settings, the controller's, the calibrated timings the adaptive
policy priced with, the models' byte sizes and the position limit), so a replay decides
as the engine did; ``--resume`` refuses to continue a recording whose inputs changed.
Rows go out in flushed part files, so Ctrl-C or a crash keeps what was written;
``--resume`` continues without duplicates; a finished recording is finalized atomically.
With ``--random-weights`` only the ops table is recorded, for the real shapes (acceptance
then comes from another trace of the same pair). ``--skip ops runs --timing-trace NAME``
records the acceptance facts alone, which do not depend on the machine's speed, and names
the sibling trace that holds their timing: only the timing needs a quiet machine, and
apart, each part of a Qwen recording fits in a working session (100 requests x 64 tokens
of acceptance took 24 minutes; 10 requests' ops and 230 runs, 74 minutes).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from profiler.arrivals import loads_type, resample_families, seed_type
from profiler.hardware import hardware_fingerprint
from profiler.run_noise import MachineSpeed, NoiseGuard, forward_probe
from profiler.run_record import passes_at, record_runs, run_policies
from profiler.schema import (META_DECISION_INPUTS, META_FIRST_TOKEN_AT, META_TIMING_TRACE, DrafterRunLengths,
                             RequestRow, TraceError, TraceMeta, table_to_rows)
from profiler.serve_record import loads_of, record_serving
from profiler.trace_io import TraceWriter, read_table
from profiler.workloads import WORKLOAD_NAMES, WorkloadError, is_user_file, load_workload
from rakv.calibrate import RECALIBRATE_HELP
from rakv.cli import add_precision_arguments, run_cli
from rakv.controller import ControllerConfig
from rakv.scheduler import ITL_TARGET_HELP, MAX_NUM_PREFILLS_HELP, TTFT_TARGET_HELP, BatchConfig
from rakv.op_timing import CALIBRATION_GRID, RECORDING_GRID, SERVING_GRID, measure_pair
from rakv.policies import check_policy
from rakv.settings import DecisionInputs, EngineConfig, settings_to_json

RECORDED_MAX_K = 32  # run lengths are recorded up to this many draft tokens
GRIDS = {"calibration": CALIBRATION_GRID, "recording": RECORDING_GRID, "serving": SERVING_GRID}
ENGINE_CONFIG = EngineConfig()  # what the runs' engines use; recorded in the metadata
CONTROLLER_CONFIG = ControllerConfig()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m profiler.record",
        description="Record timing and acceptance traces of a model pair on this machine. "
                    "With no arguments: the tiny pair on a small fixture workload, in about a minute.")
    p.add_argument("--pair", default="tiny", help="tiny, smollm2, qwen-coder or TARGET[,DRAFT] (default: tiny)")
    p.add_argument("--workload", default="fixture-chat",
                   help=f"{', '.join(WORKLOAD_NAMES)}, or a prompts file: FILE.jsonl with 'prompt' or 'prompt_ids' "
                        "and optionally 'group', 'arrival_s', 'max_new_tokens' per line (default: fixture-chat)")
    p.add_argument("--requests", type=int, default=None, help="number of requests (default: the workload's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on tokens per request (default: the workload's)")
    p.add_argument("--out", type=Path, default=None, help="trace directory (default: traces/<pair>-<workload>)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted recording in --out")
    p.add_argument("--recalibrate", action="store_true", help=RECALIBRATE_HELP)
    p.add_argument("--runs-sample", type=int, default=6,
                   help="requests run end to end under every policy, plus their conversations' later turns (default: 6)")
    p.add_argument("--runs-max-new-tokens", type=int, default=32, help="tokens per end-to-end run (default: 32)")
    p.add_argument("--runs-noise-tolerance", type=float, default=NoiseGuard.tolerance,
                   help="time a run again when it is this much slower than its siblings' median, per calibrated "
                        f"second of its work (default: {NoiseGuard.tolerance})")
    p.add_argument("--runs-max-attempts", type=int, default=NoiseGuard.max_attempts,
                   help="attempts at a slowed run, the median kept; 1: never repeat "
                        f"(default: {NoiseGuard.max_attempts})")
    p.add_argument("--runs-max-wait-s", type=float, default=NoiseGuard.max_wait_s,
                   help="before each run, op and served load, wait up to this long while a probe (one forward "
                        "of the target) is more than the noise tolerance slower than usual; each op, run and "
                        "load's steps are stored beside their probe's seconds (probe_s), which the simulator "
                        "prices at the usual speed (a load's steps at its own); "
                        f"0: never probe (default: {NoiseGuard.max_wait_s:g})")
    p.add_argument("--policy", default="rakv", help="adaptive policy whose decisions are recorded; 'none' to skip")
    p.add_argument("--runs-policies", default="all", metavar="NAME[,NAME...]",
                   help="policies run end to end: 'all', every fixed policy and --policy (default), or a list "
                        "such as ar,spec-k4,ngram-k4,rakv")
    p.add_argument("--grid", choices=sorted(GRIDS), default="calibration",
                   help="op timing grid: serving adds batched forwards of 1-8 requests (default: calibration)")
    p.add_argument("--skip", nargs="*", default=(), choices=("requests", "ops", "runs"), help="phases to skip")
    serve = p.add_argument_group("serving under load (the served and steps tables)")
    serve.add_argument("--serve-concurrency", type=loads_type("--serve-concurrency", True), default=(), metavar="C[,C...]",
                       help="serve with C requests in flight, the next submitted when one finishes; a list records "
                            "each load in turn")
    serve.add_argument("--serve-rate", type=loads_type("--serve-rate", False), default=(), metavar="R[,R...]",
                       help="serve Poisson arrivals at R requests/s (the workload seed's arrival times)")
    serve.add_argument("--serve-policies", default="ar,rakv",
                       help="comma-separated policies, each load served under each (default: ar,rakv)")
    serve.add_argument("--serve-requests", type=int, default=16,
                       help="the first N recorded requests, served at each load (default: 16)")
    serve.add_argument("--serve-resample", type=int, default=None, metavar="N",
                       help="serve N requests resampled from the recorded ones with their prefix families "
                            "(whole conversations drawn with replacement, from --seed) instead of the first "
                            "--serve-requests: a family drawn twice repeats its prompts, as popular prompts do; a "
                            "replay draws the same N (default: none)")
    serve.add_argument("--max-num-seqs", type=int, default=BatchConfig.max_num_seqs,
                       help=f"requests running at once at most (default: {BatchConfig.max_num_seqs})")
    serve.add_argument("--max-num-batched-tokens", type=int, default=BatchConfig.max_num_batched_tokens,
                       help=f"rows of one step at most (default: {BatchConfig.max_num_batched_tokens})")
    serve.add_argument("--max-num-prefills", type=int, default=BatchConfig.max_num_prefills,
                       help=f"{MAX_NUM_PREFILLS_HELP} (default: {BatchConfig.max_num_prefills})")
    serve.add_argument("--itl-target", type=float, default=None, metavar="S", help=f"{ITL_TARGET_HELP} (default: none)")
    serve.add_argument("--ttft-target", type=float, default=None, metavar="S",
                       help=f"{TTFT_TARGET_HELP} (default: none, first come first served)")
    p.add_argument("--timing-trace", metavar="NAME", default=None,
                   help="with --skip ops runs: the trace beside this one (in the same directory) that holds "
                        "its timing, ops and runs of the same pair on this machine; a replay then needs "
                        "no --timing")
    p.add_argument("--random-weights", action="store_true", help="time the pair's real shapes with random weights (ops only)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, help="float32, float16, bfloat16, float64 (default: the pair's)")
    p.add_argument("--max-context", type=int, default=None, help="cap on positions below the model's maximum")
    add_precision_arguments(p)
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--flush-rows", type=int, default=16, help="rows per flushed part file (default: 16)")
    return p.parse_args(argv)


def load(args):
    """The pair (real or random weights) and the workload (None with random weights)."""
    if args.random_weights:
        from rakv.cpu_linear import with_kernels
        from rakv.shapes import random_pair
        from rakv.auto_weights import with_weights
        pair = with_weights(random_pair(args.pair, args.dtype or "float16", args.device, args.seed), args.weights)
        return with_kernels(pair, args.linear_kernels), None
    workload = load_workload(args.workload, args.requests, args.seed)  # a bad workload fails before any load
    from rakv.models import load_pair
    pair = load_pair(args.pair, args.dtype, args.max_context, linear_kernels=args.linear_kernels, weights_mode=args.weights)
    if args.device != "cpu":
        raise ValueError("real-weight recording runs on the CPU here; use --random-weights on a GPU machine")
    check_vocabulary(workload, pair)
    return pair, workload


def decision_inputs(pair, args) -> DecisionInputs:
    """The inputs the runs' engines decide with; the timings are the adaptive policy's
    calibration on this machine (none with random weights: those record ops only)."""
    from rakv.kv_store import measure_sizes
    timings = None
    if not args.random_weights:
        from rakv.calibrate import load_or_calibrate
        timings = load_or_calibrate(pair, refresh=args.recalibrate)
    return DecisionInputs(
        engine=ENGINE_CONFIG, controller=CONTROLLER_CONFIG, timings=timings,
        target_sizes=measure_sizes(pair.target),
        draft_sizes=None if pair.draft is None else measure_sizes(pair.draft),
        max_positions=pair.max_positions)


def trace_meta(args, pair, inputs: DecisionInputs) -> TraceMeta:
    from rakv.models import config_identity
    models = {"pair": args.pair, "target": pair.target_fingerprint, "draft": pair.draft_fingerprint,
              "target_config": config_identity(pair.target.config, diff=True),
              "draft_layers": None if pair.draft is None else pair.draft.config.num_hidden_layers,
              "linear_kernels": pair.linear_kernels, "weights": pair.weights}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("resume", "recalibrate", "out", "skip", "flush_rows", "runs_max_wait_s", "timing_trace")}
    config["dtype"] = str(pair.target.dtype)
    config["grid_points"] = asdict(GRIDS[args.grid])
    config["recorded_max_k"] = RECORDED_MAX_K
    config[META_FIRST_TOKEN_AT] = "delivery"  # served first tokens timed as their steps delivered them
    config[META_DECISION_INPUTS] = settings_to_json(inputs)
    if args.timing_trace is not None:
        config[META_TIMING_TRACE] = args.timing_trace
    return TraceMeta(hardware=hardware_fingerprint(), models=models, config=config)


def prompt_ids(pair, request, max_new: int, recorded: dict[int, RequestRow]) -> list[int]:
    """The request's prompt as token ids, cut to leave room for ``max_new`` tokens;
    ``recorded``: the earlier requests by id (their ``prompt_ids`` and ``output_ids``)."""
    if request.continues is not None:  # the earlier turn's prompt and the model's own answer, then this text
        earlier = recorded[request.continues]
        ids = list(earlier.prompt_ids) + list(earlier.output_ids) + pair.encode_continuation(request.prompt)
    elif request.prompt_ids is not None:
        ids = list(request.prompt_ids)
    else:
        ids = pair.encode(request.prompt)
    if request.num_prompt_tokens is not None:
        ids = ids[: request.num_prompt_tokens]
    return ids[: max(pair.max_positions - max_new, 1)]


def check_vocabulary(workload, pair) -> None:
    """Refuse token ids the target does not know before any recording starts."""
    vocab = pair.target.config.vocab_size
    lines = workload.config.get("lines")
    for request in workload.requests:
        if request.prompt_ids is not None and max(request.prompt_ids) >= vocab:
            where = f"{workload.config['path']}:{lines[request.request_id]}" if lines else f"request {request.request_id}"
            raise WorkloadError(f"{where}: token id {max(request.prompt_ids)} is outside the vocabulary of {vocab}")


def record_requests(writer: TraceWriter, pair, workload, args, inputs: DecisionInputs,
                    progress) -> dict[int, RequestRow]:
    """Greedy outputs, every drafter's run lengths and the draft's top-1 probabilities. The
    outputs come from the engine under the adaptive policy: the same tokens as plain greedy
    decoding (the runs check every one against them), sooner where a drafter agrees (Qwen
    code took 47 s a 64-token request under kv-only)."""
    from rakv.acceptance import run_lengths
    from rakv.controller import make_policy
    from rakv.decoding import draft_predictions
    from rakv.drafters import DRAFT_MODEL, NGRAM, ngram_run_lengths
    from rakv.engine import Engine

    writer.flush()
    recorded = {row.request_id: row for row in table_to_rows("requests", read_table(writer.trace_dir, "requests"))} \
        if writer.existing_keys("requests") else {}
    engine = Engine(pair, make_policy("rakv", inputs.timings, inputs.controller), inputs.engine)
    for request in progress(workload.requests, desc="requests"):
        if request.request_id in recorded:
            continue
        max_new = min(request.max_new_tokens, args.max_new_tokens or request.max_new_tokens)
        prompt = prompt_ids(pair, request, max_new, recorded)
        output = list(engine.generate(prompt, max_new).output_ids)
        ngram = ngram_run_lengths(prompt, output, RECORDED_MAX_K, inputs.engine.ngram)
        runs = [DrafterRunLengths(NGRAM, RECORDED_MAX_K, ngram.runs, ngram.proposed)]
        probs = []
        if pair.draft is not None:
            agree, probs = draft_predictions(pair.draft, prompt, output)
            runs.append(DrafterRunLengths(DRAFT_MODEL, RECORDED_MAX_K, run_lengths(agree, RECORDED_MAX_K),
                                          [RECORDED_MAX_K] * len(output)))
        row = RequestRow(
            request_id=request.request_id, workload=workload.name, group_id=request.group_id, turn=request.turn,
            arrival_s=request.arrival_s, prompt_ids=prompt, output_ids=output, max_new_tokens=max_new,
            run_lengths=runs, draft_top1_probs=probs)
        writer.append("requests", [row])
        recorded[row.request_id] = row
    writer.flush()
    return recorded


def record_ops(writer: TraceWriter, pair, args, progress, repeats: range | None = None,
               wait: Callable[[], float | None] = lambda: None) -> None:
    """The ops grid, or the given repeats of it (a pass); rows already written are skipped.
    ``wait`` goes before each op (``MachineSpeed.wait``: a pass takes minutes, and a slow
    phase within it would price the ops above the runs, which wait out every one); what
    it returns is the op's ``probe_s``."""
    done = frozenset(writer.existing_keys("ops"))
    rows = measure_pair(pair, GRIDS[args.grid], args.device, done, repeats, wait)  # each op timed on next()
    desc = "ops" if repeats is None else f"ops pass {repeats.start + 1}/{GRIDS[args.grid].repeats}"
    for row in progress(rows, desc=desc, unit="op"):
        writer.append("ops", [row])


def run(args) -> int:
    from tqdm import tqdm

    def progress(items=None, **kwargs):
        return tqdm(items, file=sys.stderr, leave=False, **kwargs)

    start = time.perf_counter()
    if args.timing_trace is not None and not {"ops", "runs"} <= set(args.skip):
        raise ValueError("--timing-trace names the trace that holds this one's timing: record with --skip ops runs")
    loads = loads_of(args.serve_concurrency, args.serve_rate)
    policies = [name.strip() for name in args.serve_policies.split(",") if name.strip()]
    if loads and ("requests" in args.skip or args.random_weights):
        raise ValueError("serving under load serves the recorded requests: do not skip them, and use real weights")
    if loads and not policies:
        raise ValueError("--serve-policies names no policy")
    for policy in policies:  # a bad name or policy file fails before any model loads
        try:
            check_policy(policy, args.pair)
        except ValueError as exc:
            raise ValueError(f"--serve-policies: {exc}") from None
    if args.serve_requests < 1:
        raise ValueError(f"--serve-requests must be at least 1, got {args.serve_requests}")
    if args.serve_resample is not None and args.serve_resample < 1:
        raise ValueError(f"--serve-resample must be at least 1, got {args.serve_resample}")
    for option in ("itl_target", "ttft_target"):
        if getattr(args, option) is not None and getattr(args, option) <= 0:
            raise ValueError(f"--{option.replace('_', '-')} must be positive, got {getattr(args, option):g}")
    if args.recalibrate and args.resume:
        raise ValueError("--recalibrate cannot go with --resume: a resumed recording keeps the timings it began with")
    batch = BatchConfig(args.max_num_seqs, args.max_num_batched_tokens, itl_target_s=args.itl_target,
                        ttft_target_s=args.ttft_target, max_num_prefills=args.max_num_prefills)
    pair, workload = load(args)
    run_policies(pair, args)  # a bad --runs-policies fails before any recording
    inputs = decision_inputs(pair, args)
    name = Path(args.workload).stem if is_user_file(args.workload) else args.workload
    out = args.out or Path("traces") / f"{args.pair}-{name if workload else 'random-weights'}"
    with TraceWriter(out, trace_meta(args, pair, inputs), resume=args.resume, flush_every_rows=args.flush_rows) as writer:
        if workload is not None and "requests" not in args.skip:
            requests = record_requests(writer, pair, workload, args, inputs, progress)
        with_runs = workload is not None and "runs" not in args.skip and "requests" not in args.skip
        timed = "ops" not in args.skip
        grid_alone = timed and not with_runs  # not spread across runs: in one block, or across the loads
        if grid_alone and not loads:
            record_ops(writer, pair, args, progress)
        if with_runs:  # the ops' repeats in passes spread across the runs
            ops_pass = (lambda i, wait: record_ops(writer, pair, args, progress, range(i, i + 1), wait)) \
                if timed else None
            record_runs(writer, pair, requests, inputs, args, progress, ops_pass, GRIDS[args.grid].repeats)
        if loads:
            recorded = sorted(requests.values(), key=lambda r: r.request_id)
            served = (recorded[:args.serve_requests] if args.serve_resample is None else
                      [recorded[i] for i in resample_families([r.group_id for r in recorded], args.serve_resample,
                                                              np.random.default_rng(args.seed))])

            speed = MachineSpeed(forward_probe(pair.target), args.runs_noise_tolerance, args.runs_max_wait_s)

            def ops_before(position: int, num_loads: int) -> None:  # the ops' repeats spread across the loads,
                passes_at(position, num_loads, GRIDS[args.grid].repeats,  # each op probed as each load is
                          lambda i: record_ops(writer, pair, args, progress, range(i, i + 1), speed.wait))
            record_serving(writer, pair, served, inputs, batch, loads, policies, args.seed, progress,
                           ops_before if grid_alone else None, speed)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (ValueError, TraceError, WorkloadError, OSError),
                   interrupted="interrupted: the flushed rows are kept; continue with --resume")


if __name__ == "__main__":
    sys.exit(main())
