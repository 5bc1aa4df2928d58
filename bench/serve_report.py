"""The reports of ``python -m bench.serve``: the table on stdout, the JSON file and the
latency-throughput plot. Imports matplotlib only to plot (Agg: no display needed)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from bench.serve_stats import Percentiles, RunSummary

PLOT_NAME = "latency_throughput.png"
COLUMNS = ("server", "load", "done", "failed", "max in flight", "req/s", "out tok/s",
           "TTFT p50/p90/p99 (ms)", "ITL p50/p90/p99 (ms)", "e2e p50/p90/p99 (s)", "goodput req/s (share)", "check")


def _triple(p: Percentiles, scale: float, digits: int) -> str:
    return "/".join("-" if math.isnan(v) else f"{v * scale:.{digits}f}" for v in (p.p50_s, p.p90_s, p.p99_s))


def _number(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def table_rows(summaries: list[RunSummary]) -> list[tuple[str, ...]]:
    """One row per server and load point, as printed."""
    rows = []
    for s in summaries:
        goodput = "-" if math.isnan(s.goodput_per_s) else f"{s.goodput_per_s:.2f} ({s.goodput_share:.0%})"
        rows.append((s.server, s.load_label, str(s.completed), str(s.failed), str(s.max_in_flight),
                     _number(s.requests_per_s, 2), _number(s.output_tok_per_s, 1), _triple(s.ttft, 1e3, 0),
                     _triple(s.itl, 1e3, 1), _triple(s.e2e, 1.0, 2), goodput,
                     s.check.describe() if s.check is not None else "-"))
    return rows


def print_table(summaries: list[RunSummary]) -> None:
    rows = [COLUMNS, *table_rows(summaries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")


def _plain(value):
    """JSON-safe: NaN as null, infinities as the strings "inf" / "-inf" (strict JSON has neither)."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return _plain(asdict(value))
    return value


def write_json(path: str | Path, result, config: dict) -> None:
    """``{"config", "servers", "runs": [{"summary", "requests"}], "check_reference": {server: requests}}``."""
    document = {"config": config, "servers": list(result.servers),
                "runs": [{"summary": run.summary, "requests": list(run.records)} for run in result.runs],
                "check_reference": {name: list(records) for name, records in result.references.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(document), indent=1) + "\n")


def write_plot(directory: str | Path, summaries: list[RunSummary]) -> Path:
    """``DIR/latency_throughput.png``: p50 TTFT (left) and p50 ITL (right) in ms against output
    tok/s, each server's load points joined in the order of load, each labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    servers = list(dict.fromkeys(s.server for s in summaries))
    for server in servers:
        points = sorted((s for s in summaries if s.server == server), key=lambda s: s.load)
        x = [s.output_tok_per_s for s in points]
        for ax, key in zip(axes, ("ttft", "itl")):
            y = [getattr(s, key).p50_s * 1e3 for s in points]
            (line,) = ax.plot(x, y, marker="o", label=server)
            for s, xi, yi in zip(points, x, y):
                if math.isfinite(xi) and math.isfinite(yi):
                    ax.annotate(s.load_label, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=line.get_color())
    for ax, title in zip(axes, ("p50 TTFT", "p50 inter-token latency")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = directory / PLOT_NAME
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
