"""Prompt lookup against its peer: tokens/s of ``ar``, ``ngram-k4`` and ``rakv`` next to
Hugging Face ``generate`` without and with ``prompt_lookup_num_tokens`` (N = 3 and 10),
on code (HumanEval), chat turns that revise the previous answer, and prose.

    python -m bench.prompt_lookup                       # smollm2, 96 new tokens
    python -m bench.prompt_lookup --pair tiny --code 2 --chat 2 --prose 2 --max-new-tokens 16

Every figure comes from this run, with the configs run in lockstep (each prompt under
every config before the next prompt). Each output is checked token for token against the
engine's ``ar`` output; a mismatch makes the exit status 1. Chat: the first turn is
generated (untimed) in the same engine, so the second turn can hit the store, as it would
in a server; Hugging Face keeps no state between calls.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.harness import fresh_engine, hf_generate, timed
from profiler.prompt_texts import CHAT, PROSE, REVISE, chat_prompt
from rakv.cli import add_precision_arguments, run_cli

ENGINE_POLICIES = ("ar", "ngram-k4", "rakv")
HF_LOOKUP_TOKENS = (None, 3, 10)


@dataclass(frozen=True)
class Row:
    workload: str
    config: str
    num_requests: int
    generated_tokens: int
    wall_s: float
    mismatches: int
    acceptance: float | None  # accepted / proposed draft tokens (engine) over all rounds
    actions: str
    mean_proposed: float | None = None  # draft tokens proposed per round (engine)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


def workloads(pair, args) -> dict[str, list[list[int]]]:
    """Prompt ids per workload (chat: the first turns; the revisions are built on their outputs)."""
    from profiler.workloads import humaneval_prompts
    code = [pair.encode(text) for _, text in humaneval_prompts()[: args.code]]
    prose = [pair.encode(chat_prompt(t)) for t in PROSE[: args.prose]]
    chat = [pair.encode(chat_prompt(q)) for q in CHAT[: args.chat]]
    return {"code": code, "chat": chat, "prose": prose}


@dataclass
class Tally:
    """One config's running totals over a workload."""

    generated_tokens: int = 0
    wall_s: float = 0.0
    mismatches: int = 0
    accepted: int = 0
    proposed: int = 0
    num_rounds: int = 0
    actions: Counter = field(default_factory=Counter)

    def add(self, output: list[int], seconds: float, reference: list[int] | None) -> None:
        self.generated_tokens += len(output)
        self.wall_s += seconds
        self.mismatches += int(reference is not None and output != reference)

    def add_result(self, result, reference: list[int] | None) -> list[int]:
        """An engine's ``RequestResult``; returns its output."""
        output = list(result.output_ids)
        self.add(output, result.e2e_s, reference)
        self.accepted += sum(r.accepted for r in result.rounds)
        self.proposed += sum(r.num_proposed for r in result.rounds)
        self.num_rounds += len(result.rounds)
        self.actions[str(result.action)] += 1
        return output

    def row(self, workload: str, config: str, num_requests: int, engine: bool) -> Row:
        acceptance = self.accepted / self.proposed if engine and self.proposed else None
        actions = " ".join(f"{a}x{c}" for a, c in self.actions.items())
        return Row(workload, config, num_requests, self.generated_tokens, self.wall_s, self.mismatches,
                   acceptance, actions, self.proposed / self.num_rounds if engine and self.num_rounds else None)


def run_workload(pair, workload: str, prompts: list[list[int]], args, timings) -> list[Row]:
    """Every config on one prompt before the next (lockstep), so drift in the machine's
    load falls on all of them alike. Chat: each engine first generates the first turn
    (untimed, so its store holds it, as a server's would); the timed revision turn quotes
    that answer. Hugging Face keeps no state between calls."""
    engines = {name: fresh_engine(pair, name, timings=timings if name == "rakv" else None)
               for name in ENGINE_POLICIES}
    tallies = {name: Tally() for name in (*ENGINE_POLICIES, *HF_LOOKUP_TOKENS)}
    for prompt in prompts:
        if workload == "chat":
            first = [list(engine.generate(prompt, args.max_new_tokens).output_ids) for engine in engines.values()]
            prompt = prompt + first[0] + pair.encode_continuation(REVISE)
        reference = None
        for name, engine in engines.items():
            output = tallies[name].add_result(engine.generate(prompt, args.max_new_tokens), reference)
            reference = reference or output
        for lookup in HF_LOOKUP_TOKENS:
            kwargs = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
            output, seconds = timed(lambda: hf_generate(pair, prompt, len(reference), **kwargs))
            tallies[lookup].add(list(output), seconds, reference)
    rows = [tallies[name].row(workload, name, len(prompts), engine=True) for name in ENGINE_POLICIES]
    rows += [tallies[lookup].row(workload, "hf generate" if lookup is None else f"hf prompt lookup N={lookup}",
                                 len(prompts), engine=False) for lookup in HF_LOOKUP_TOKENS]
    return rows


def run(args) -> int:
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    pair = load_pair(args.pair, linear_kernels=args.linear_kernels, weights_mode=args.weights)
    timings = load_or_calibrate(pair)
    rows: list[Row] = []
    for workload, prompts in workloads(pair, args).items():
        if not prompts:
            continue
        print(f"{workload}: {len(prompts)} prompts", file=sys.stderr)
        workload_rows = run_workload(pair, workload, prompts, args, timings)
        for row in workload_rows:
            print(f"  {row.config}: {row.tokens_per_s:.1f} tok/s", file=sys.stderr)
        rows += workload_rows
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows], indent=1))
    return 1 if any(r.mismatches for r in rows) else 0


def report(rows: list[Row]) -> str:
    lines = [f"{'workload':8} {'config':24} {'tok/s':>7} {'vs ar':>6} {'vs hf':>6} {'accept':>7} {'mism':>4}  actions"]
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        ar = next(r for r in group if r.config == "ar").tokens_per_s
        hf = next(r for r in group if r.config == "hf generate").tokens_per_s
        for r in group:
            acc = "" if r.acceptance is None else f"{r.acceptance:.3f}"
            lines.append(f"{workload:8} {r.config:24} {r.tokens_per_s:7.2f} {r.tokens_per_s / ar:6.2f} "
                         f"{r.tokens_per_s / hf:6.2f} {acc:>7} {r.mismatches:4}  {r.actions}")
        best_peer = max(r.tokens_per_s for r in group if r.config.startswith("hf prompt lookup"))
        rakv = next(r for r in group if r.config == "rakv").tokens_per_s
        lines.append(f"{workload:8} rakv / best peer N = {rakv / best_peer:.2f};  rakv / ar = {rakv / ar:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prompt_lookup", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2")
    add_precision_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--code", type=int, default=20, help="HumanEval prompts (default: 20)")
    p.add_argument("--chat", type=int, default=10, help="revision turns (default: 10)")
    p.add_argument("--prose", type=int, default=10, help="prose prompts (default: 10)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    return run_cli(run, p.parse_args(argv), (ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
