"""``python -m simulator.crossover``: the acceptance above which speculation pays, per
drafter and draft length k, on the machine a timing trace was recorded on.

A round of k draft tokens gains E_k(a) = (1 - a^(k+1)) / (1 - a) tokens at per-token
acceptance a (``rakv.cost_model.expected_progress``) and costs the drafter's proposal
plus the target's verification of k + 1 tokens; a plain step gains one token. Speculation
pays where E_k(a) / round > 1 / step. Costs are the simulator's (``simulator.costs``) at
one context length: a draft model's round is k one-token draft forwards (its catch-up is
one token after a round it drafted) and the verification; prompt lookup's is one match
and the verification. Each iteration of the decode loop and each round also carry the
fitted overhead. Imports no torch.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from profiler.schema import TraceError
from rakv.choices import DRAFT_KS, usable_drafters
from rakv.cli import run_cli
from rakv.cost_model import expected_progress
from rakv.drafters import NGRAM
from simulator.costs import CostModelError
from simulator.timing import Timing, load_timing


@dataclass(frozen=True)
class Crossover:
    drafter: str
    k: int
    round_s: float
    step_s: float
    break_even: float | None  # acceptance above which a round beats plain steps; None: never below 1

    @property
    def round_in_steps(self) -> float:
        return self.round_s / self.step_s

    def per_token_ms(self, acceptance) -> list[float]:
        """ms per output token of this round at each per-token acceptance."""
        return [self.round_s * 1e3 / expected_progress(a, self.k) for a in acceptance]


def step_s(timing: Timing, context: int) -> float:
    return timing.costs.target.decode(context) + timing.overhead.iteration_s


def round_s(timing: Timing, drafter: str, k: int, context: int) -> float:
    costs = timing.costs
    cost = costs.target.verify(k + 1, context) + timing.overhead.iteration_s + timing.overhead.round_s
    if drafter == NGRAM:
        return cost + costs.ngram(context)
    return cost + sum(costs.draft.decode(context + i) for i in range(k))


def break_even(round_cost_s: float, step_cost_s: float, k: int) -> float | None:
    """The acceptance a with E_k(a) = round / step, by bisection (E_k rises with a)."""
    need = round_cost_s / step_cost_s
    if need >= k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_progress(mid, k) < need else (low, mid)
    return high


def crossovers(timing: Timing, context: int) -> list[Crossover]:
    drafters = usable_drafters(timing.costs.draft is not None)
    step = step_s(timing, context)
    rows = []
    for drafter in drafters:
        for k in DRAFT_KS:
            cost = round_s(timing, drafter, k, context)
            rows.append(Crossover(drafter, k, cost, step, break_even(cost, step, k)))
    return rows


def markdown(rows: list[Crossover], source: str, context: int) -> str:
    lines = [f"{source}: plain step {rows[0].step_s * 1e3:.2f} ms at context {context}", "",
             "| drafter | k | round (ms) | round / step | pays above acceptance |", "|---|---|---|---|---|"]
    for r in rows:
        pays = "never" if r.break_even is None else f"{r.break_even:.3f}"
        lines.append(f"| {r.drafter} | {r.k} | {r.round_s * 1e3:.2f} | {r.round_in_steps:.2f} | {pays} |")
    return "\n".join(lines)


def plot_crossovers(path: Path, timings: list[Timing], context: int) -> Path:
    """Per drafter, each timing's plain step (dashed) and the time per token of its best k
    at each acceptance (solid), the acceptance where they cross marked: where speculation
    starts to pay on each machine or in each weights mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tables = [crossovers(t, context) for t in timings]
    drafters = list(dict.fromkeys(r.drafter for rows in tables for r in rows))
    fig, axes = plt.subplots(1, len(drafters), figsize=(6 * len(drafters), 4.5), squeeze=False)
    acceptance = np.linspace(0.0, 0.999, 200)
    for ax, drafter in zip(axes[0], drafters):
        top = 0.0
        for i, (timing, rows) in enumerate(zip(timings, tables)):
            mine = [r for r in rows if r.drafter == drafter]
            if not mine:
                continue
            color, step_ms = plt.cm.tab10(i % 10), mine[0].step_s * 1e3
            best = np.min([r.per_token_ms(acceptance) for r in mine], axis=0)
            ax.axhline(step_ms, color=color, lw=1.0, ls="--")
            ax.plot(acceptance, best, color=color, label=f"{timing.source} (step {step_ms:.1f} ms)")
            pays = acceptance[best < step_ms]
            if len(pays):
                ax.plot([pays[0]], [step_ms], "o", color=color)
                ax.annotate(f"{pays[0]:.2f}", (pays[0], step_ms), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=7, color=color)
            top = max(top, 2.5 * step_ms)
        ax.set(xlabel="per-token acceptance", ylabel="ms per token (best k)", ylim=(0, top),
               title=f"{drafter}: plain step (dashed) and speculation at context {context}")
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    if args.context < 1:
        raise ValueError(f"--context must be at least 1, got {args.context}")
    timings = [load_timing(path, None) for path in args.timing]
    print("\n\n".join(markdown(crossovers(t, args.context), t.source, args.context) for t in timings))
    if args.plot:
        print(f"wrote {plot_crossovers(args.plot, timings, args.context)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.crossover",
                                description="Print, per drafter and k, the acceptance above which speculation pays; "
                                "several timing traces (say one per weights mode) side by side.")
    p.add_argument("--timing", type=Path, action="append", required=True,
                   help="a trace directory with an ops table; repeat it to compare machines or weights modes")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache (default: 256)")
    p.add_argument("--plot", type=Path, default=None,
                   help="also write a PNG: per drafter, each timing's plain step and best-k time per token")
    return run_cli(run, p.parse_args(argv), (ValueError, TraceError, CostModelError, OSError))


if __name__ == "__main__":
    sys.exit(main())
