"""Engine benchmark: ratios measured in one run, on the machine at hand.

    python -m bench.engine                      # smollm2, then qwen-coder (3 prompts)
    python -m bench.engine --skip-qwen --json bench.json
    python -m bench.engine --pair tiny --quick --skip-qwen   # under a minute, a smoke test
    python -m bench.engine --threads 1          # steadier when other processes share the CPU

Sections (every figure comes from this run; nothing is hard-coded):
1. exact-repeat TTFT / cold TTFT (kv-only engine, each prompt cold then repeated);
2. partial-hit TTFT against the uncached length |U| at two total prompt lengths
   (kv-only, ``--store prompt``, a fresh store per point, reused tokens checked);
3. engine ``ar`` seconds per decoded token / Hugging Face ``generate`` seconds per token
   (same prompts, same max_new_tokens, outputs checked identical);
4. tokens/s of every fixed policy, ``rakv`` and HF assisted generation over a workload with
   shared prefixes, exact repeats and multi-turn follow-ups, each with its own engine, all
   advancing in lockstep (request i through every contender in a rotating order); then
   ar, a few fixed policies, rakv and HF assisted on qwen-coder;
5. the controller's decision overhead: ``policy.decide`` per call, and the engine's
   ``decide_s`` (lookup plus decision) per request.

Each section is its own module, runnable alone: ``bench.repeat`` (1), ``bench.partial`` (2),
``bench.decode`` (3), ``bench.policies`` (4), ``bench.decide`` (5); what they share (fresh
engines, the HF reference, timing, checks) is ``bench.harness``. This module runs them all
on one loaded pair and writes the report.

Prompt lookup (``ar``, ``ngram-k4`` and ``rakv`` against HF ``prompt_lookup_num_tokens`` on
code, chat revisions and prose) has its own script: ``python -m bench.prompt_lookup``.

Progress goes to stderr; the tables go to stdout at the end. A failed check (a repeat
that was not exact, a reused count that differs from the one expected, an output that
differs from plain greedy) is printed and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.decide import DecideSection, bench_decide, format_decide
from bench.decode import DecodeSection, bench_decode, format_decode
from bench.harness import Checks, configure_torch, warm_up, with_derived
from bench.partial import bench_partial_hits, format_partial
from bench.policies import (PolicySection, chat_workload, code_workload, fixed_policy_list, format_policies,
                            policy_section)
from bench.repeat import RepeatSection, bench_exact_repeat, format_repeat
from rakv.cli import add_precision_arguments, run_cli

QWEN_DEFAULT_POLICIES = "ar,kv-only,joint-k2,joint-k4,joint-ngram-k4"


# -- report --------------------------------------------------------------------------
def format_report(pair_name: str, sections: dict, checks: Checks, wall_s: float,
                  load: tuple[float, float]) -> str:
    import torch
    cores = os.cpu_count() or 1
    lines = [f"RAKV engine benchmark: pair {pair_name}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {cores} cores, {wall_s:.0f} s, "
             f"1-min load average {load[0]:.1f} at start, {load[1]:.1f} at end"]
    if max(load) > cores - 0.5:
        hint = " (try --threads 1)" if torch.get_num_threads() > 1 else ""
        lines.append(f"   WARNING: other processes were using the CPU; timings are noisy{hint}")
    rep: RepeatSection = sections["exact_repeat"]
    lines += [""] + format_repeat(rep)
    lines += [""] + format_partial(sections["partial_hits"])
    dec: DecodeSection = sections["decode"]
    lines += [""] + format_decode(dec)
    for key in ("policies", "policies_qwen"):
        if sections.get(key) is not None:
            lines += [""] + format_policies(sections[key])
    dcs: DecideSection = sections["decide"]
    lines += [""] + format_decide(dcs)

    lines += ["", "Summary (ratios from this run)",
              f"   exact-repeat TTFT / cold TTFT            {rep.median_ratio:8.4f}  median of {len(rep.points)}",
              f"   engine ar / HF generate, s per token     {dec.median_ratio:8.3f}  goal <= 1.05"]
    for key in ("policies", "policies_qwen"):
        pol: PolicySection | None = sections.get(key)
        if pol is not None:
            lines.append(f"   rakv / best fixed on {pol.pair:18s}  {pol.rakv_over_best_fixed:8.3f}  best fixed: {pol.best_fixed}")
            if pol.rakv_over_hf_assisted is not None:
                lines.append(f"   rakv / HF assisted on {pol.pair:17s}  {pol.rakv_over_hf_assisted:8.3f}")
    lines += [f"   decide() per call, us                    {dcs.decide_us_per_call:8.1f}  goal <= 100",
              f"   checks failed                            {len(checks.failures):8d}"]
    lines += [f"   FAILED: {f}" for f in checks.failures]
    return "\n".join(lines)


def to_json(section) -> dict:
    """A section's fields, with the figures its points derive (ratios, per-token seconds, tokens/s)."""
    if isinstance(section, RepeatSection):
        return with_derived(section, "points", "ratio")
    if isinstance(section, DecodeSection):
        return with_derived(section, "points", "engine_per_token_s", "hf_per_token_s")
    if isinstance(section, PolicySection):
        return with_derived(section, "runs", "tokens_per_s")
    return asdict(section)


