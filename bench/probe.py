"""Does the recorder's probe see what slows a run? The same request timed again and again,
each run between two probes (``profiler.run_noise.forward_probe``, the recorder's).

    python -m bench.probe --threads 1 --seconds 420        # beside other work, to see it

If the machine's speed is what moves a run's time, the run over the mean of its two
probes (relative to their median) varies far less than the run alone: then dividing each
timing by its probe takes the machine out of a recording's timings (docs/design.md). On
the 2-core AMD machine, beside a Qwen recording on the other core (2026-12-02): 3,122
runs in 7 minutes varied by 11.9 % on average, 5.0 % over their probes (correlation 0.88).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.harness import Checks, bench_main, bench_parser, fresh_engine, load_warm_pair, report

PROMPT = "Write a short story about a lighthouse keeper who finds a map."


@dataclass(frozen=True)
class ProbeSection:
    num_runs: int
    run_mean_deviation: float  # mean |run / median run - 1|
    normalized_mean_deviation: float  # the same of run / (mean probe / median mean probe)
    run_cv: float
    normalized_cv: float
    correlation: float  # of the run's time with the mean of its two probes


def mean_deviation(x: np.ndarray) -> float:
    return float(np.mean(np.abs(x / np.median(x) - 1)))


def cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x))


def bench_probe(pair, seconds: float, max_new_tokens: int, checks: Checks) -> ProbeSection:
    from profiler.run_noise import forward_probe, mean_probe_s
    probe = forward_probe(pair.target)
    prompt = pair.encode(PROMPT)
    reference = None
    runs_s, probes_s = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(runs_s) < 3:
        engine = fresh_engine(pair, "ar")  # a fresh store: every run the same work
        before = probe()
        result = engine.generate(prompt, max_new_tokens)
        probes_s.append(mean_probe_s(before, probe()))  # as the recorder stores a run's probe
        runs_s.append(result.e2e_s)
        reference = reference or result.output_ids
        checks.expect(result.output_ids == reference, f"run {len(runs_s)}: another output")
    runs, probes = np.array(runs_s), np.array(probes_s)  # [num_runs] each
    normalized = runs / (probes / np.median(probes))
    return ProbeSection(len(runs), mean_deviation(runs), mean_deviation(normalized), cv(runs), cv(normalized),
                        float(np.corrcoef(runs, probes)[0, 1]))


def format_probe(s: ProbeSection) -> list[str]:
    return [f"Runs of one request (ar, a fresh engine each), each between two probes: {s.num_runs} runs",
            f"   mean |run / median - 1|: {100 * s.run_mean_deviation:.1f} %, over the probes "
            f"{100 * s.normalized_mean_deviation:.1f} % (ratio {s.normalized_mean_deviation / s.run_mean_deviation:.2f})",
            f"   coefficient of variation: {s.run_cv:.3f}, over the probes {s.normalized_cv:.3f}",
            f"   correlation of a run's time with its probes' mean: {s.correlation:.2f}"]


def run(args) -> int:
    checks = Checks()
    pair = load_warm_pair(args)
    return report(format_probe(bench_probe(pair, args.seconds, args.max_new_tokens, checks)), checks)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.probe", "Whether the recorder's probe predicts a run's slowness.", quick=False)
    p.add_argument("--seconds", type=float, default=120.0, help="how long to keep timing runs (default: 120)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per run (default: 24)")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.max_new_tokens < 1:
        p.error("--seconds must be positive and --max-new-tokens at least 1")
    return bench_main(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
