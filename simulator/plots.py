"""``simulator.replay --plot DIR``: the replay's figures, as PNG (matplotlib, no display).

- ``latency_cdf.png``: the end-to-end latency CDF of every policy replayed;
- ``actions.png``: the action each adaptive policy (``rakv``, the oracle) chose, against
  the request's prompt length and stored hit length;
- ``crossover.png``: time per token against acceptance for each k and drafter, with the
  plain step's and the break-even acceptance marked (``simulator.crossover``).
"""
from __future__ import annotations

from pathlib import Path
from statistics import median

import numpy as np

from simulator.crossover import crossovers
from simulator.timing import Timing
from simulator.trace import Trace

HIGHLIGHT = ("ar", "kv-only", "joint-k4", "rakv", "oracle")


def write_plots(directory: Path, results: dict, timing: Timing, trace: Trace) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (_, served) in results.items():
        e2e = np.sort([s.e2e_s for s in served])
        strong = name in HIGHLIGHT or len(results) <= 6
        ax.step(e2e, np.arange(1, len(e2e) + 1) / len(e2e), where="post", lw=1.8 if strong else 0.6,
                alpha=1.0 if strong else 0.35, label=name if strong else None)
    ax.set(xlabel="end-to-end latency (s), queueing included", ylabel="fraction of requests",
           title=f"{trace.path.name}: latency CDF per policy")
    ax.legend(fontsize=8)
    paths.append(_save(fig, directory / "latency_cdf.png"))

    adaptive = [name for name in ("rakv", "oracle") if name in results]
    if adaptive:
        fig, axes = plt.subplots(1, len(adaptive), figsize=(6 * len(adaptive), 4.5), squeeze=False)
        for ax, name in zip(axes[0], adaptive):
            served = results[name][1]
            labels = sorted({s.action for s in served})
            for i, label in enumerate(labels):
                mine = [s for s in served if s.action == label]
                ax.scatter([s.num_prompt_tokens for s in mine], [s.hit_tokens for s in mine], s=14,
                           color=plt.cm.tab10(i % 10), label=f"{label} ({len(mine)})", alpha=0.7)
            ax.set(xlabel="prompt tokens", ylabel="stored hit tokens", title=f"{name}: chosen action")
            ax.legend(fontsize=7)
        paths.append(_save(fig, directory / "actions.png"))

    context = int(median(len(r.prompt_ids) for r in trace.requests))
    rows = crossovers(timing, context)
    drafters = list(dict.fromkeys(r.drafter for r in rows))
    fig, axes = plt.subplots(1, len(drafters), figsize=(6 * len(drafters), 4.5), squeeze=False)
    acceptance = np.linspace(0.0, 0.999, 200)
    for ax, drafter in zip(axes[0], drafters):
        step_ms = rows[0].step_s * 1e3
        ax.axhline(step_ms, color="black", lw=1.2, label="plain step (k = 0)")
        for i, row in enumerate(r for r in rows if r.drafter == drafter):
            per_token = row.per_token_ms(acceptance)
            color = plt.cm.viridis(i / 5)
            ax.plot(acceptance, per_token, color=color, label=f"k = {row.k}")
            if row.break_even is not None:
                ax.plot([row.break_even], [step_ms], "o", color=color)
                ax.annotate(f"{row.break_even:.2f}", (row.break_even, step_ms), textcoords="offset points",
                            xytext=(0, 6 + 8 * (i % 2)), ha="center", fontsize=7, color=color)
        ax.set(xlabel="per-token acceptance", ylabel="ms per token", ylim=(0, step_ms * 3),
               title=f"{drafter}: time per token at context {context} ({timing.source})")
        ax.legend(fontsize=8)
    paths.append(_save(fig, directory / "crossover.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
