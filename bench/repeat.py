"""Exact repeats: TTFT of a prompt served from the store / its cold TTFT (section 1 of
``python -m bench.engine``).

    python -m bench.repeat --pair tiny --quick

A kv-only engine serves each prompt cold, then again: the repeat must be an exact hit
with the same output. Prompt lengths spread from 32 tokens to 768 (or 60 % of the pair's
positions, whichever is smaller).
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from bench.harness import (Checks, bench_main, bench_parser, check_at_least_one, fresh_engine, load_warm_pair,
                           long_ids, ms, progress, report, spread)


@dataclass(frozen=True)
class RepeatPoint:
    prompt_tokens: int
    cold_ttft_s: float
    repeat_ttft_s: float
    cold_hit_kind: str
    repeat_hit_kind: str

    @property
    def ratio(self) -> float:
        return self.repeat_ttft_s / self.cold_ttft_s


@dataclass(frozen=True)
class RepeatSection:
    points: tuple[RepeatPoint, ...]
    median_ratio: float


def bench_exact_repeat(pair, num_prompts: int, checks: Checks) -> RepeatSection:
    engine = fresh_engine(pair, "kv-only")
    high = min(768, int(pair.max_positions * 0.6))
    points = []
    with progress(num_prompts, "1 exact repeat") as bar:
        for i, length in enumerate(spread(min(32, high), high, num_prompts)):
            ids = long_ids(pair, length, f"Document {i + 1}. ")
            cold = engine.generate(ids, 4)
            repeat = engine.generate(ids, 4)
            checks.expect(cold.hit_kind == "miss", f"exact-repeat prompt {i}: cold run was {cold.hit_kind}")
            checks.expect(repeat.hit_kind == "exact", f"exact-repeat prompt {i}: repeat was {repeat.hit_kind}")
            checks.expect(repeat.output_ids == cold.output_ids, f"exact-repeat prompt {i}: output changed")
            points.append(RepeatPoint(length, cold.ttft_s, repeat.ttft_s, cold.hit_kind, repeat.hit_kind))
            bar.update()
    return RepeatSection(tuple(points), statistics.median(p.ratio for p in points))


def format_repeat(rep: RepeatSection) -> list[str]:
    lines = [f"1. Exact-repeat TTFT / cold TTFT (kv-only, {len(rep.points)} prompts, each cold then repeated)",
             "   prompt_tok  cold_ttft_ms  repeat_ttft_ms   ratio  kinds"]
    for p in rep.points:
        lines.append(f"   {p.prompt_tokens:10d}  {ms(p.cold_ttft_s):>12}  {ms(p.repeat_ttft_s):>14}  "
                     f"{p.ratio:6.4f}  {p.cold_hit_kind}/{p.repeat_hit_kind}")
    lines.append(f"   median ratio {rep.median_ratio:.4f}")
    return lines


def run(args) -> int:
    checks = Checks()
    pair = load_warm_pair(args)
    return report(format_repeat(bench_exact_repeat(pair, args.prompts, checks)), checks)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.repeat", "Exact-repeat TTFT / cold TTFT on a kv-only engine.")
    p.add_argument("--prompts", type=int, default=None, help="prompts, each cold then repeated (default: 8, --quick: 3)")
    args = p.parse_args(argv)
    check_at_least_one(p, args, "prompts", "threads")
    if args.prompts is None:
        args.prompts = 3 if args.quick else 8
    return bench_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
