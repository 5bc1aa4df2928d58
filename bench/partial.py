"""Partial hits: TTFT against the uncached length |U| at two total prompt lengths
(section 2 of ``python -m bench.engine``).

    python -m bench.partial --pair tiny --quick

Each point gets a fresh kv-only engine with ``--store prompt``: it stores the prefix P,
then serves P + U, which must reuse exactly |P| tokens and give the cold run's output.
Each figure is the median over ``repeats`` rounds; the cold TTFT is the same prompt on an
empty store.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from bench.harness import (Checks, bench_main, bench_parser, check_at_least_one, fresh_engine, load_warm_pair,
                           long_ids, ms, progress, report)


@dataclass(frozen=True)
class PartialPoint:
    total_tokens: int
    uncached_tokens: int
    expected_reused_tokens: int
    reused_tokens: int
    hit_kind: str
    hit_ttft_s: float  # median over repeats
    cold_ttft_s: float  # median over repeats, same prompt, empty store


@dataclass(frozen=True)
class PartialSection:
    points: tuple[PartialPoint, ...]
    repeats: int


def partial_lengths(pair, quick: bool) -> tuple[list[int], list[int]]:
    """(total prompt lengths, uncached lengths), scaled down for small models."""
    totals = [300, 600]
    if totals[-1] + 2 > pair.max_positions:
        totals = [pair.max_positions * 3 // 8, pair.max_positions * 3 // 4]
    uncached = [16, 64] if quick else [16, 64, 128, 256]
    uncached = [u for u in uncached if u <= totals[0] - 16]  # the prefix keeps >= 16 tokens
    return totals, uncached


def bench_partial_hits(pair, quick: bool, repeats: int, checks: Checks) -> PartialSection:
    totals, uncached = partial_lengths(pair, quick)
    ids = long_ids(pair, max(totals), "Report. ")
    hit_s = {(t, u): [] for t in totals for u in uncached}
    cold_s = {t: [] for t in totals}
    seen = {}
    with progress(repeats * len(totals) * (len(uncached) + 1), "2 partial hits") as bar:
        for _ in range(repeats):
            for total in totals:
                prompt = ids[:total]
                cold = fresh_engine(pair, "kv-only", "prompt").generate(prompt, 1)
                checks.expect(cold.hit_kind == "miss", f"partial: cold {total} was {cold.hit_kind}")
                cold_s[total].append(cold.ttft_s)
                bar.update()
                for u in uncached:
                    engine = fresh_engine(pair, "kv-only", "prompt")
                    engine.generate(prompt[:total - u], 1)  # store P
                    result = engine.generate(prompt, 1)  # P + U
                    checks.expect(result.reused_tokens == total - u,
                                  f"partial: total {total} |U|={u} reused {result.reused_tokens}, expected {total - u}")
                    checks.expect(result.output_ids == cold.output_ids, f"partial: total {total} |U|={u} output differs")
                    hit_s[(total, u)].append(result.ttft_s)
                    seen[(total, u)] = (result.reused_tokens, result.hit_kind)
                    bar.update()
    points = tuple(
        PartialPoint(t, u, t - u, seen[(t, u)][0], seen[(t, u)][1],
                     statistics.median(hit_s[(t, u)]), statistics.median(cold_s[t]))
        for t in totals for u in uncached)
    return PartialSection(points, repeats)


def format_partial(par: PartialSection) -> list[str]:
    lines = [f"2. Partial-hit TTFT vs uncached length (kv-only, --store prompt, fresh store per point, "
             f"median of {par.repeats}, max_new_tokens=1)",
             "   total_tok  uncached_tok  reused_tok  kind      hit_ttft_ms  cold_ttft_ms  hit/cold"]
    for p in par.points:
        lines.append(f"   {p.total_tokens:9d}  {p.uncached_tokens:12d}  {p.reused_tokens:10d}  {p.hit_kind:8s}  "
                     f"{ms(p.hit_ttft_s):>11}  {ms(p.cold_ttft_s):>12}  {p.hit_ttft_s / p.cold_ttft_s:8.3f}")
    by_u = {}
    for p in par.points:
        by_u.setdefault(p.uncached_tokens, []).append(p)
    lines.append("   same |U| across totals, hit TTFT long/short: " + ", ".join(
        f"|U|={u}: {ps[-1].hit_ttft_s / ps[0].hit_ttft_s:.2f}" for u, ps in by_u.items() if len(ps) > 1))
    return lines


def run(args) -> int:
    checks = Checks()
    pair = load_warm_pair(args)
    return report(format_partial(bench_partial_hits(pair, args.quick, args.repeats, checks)), checks)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.partial", "Partial-hit TTFT against the uncached length on a kv-only engine.")
    p.add_argument("--repeats", type=int, default=None, help="rounds, the median is kept (default: 3, --quick: 1)")
    args = p.parse_args(argv)
    check_at_least_one(p, args, "repeats", "threads")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return bench_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