# -- main ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="Benchmark the engine: exact-repeat and partial-hit TTFT, decode speed against "
                    "Hugging Face generate, policies in tokens/s (against HF assisted generation), and "
                    "the controller's overhead. Prints ratios measured in this run.")
    p.add_argument("--pair", default="smollm2", help="model pair for sections 1-5 (default: smollm2)")
    add_precision_arguments(p)
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats (a smoke test)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="max_new_tokens in sections 3 and 4 (default: 48, --quick: 12)")
    p.add_argument("--policies", default="all",
                   help="fixed policies of section 4, comma-separated, or 'all' (ar, kv-only, spec-kN, joint-kN, "
                        "ngram-kN, joint-ngram-kN for N in 1, 2, 4, 6, 8); rakv and ar always run (default: all)")
    p.add_argument("--skip-qwen", action="store_true", help="skip the qwen-coder part of section 4")
    p.add_argument("--qwen-prompts", type=int, default=3,
                   help="code prompts for qwen-coder (default: 3; the workload adds a repeat and a follow-up)")
    p.add_argument("--qwen-new-tokens", type=int, default=32, help="max_new_tokens on qwen-coder (default: 32)")
    p.add_argument("--qwen-policies", default=QWEN_DEFAULT_POLICIES,
                   help=f"fixed policies on qwen-coder (default: {QWEN_DEFAULT_POLICIES}); rakv and ar always run")
    p.add_argument("--no-hf-assisted", action="store_true", help="skip HF assisted generation in section 4")
    p.add_argument("--decide-calls", type=int, default=10_000, help="policy.decide calls timed (default: 10000)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); on a shared, busy machine 1 is far steadier")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every figure as JSON to FILE")
    args = p.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = 12 if args.quick else 48
    for name in ("new_tokens", "qwen_prompts", "qwen_new_tokens", "decide_calls", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for option in ("policies", "qwen_policies"):
        setattr(args, option, fixed_policy_list(p, option, getattr(args, option)))
    return args


def run(args: argparse.Namespace) -> int:
    import torch
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    configure_torch(args.threads)
    start = time.perf_counter()
    load_start = os.getloadavg()[0]
    checks = Checks()
    sections: dict = {}
    print(f"loading {args.pair}", file=sys.stderr)
    pair = load_pair(args.pair, linear_kernels=args.linear_kernels, weights_mode=args.weights)
    timings = load_or_calibrate(pair)
    warm_up(pair)
    sections["exact_repeat"] = bench_exact_repeat(pair, 3 if args.quick else 8, checks)
    sections["partial_hits"] = bench_partial_hits(pair, args.quick, 1 if args.quick else 3, checks)
    sections["decode"] = bench_decode(pair, 2 if args.quick else 6, args.new_tokens, checks)
    workload = chat_workload(short=pair.max_positions < 1024)
    sections["policies"] = policy_section(pair, workload, args.policies, args.new_tokens, not args.no_hf_assisted,
                                          checks, args.pair)
    rakv_run = next(r for r in sections["policies"].runs if r.policy == "rakv")
    sections["decide"] = bench_decide(timings, args.decide_calls, list(rakv_run.decide_s))
    if not args.skip_qwen and args.pair != "qwen-coder":
        del pair
        gc.collect()
        print("loading qwen-coder (the first load converts the GGUF files: minutes)", file=sys.stderr)
        qwen = load_pair("qwen-coder", linear_kernels=args.linear_kernels, weights_mode=args.weights)
        warm_up(qwen)
        sections["policies_qwen"] = policy_section(qwen, code_workload(args.qwen_prompts), args.qwen_policies,
                                                   args.qwen_new_tokens, not args.no_hf_assisted, checks, "qwen-coder")
    wall_s = time.perf_counter() - start
    load = (load_start, os.getloadavg()[0])
    print(format_report(args.pair, sections, checks, wall_s, load), flush=True)
    if args.json is not None:
        figures = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "wall_s": wall_s, "load_average_1min": load, "torch_threads": torch.get_num_threads(),
                   "checks_failed": checks.failures,
                   **{name: to_json(section) for name, section in sections.items()}}
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"figures written to {args.json}", file=sys.stderr)
    return 1 if checks.failures else 0


def main(argv: list[str] | None = None) -> int:
    from rakv.models import PairError
    return run_cli(run, parse_args(argv), (PairError, OSError))


if __name__ == "__main__":
    sys.exit(main())
