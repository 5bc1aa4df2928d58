"""``simulator.replay --plot DIR``: the replay's figures, as PNG (matplotlib, no display).

- ``latency_cdf.png``: the end-to-end latency CDF of every policy replayed;
- ``actions.png``: the action each adaptive policy (``rakv``, the oracle) chose, against
  the request's prompt length and stored hit length;
- ``crossover.png``: time per token against acceptance for each k and drafter, with the
  plain step's and the break-even acceptance marked (``simulator.crossover``).

Under load (a serving trace, ``simulator.load_replay``), ``write_load_plots``:

- ``latency_vs_load.png``: p50 (solid) and p90 (dashed) TTFT and ITL against the load, one
  colour per policy; closed loops (concurrency) and open loops (request rate) side by side;
- ``speculation_vs_batch.png``: the share of rounds that speculate against the running
  batch size, one line per policy, its loads' rounds pooled;
- ``attainment_vs_rate.png`` (with ``--attainment``): each policy's share of requests
  within the SLO against the rate, each goal as a line, each capacity marked on its own
  (``simulator.capacity``).
"""
from __future__ import annotations

from collections import defaultdict
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


def write_load_plots(directory: Path, results: list, title: str, capacities: list = ()) -> list[Path]:
    """``results``: ``simulator.load_result.LoadResult``s; ``capacities``:
    ``simulator.capacity.Capacity``s, plotted on the attainment curves where given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from profiler.serve_record import Load

    directory.mkdir(parents=True, exist_ok=True)
    policies = list(dict.fromkeys(r.policy for r in results))
    kinds = [kind for kind in ("c", "rate") if any(r.load.startswith(kind + "=") for r in results)]
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 7), squeeze=False)
    for column, kind in enumerate(kinds):
        for i, policy in enumerate(policies):
            mine = sorted((Load.of_label(r.load).value, r) for r in results
                          if r.policy == policy and r.load.startswith(kind + "="))
            loads = [x for x, _ in mine]
            for row, (metric, what) in enumerate((("ttft", "TTFT"), ("itl", "ITL"))):
                ax = axes[row][column]
                for quantile, style in (("p50_s", "-"), ("p90_s", "--")):
                    ax.plot(loads, [getattr(getattr(r, metric), quantile) for _, r in mine], style, marker="o",
                            color=plt.cm.tab10(i % 10), label=policy if style == "-" else None)
                ax.set(xlabel="concurrency (closed loop)" if kind == "c" else "requests/s (open loop)",
                       ylabel=f"{what} (s)", title=f"{title}: {what}, p50 solid, p90 dashed")
                ax.legend(fontsize=7)
    paths = [_save(fig, directory / "latency_vs_load.png")]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, policy in enumerate(policies):
        pooled = pooled_shares(r.speculation for r in results if r.policy == policy)
        ax.plot([b for b, _ in pooled], [share for _, share in pooled], marker="o",
                color=plt.cm.tab10(i % 10), label=policy)
    ax.set(xlabel="running batch size (decode and verify works in the step)", ylabel="share of rounds with k > 0",
           ylim=(-0.02, 1.02), title=f"{title}: speculation against the batch size")
    ax.legend(fontsize=8)
    paths.append(_save(fig, directory / "speculation_vs_batch.png"))
    if capacities:
        paths.append(_attainment_plot(directory, results, title, capacities))
    return paths


def pooled_shares(parts) -> list[tuple[int, float]]:
    """(batch size, share of rounds speculating) over several loads' ``SpeculationAt``s
    (``simulator.load_result``), added up per batch size, smallest first."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for part in parts:
        for at in part:
            counts[at.batch_size][0] += at.num_rounds
            counts[at.batch_size][1] += at.num_speculating
    return [(b, s / n if n else 0.0) for b, (n, s) in sorted(counts.items())]


def _attainment_plot(directory: Path, results: list, title: str, capacities: list) -> Path:
    """Each policy's share of requests within the SLO against the rate, each goal as a line
    and each capacity marked on its goal's."""
    import matplotlib.pyplot as plt

    from simulator.capacity import attainment_points

    goals = list(dict.fromkeys(c.goal for c in capacities))
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for i, (policy, points) in enumerate(attainment_points(results).items()):
        colors[policy] = plt.cm.tab10(i % 10)
        ax.plot([r for r, _ in points], [a for _, a in points], marker="o", color=colors[policy], label=policy)
    for c in capacities:
        if c.rate_per_s is not None:
            ax.plot([c.rate_per_s], [c.goal], marker=">" if c.beyond_sweep else "x", markersize=9,
                    color=colors[c.policy])
    for goal in goals:
        ax.axhline(goal, color="grey", linestyle=":")
    ax.set(xlabel="requests/s (open loop)", ylabel="share of requests within the SLO", ylim=(-0.02, 1.02),
           title=f"{title}: capacity at {', '.join(f'{100 * goal:g}' for goal in goals)} % (x; >: at least)")
    ax.legend(fontsize=7)
    return _save(fig, directory / "attainment_vs_rate.png")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
