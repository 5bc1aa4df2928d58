"""Prompt lookup against its peer: tokens/s of ``ar``, ``ngram-k4`` and ``rakv`` next to
Hugging Face ``generate`` without and with ``prompt_lookup_num_tokens`` (N = 3 and 10),
on code (HumanEval), chat turns that revise the previous answer, and prose.

    python -m bench.prompt_lookup                       # smollm2, 96 new tokens
    python -m bench.prompt_lookup --pair tiny --code 2 --chat 2 --prose 2 --max-new-tokens 16

Every figure comes from this run. Each output is checked token for token against the
engine's ``ar`` output; a mismatch is printed and makes the exit status 1. Chat: the first
turn is generated (untimed) in the same engine, so the second turn can hit the store, as it
would in a server; Hugging Face keeps no state between calls.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.engine import continuation_ids, fresh_engine, hf_generate, timed

PROSE = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the city of Lisbon in the early morning, in vivid detail.",
    "Explain why the sky is blue to a curious ten-year-old.",
    "Write a letter from a gardener to the first frost of the year.",
    "Describe a busy train station from the point of view of a pigeon.",
    "Write a speech for the opening of a small public library.",
    "Tell the story of a violin maker and her last instrument.",
    "Describe a thunderstorm over the desert at night.",
    "Write a travel diary entry about crossing a mountain pass on foot.",
    "Explain how bread rises, as a baker would to an apprentice.",
)
CHAT = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me a three-day packing list for a rainy hiking trip.",
    "Write a SQL query that returns the ten customers with the most orders.",
    "Draft a polite email asking my manager for a day off next Friday.",
    "Write a bash one-liner that counts lines in all .py files in a folder.",
    "Summarize the rules of chess castling in a short list.",
    "Write a Python class for a simple bank account with deposit and withdraw.",
    "List five tips for writing clear commit messages.",
    "Write a haiku about autumn leaves, then explain its imagery.",
    "Write a JavaScript function that debounces another function.",
)
REVISE = "\nUser: Please revise your answer above: fix any mistakes and keep everything else as it is.\nAssistant:"
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

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


def chat_prompt(question: str) -> str:
    return f"User: {question}\nAssistant:"


def workloads(pair, args) -> dict[str, list[list[int]]]:
    """Prompt ids per workload (chat: the first turns; the revisions are built on their outputs)."""
    from profiler.workloads import humaneval_prompts
    code = [pair.encode(text) for _, text in humaneval_prompts()[: args.code]]
    prose = [pair.encode(chat_prompt(t)) for t in PROSE[: args.prose]]
    chat = [pair.encode(chat_prompt(q)) for q in CHAT[: args.chat]]
    return {"code": code, "chat": chat, "prose": prose}


def engine_row(pair, workload: str, name: str, prompts: list[list[int]], args, timings, reference):
    """One engine policy over a workload; for chat each prompt is a first turn, run
    untimed, then the revision turn that quotes its output is timed."""
    engine = fresh_engine(pair, name, timings=timings if name == "rakv" else None)
    outputs, wall_s, accepted, proposed, actions = [], 0.0, 0, 0, Counter()
    for prompt in prompts:
        if workload == "chat":
            first = engine.generate(prompt, args.max_new_tokens)
            prompt = prompt + list(first.output_ids) + continuation_ids(pair, REVISE)
        result = engine.generate(prompt, args.max_new_tokens)
        wall_s += result.e2e_s
        outputs.append((prompt, list(result.output_ids)))
        accepted += sum(r.accepted for r in result.rounds)
        proposed += sum(r.num_proposed for r in result.rounds)
        actions[str(result.action)] += 1
    mismatches = 0 if reference is None else sum(o != r for (_, o), (_, r) in zip(outputs, reference))
    row = Row(workload, name, len(prompts), sum(len(o) for _, o in outputs), wall_s, mismatches,
              accepted / proposed if proposed else None, " ".join(f"{a}x{c}" for a, c in actions.items()))
    return row, outputs


def hf_row(pair, workload: str, lookup_tokens: int | None, reference) -> Row:
    """Hugging Face generate on the engine's prompts (chat: the same revision turns)."""
    kwargs = {} if lookup_tokens is None else {"prompt_lookup_num_tokens": lookup_tokens}
    outputs, wall_s = [], 0.0
    for prompt, expected in reference:
        output, seconds = timed(lambda: hf_generate(pair, prompt, len(expected), **kwargs))
        outputs.append(list(output))
        wall_s += seconds
    mismatches = sum(o != r for o, (_, r) in zip(outputs, reference))
    config = "hf generate" if lookup_tokens is None else f"hf prompt lookup N={lookup_tokens}"
    return Row(workload, config, len(reference), sum(len(o) for o in outputs), wall_s, mismatches, None, "")


def run(args) -> int:
    from rakv.calibrate import load_or_calibrate
    from rakv.models import load_pair
    pair = load_pair(args.pair)
    timings = load_or_calibrate(pair)
    rows: list[Row] = []
    for workload, prompts in workloads(pair, args).items():
        if not prompts:
            continue
        print(f"{workload}: {len(prompts)} prompts", file=sys.stderr)
        reference = None
        for name in ENGINE_POLICIES:
            row, outputs = engine_row(pair, workload, name, prompts, args, timings, reference)
            reference = reference or outputs
            rows.append(row)
            print(f"  {name}: {row.tokens_per_s:.1f} tok/s", file=sys.stderr)
        for lookup in HF_LOOKUP_TOKENS:
            rows.append(hf_row(pair, workload, lookup, reference))
            print(f"  {rows[-1].config}: {rows[-1].tokens_per_s:.1f} tok/s", file=sys.stderr)
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
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--code", type=int, default=20, help="HumanEval prompts (default: 20)")
    p.add_argument("--chat", type=int, default=10, help="revision turns (default: 10)")
    p.add_argument("--prose", type=int, default=10, help="prose prompts (default: 10)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
