"""Speculation with a draft model against its peer: tokens/s of ``ar``, fixed policies,
``rakv``, Hugging Face ``generate`` and ``generate(assistant_model=draft)`` with its
defaults (up to 20 draft tokens, stop below 0.4 confidence), on code (HumanEval) and prose.

    python -m bench.assisted                          # qwen-coder: 6 code + 4 prose, 64 tokens
    python -m bench.assisted --pair smollm2 --fixed ngram-k4,spec-k4
    python -m bench.assisted --profile                # where one request's time goes

Every figure comes from this run, with one torch thread and the configs in lockstep (each
prompt under every config before the next prompt). Hugging Face runs as a user loads it,
on PyTorch's stock kernels; where the engine runs packed Linear layers
(``rakv.cpu_linear``), HF runs again on those, which compares the mechanisms alone. Each
engine output is checked token for token against the engine's ``ar``, each HF output
against HF ``generate`` on the same kernels; a mismatch makes the exit status 1. Goals (the speculation
issue): ``rakv`` / HF assisted >= 1.2 on code and >= 1.0 on prose, and ``rakv`` within 2 %
of the best fixed policy on each workload; with smollm2, ``rakv`` not slower than ``ar``
on prose.

``--profile`` runs one prompt (the first HumanEval one) under a policy and HF assisted, and
splits each request's wall time into draft-model forwards, target forwards, cache
rollback (crop), prompt lookup and the rest (Python between forwards).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.harness import fresh_engine, hf_generate, timed
from bench.prompt_lookup import Row, Tally
from rakv.cli import add_precision_arguments

GOAL_CODE_VS_ASSISTED = 1.2
GOAL_PROSE_VS_ASSISTED = 1.0
GOAL_FIXED_SLACK = 0.02


def workloads(pair, num_code: int, num_prose: int) -> dict[str, list[list[int]]]:
    from profiler.prompt_texts import PROSE, chat_prompt
    from profiler.workloads import humaneval_prompts
    return {"code": [pair.encode(text) for _, text in humaneval_prompts()[:num_code]],
            "prose": [pair.encode(chat_prompt(t)) for t in PROSE[:num_prose]]}


def run_workload(pair, workload: str, prompts: list[list[int]], policies: list[str], timings,
                 max_new_tokens: int) -> tuple[list[Row], int]:
    """Each prompt under every config before the next; a fresh engine per config, so the
    store only holds this workload's earlier prompts. Hugging Face runs on PyTorch's stock
    kernels (as a user loads it), and again on the engine's packed ones when they differ.
    Engine outputs are checked against ``ar``; stock-kernel HF outputs against stock HF
    ``generate``, since float rounding differs between kernels. Returns the rows and the
    number of prompts whose stock HF output differs from ``ar``'s."""
    from rakv.cpu_linear import STOCK, stock_linears
    from rakv.weights import FP32
    engines = {name: fresh_engine(pair, name, timings=timings if name == "rakv" else None) for name in policies}
    peers = {"hf generate": {}, "hf assisted": {"assisted": True}}
    # quantized layers have no stock form: HF's rows already run on them
    same_kernels = ({} if pair.linear_kernels == STOCK or pair.weights != FP32
                    else {f"{n} ({pair.linear_kernels})": kw for n, kw in peers.items()})
    tallies = {name: Tally() for name in (*policies, *peers, *same_kernels)}
    kernel_diffs = 0
    for i, prompt in enumerate(prompts):
        reference = None
        for name, engine in engines.items():
            output = tallies[name].add_result(engine.generate(prompt, max_new_tokens), reference)
            reference = reference or output
        stock_reference = None
        with stock_linears(pair.target, pair.draft):
            for name, kwargs in peers.items():
                output, seconds = timed(lambda: hf_generate(pair, prompt, len(reference), **kwargs))
                tallies[name].add(list(output), seconds, stock_reference)
                stock_reference = stock_reference or list(output)
        kernel_diffs += stock_reference != reference
        for name, kwargs in same_kernels.items():
            output, seconds = timed(lambda: hf_generate(pair, prompt, len(reference), **kwargs))
            tallies[name].add(list(output), seconds, reference)
        line = "  ".join(f"{n} {t.generated_tokens / t.wall_s:.2f}" for n, t in tallies.items())
        print(f"  {workload} {i + 1}/{len(prompts)}: {line}", file=sys.stderr, flush=True)
    return [tallies[n].row(workload, n, len(prompts), engine=n in engines) for n in tallies], kernel_diffs


