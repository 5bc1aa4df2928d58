"""``python -m simulator.paper``: the paper's comparison, regenerated on the shipped traces.

AR, KV-only, Joint-k4 and RAKV adaptive replayed on each trace (its requests in order,
its timing: its own ops or the timing trace it names) under today's engine settings, in
the paper's terms: RAKV's latency and throughput relative to
Joint-k4 and to KV-only. Latency is the mean service time of a request (no queueing, as
the paper measured requests one at a time); throughput is output tokens per second of
service. The paper reports RAKV at 64.0 % lower latency and 170.8 % higher throughput
than Joint-k4, and within 0.45 % of KV-only's latency. Imports no torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from profiler.schema import TraceError
from rakv.cli import run_cli
from simulator.costs import CostModelError
from simulator.replay import replay
from simulator.schedule import schedule
from simulator.session import SessionError
from simulator.timing import load_timing
from simulator.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
SHIPPED = ("smollm2-humaneval", "smollm2-sharegpt", "smollm2-chat", "smollm2-prose", "smollm2-general",
           "qwen-coder-humaneval-runs", "qwen-coder-humaneval", "qwen-coder-sharegpt")
POLICIES = ("ar", "kv-only", "joint-k4", "rakv")
PAPER = {"latency_vs_joint": -0.640, "throughput_vs_joint": 1.708, "latency_vs_kv_only": 0.0045}


def row(name: str) -> str:
    trace = load_trace(TRACES / name)
    timing = load_timing(None, trace)
    results = replay(trace, timing, list(POLICIES), schedule(trace))
    latency = {p: s.total_service_s / s.num_requests for p, (s, _) in results.items()}
    throughput = {p: sum(x.num_output_tokens for x in served) / s.total_service_s for p, (s, served) in results.items()}
    rakv = "rakv"
    cells = [f"{latency[p]:.2f}" for p in POLICIES] + [f"{throughput[p]:.2f}" for p in POLICIES]
    cells += [f"{100 * (latency[rakv] / latency['joint-k4'] - 1):+.1f}%",
              f"{100 * (throughput[rakv] / throughput['joint-k4'] - 1):+.1f}%",
              f"{100 * (latency[rakv] / latency['kv-only'] - 1):+.1f}%"]
    return f"| {name} ({len(trace.requests)} req., timing {timing.source}) | " + " | ".join(cells) + " |"


def run(args: argparse.Namespace) -> int:
    lines = ["settings: today's engine defaults", "",
             "| trace | latency (s): AR | KV-only | Joint-k4 | RAKV | throughput (tok/s): AR | KV-only | Joint-k4 "
             "| RAKV | RAKV latency vs Joint-k4 | RAKV throughput vs Joint-k4 | RAKV latency vs KV-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in SHIPPED:
        if not (TRACES / name).is_dir():
            print(f"skipping {name}: it is not in {TRACES}", file=sys.stderr)
            continue
        lines.append(row(name))
    lines.append(f"| paper (Joint-k4 and KV-only baselines) | | | | | | | | | {100 * PAPER['latency_vs_joint']:+.1f}% "
                 f"| {100 * PAPER['throughput_vs_joint']:+.1f}% | within {100 * PAPER['latency_vs_kv_only']:.2f}% |")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.paper", description=__doc__.split("\n\n")[0])
    return run_cli(run, p.parse_args(argv), (ValueError, TraceError, CostModelError, SessionError, OSError))


if __name__ == "__main__":
    sys.exit(main())
