"""Decode speed: the engine's ``ar`` seconds per decoded token / Hugging Face
``generate``'s (section 3 of ``python -m bench.engine``).

    python -m bench.decode --pair tiny --quick

Same prompts, same ``max_new_tokens``, store off; the outputs must be identical. Seconds
per token are ``(e2e - ttft) / (tokens - 1)``: the prefill is left out. The engine and HF
alternate which goes first, so drift in the machine's load falls on both.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from bench.harness import (Checks, bench_main, bench_parser, check_at_least_one, fresh_engine, hf_generate,
                           load_warm_pair, long_ids, ms, progress, report, spread, timed)


@dataclass(frozen=True)
class DecodePoint:
    prompt_tokens: int
    engine_tokens: int
    engine_ttft_s: float
    engine_e2e_s: float
    hf_tokens: int
    hf_ttft_s: float
    hf_e2e_s: float
    identical: bool

    @property
    def engine_per_token_s(self) -> float:
        return (self.engine_e2e_s - self.engine_ttft_s) / max(self.engine_tokens - 1, 1)

    @property
    def hf_per_token_s(self) -> float:
        return (self.hf_e2e_s - self.hf_ttft_s) / max(self.hf_tokens - 1, 1)


@dataclass(frozen=True)
class DecodeSection:
    max_new_tokens: int
    points: tuple[DecodePoint, ...]
    median_ratio: float  # median over prompts of engine / HF seconds per token
    pooled_ratio: float  # total engine decode seconds per token / total HF


def bench_decode(pair, num_prompts: int, max_new_tokens: int, checks: Checks) -> DecodeSection:
    engine = fresh_engine(pair, "ar", "off")
    high = min(256, pair.max_positions - max_new_tokens - 1)
    points = []
    with progress(num_prompts, "3 ar vs HF") as bar:
        for i, length in enumerate(spread(min(32, high), high, num_prompts)):
            ids = long_ids(pair, length, f"Notes {i + 1}. ")

            def run_engine():
                return engine.generate(ids, max_new_tokens)

            def run_hf():
                _, ttft = timed(lambda: hf_generate(pair, ids, 1))
                out, e2e = timed(lambda: hf_generate(pair, ids, max_new_tokens))
                return out, ttft, e2e

            if i % 2 == 0:  # alternate the order to spread drift and noise
                result, (hf_out, hf_ttft, hf_e2e) = run_engine(), run_hf()
            else:
                (hf_out, hf_ttft, hf_e2e), result = run_hf(), run_engine()
            identical = hf_out == result.output_ids
            checks.expect(identical, f"ar vs HF: prompt {i} ({length} tokens) outputs differ")
            checks.expect(len(result.output_ids) > 1, f"ar vs HF: prompt {i} gave one token only")
            points.append(DecodePoint(length, len(result.output_ids), result.ttft_s, result.e2e_s,
                                      len(hf_out), hf_ttft, hf_e2e, identical))
            bar.update()
    usable = [p for p in points if p.engine_tokens > 1 and p.hf_tokens > 1]
    median_ratio = statistics.median(p.engine_per_token_s / p.hf_per_token_s for p in usable)
    engine_total = sum(p.engine_e2e_s - p.engine_ttft_s for p in usable) / sum(p.engine_tokens - 1 for p in usable)
    hf_total = sum(p.hf_e2e_s - p.hf_ttft_s for p in usable) / sum(p.hf_tokens - 1 for p in usable)
    return DecodeSection(max_new_tokens, tuple(points), median_ratio, engine_total / hf_total)


def format_decode(dec: DecodeSection) -> list[str]:
    lines = [f"3. Engine ar / HF generate, seconds per decoded token (store off, max_new_tokens="
             f"{dec.max_new_tokens}, (e2e - ttft) / (tokens - 1))",
             "   prompt_tok  tokens  engine_ms/tok  hf_ms/tok   ratio  engine_ttft_ms  hf_ttft_ms  identical"]
    for p in dec.points:
        ratio = p.engine_per_token_s / p.hf_per_token_s
        lines.append(f"   {p.prompt_tokens:10d}  {p.engine_tokens:6d}  {ms(p.engine_per_token_s):>13}  "
                     f"{ms(p.hf_per_token_s):>9}  {ratio:6.3f}  {ms(p.engine_ttft_s):>14}  {ms(p.hf_ttft_s):>10}  "
                     f"{p.identical}")
    lines.append(f"   median ratio {dec.median_ratio:.3f} (pooled {dec.pooled_ratio:.3f}; goal <= 1.05)")
    return lines


def run(args) -> int:
    checks = Checks()
    pair = load_warm_pair(args)
    return report(format_decode(bench_decode(pair, args.prompts, args.new_tokens, checks)), checks)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.decode",
                     "Engine ar against Hugging Face generate, seconds per decoded token, outputs checked identical.")
    p.add_argument("--prompts", type=int, default=None, help="prompts (default: 6, --quick: 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="max_new_tokens (default: 48, --quick: 12)")
    args = p.parse_args(argv)
    check_at_least_one(p, args, "prompts", "new_tokens", "threads")
    if args.prompts is None:
        args.prompts = 2 if args.quick else 6
    if args.new_tokens is None:
        args.new_tokens = 12 if args.quick else 48
    return bench_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