def report(rows: list[Row], fixed: list[str]) -> tuple[str, dict]:
    lines = [f"{'workload':8} {'config':20} {'tok/s':>7} {'vs ar':>6} {'vs hf-asst':>10} {'accept':>7} "
             f"{'prop/rnd':>8} {'mism':>4}  actions"]
    verdicts = {}
    for workload in dict.fromkeys(r.workload for r in rows):
        group = {r.config: r for r in rows if r.workload == workload}
        ar, assisted = group["ar"].tokens_per_s, group["hf assisted"].tokens_per_s
        for r in group.values():
            acc = "" if r.acceptance is None else f"{r.acceptance:.3f}"
            prop = "" if r.mean_proposed is None else f"{r.mean_proposed:.2f}"
            lines.append(f"{workload:8} {r.config:20} {r.tokens_per_s:7.2f} {r.tokens_per_s / ar:6.2f} "
                         f"{r.tokens_per_s / assisted:10.2f} {acc:>7} {prop:>8} {r.mismatches:4}  {r.actions}")
        rakv = group["rakv"].tokens_per_s
        best_fixed = max((group[n] for n in ("ar", *fixed)), key=lambda r: r.tokens_per_s)
        verdicts[workload] = {"rakv_vs_assisted": rakv / assisted, "rakv_vs_ar": rakv / ar,
                              "best_fixed": best_fixed.config, "rakv_vs_best_fixed": rakv / best_fixed.tokens_per_s}
        same = next((r for name, r in group.items() if name.startswith("hf assisted (")), None)
        if same is not None:
            verdicts[workload]["rakv_vs_assisted_same_kernels"] = rakv / same.tokens_per_s
        goal = GOAL_CODE_VS_ASSISTED if workload == "code" else GOAL_PROSE_VS_ASSISTED
        vs_fixed = rakv / best_fixed.tokens_per_s
        lines.append(f"{workload:8} rakv / hf assisted = {rakv / assisted:.2f} (goal {goal}: "
                     f"{_verdict(rakv / assisted >= goal)});  rakv / best fixed ({best_fixed.config}) = {vs_fixed:.2f} "
                     f"(goal {1 - GOAL_FIXED_SLACK}: {_verdict(vs_fixed >= 1 - GOAL_FIXED_SLACK)});  "
                     f"rakv / ar = {rakv / ar:.2f}")
        if same is not None:
            lines.append(f"{workload:8} rakv / {same.config} = {rakv / same.tokens_per_s:.2f} "
                         "(HF assisted on the engine's packed kernels: the mechanisms alone)")
    return "\n".join(lines), verdicts


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


# -- where one request's time goes ------------------------------------------------------
@dataclass
class Breakdown:
    """Seconds of one request by where they were spent, and how many calls."""

    config: str
    total_s: float = 0.0
    seconds: dict = field(default_factory=Counter)
    calls: dict = field(default_factory=Counter)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds
        self.calls[part] += 1

    def lines(self) -> list[str]:
        rest = self.total_s - sum(self.seconds.values())
        parts = [*sorted(self.seconds.items(), key=lambda kv: -kv[1]), ("other (Python, argmax, ...)", rest)]
        rounds = f", {self.calls['rounds']} rounds" if "rounds" in self.calls else ""
        out = [f"{self.config}: {self.total_s:.2f} s{rounds}"]
        for part, seconds in parts:
            calls = f" ({self.calls[part]} calls)" if part in self.seconds else ""
            out.append(f"  {part:32} {seconds:7.3f} s  {100 * seconds / self.total_s:5.1f} %{calls}")
        return out


def timed_model(model, breakdown: Breakdown, label: str):
    """Forward hooks adding each of ``model``'s forwards to ``breakdown`` (by tokens fed:
    one token is a step, more is a prefill, catch-up or verification)."""
    starts = []

    def before(module, args, kwargs):
        starts.append(time.perf_counter())

    def after(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        kind = "step" if ids is not None and ids.shape[-1] == 1 else "multi-token"
        breakdown.add(f"{label} forward, {kind}", time.perf_counter() - starts.pop())

    return (model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True))


def profile(pair, prompt: list[int], policy: str, max_new_tokens: int, timings=None) -> list[Breakdown]:
    """One request under ``policy`` and under HF assisted, each split by ``timed_model``,
    plus the engine's cache crops and prompt lookups."""
    import rakv.decoding
    import rakv.drafters
    engine_parts = Breakdown(f"engine {policy}")
    originals = (rakv.decoding.crop_to, rakv.drafters.ngram_match)

    def crop(*args):
        start = time.perf_counter()
        originals[0](*args)
        engine_parts.add("cache crop (rollback)", time.perf_counter() - start)

    def lookup(*args):
        start = time.perf_counter()
        value = originals[1](*args)
        engine_parts.add("prompt lookup (n-gram)", time.perf_counter() - start)
        return value

    engine = fresh_engine(pair, policy, store_mode="off", timings=timings)
    hooks = [*timed_model(pair.target, engine_parts, "target"), *timed_model(pair.draft, engine_parts, "draft")]
    rakv.decoding.crop_to, rakv.drafters.ngram_match = crop, lookup
    try:
        result = engine.generate(prompt, max_new_tokens)
    finally:
        rakv.decoding.crop_to, rakv.drafters.ngram_match = originals
        for hook in hooks:
            hook.remove()
    engine_parts.total_s = result.e2e_s
    engine_parts.calls["rounds"] = len(result.rounds)
    hf_parts = Breakdown("hf assisted")
    hooks = [*timed_model(pair.target, hf_parts, "target"), *timed_model(pair.draft, hf_parts, "draft")]
    try:
        output, hf_parts.total_s = timed(lambda: hf_generate(pair, prompt, len(result.output_ids), assisted=True))
    finally:
        for hook in hooks:
            hook.remove()
    if list(output) != list(result.output_ids):
        raise ValueError("HF assisted and the engine disagree on the profiled prompt")
    return [engine_parts, hf_parts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.assisted", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="qwen-coder")
    p.add_argument("--code", type=int, default=6, help="HumanEval prompts (default: 6)")
    p.add_argument("--prose", type=int, default=4, help="prose prompts (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fixed", default="spec-k4,spec-k8",
                   help="fixed policies to run besides ar; the best of them and ar is rakv's bar (default: spec-k4,spec-k8)")
    p.add_argument("--profile", metavar="POLICY", nargs="?", const="joint-k4", default=None,
                   help="profile the first request under POLICY (default joint-k4) and HF assisted instead")
    add_precision_arguments(p)
    p.add_argument("--json", type=Path, default=None, help="also write the rows and verdicts as JSON")
    args = p.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(1)
        from rakv.calibrate import load_or_calibrate
        from rakv.cpu_linear import stock_linears
        from rakv.models import load_pair
        pair = load_pair(args.pair, linear_kernels=args.linear_kernels, weights_mode=args.weights)
        if pair.draft is None:
            raise ValueError(f"pair {args.pair!r} has no draft model to assist with")
        prompts = workloads(pair, args.code, args.prose)
        fixed = [name.strip() for name in args.fixed.split(",") if name.strip()]
        warm = prompts["code"][0][:16] if prompts["code"] else pair.encode("Warm up.")
        hf_generate(pair, warm, 4, assisted=True)
        with stock_linears(pair.target, pair.draft):
            hf_generate(pair, warm, 4, assisted=True)
        if args.profile:
            first = next((p[0] for p in prompts.values() if p), None)
            if first is None:
                raise ValueError("--profile needs a prompt: --code or --prose at least 1")
            timings = load_or_calibrate(pair) if args.profile == "rakv" else None
            for part in profile(pair, first, args.profile, args.max_new_tokens, timings):
                print("\n".join(part.lines()))
            return 0
        timings = load_or_calibrate(pair)
        rows: list[Row] = []
        kernel_diffs = 0
        start = time.perf_counter()
        for workload, workload_prompts in prompts.items():
            if workload_prompts:
                workload_rows, diffs = run_workload(pair, workload, workload_prompts, ["ar", *fixed, "rakv"],
                                                    timings, args.max_new_tokens)
                rows, kernel_diffs = rows + workload_rows, kernel_diffs + diffs
        text, verdicts = report(rows, fixed)
        print(f"{args.pair}, {args.max_new_tokens} new tokens, 1 torch thread, lockstep, engine Linear kernels "
              f"{pair.linear_kernels}, weights {pair.weights}, {time.perf_counter() - start:.0f} s")
        print(text)
        print(f"stock-kernel HF generate differs from the engine's ar on {kernel_diffs} of "
              f"{sum(map(len, prompts.values()))} prompts (float rounding of the two kernels; mism counts "
              "each row against its own kernels' reference)")
        if args.json:
            args.json.write_text(json.dumps({"rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows],
                                             "verdicts": verdicts}, indent=1))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if any(r.mismatches for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
