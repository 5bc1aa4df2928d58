"""What ``rakv.serve`` reports at ``GET /metrics``, in Prometheus' text format (0.0.4).

Two kinds of figures:
- the engine's (``BatchEngine.stats``, snapshotted by the engine thread after each step):
  running and waiting requests, KV and store bytes, preemptions, prefix hits and
  speculation over the finished requests;
- the server's own, measured as it hands tokens to the HTTP handlers: time to first token
  (from the request's arrival at the handler) and inter-token latency. A step that gives
  a request k tokens at once (a speculation round) counts as k latencies of gap / k, as
  ``bench.serve_stats.inter_token_latencies`` counts a chunk of k tokens, so the two agree.

Invariant: a histogram's bucket counts are cumulative (``le`` = at most the bound) and the
``+Inf`` bucket equals ``_count``.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

TTFT_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PREFIX = "rakv"


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # observations at most each bound, then the +Inf bucket
    count: int
    sum: float


class Histogram:
    """Observations by bucket; not locked (``ServeMetrics`` locks)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is above every bound
        self._sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self._counts[index] += times
        self._sum += value * times

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for count in self._counts:
            total += count
            cumulative.append(total)
        return HistogramSnapshot(self.bounds, tuple(cumulative), total, self._sum)


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything ``/metrics`` shows, read at one moment."""

    stats: object | None  # rakv.batch_engine.EngineStats; None before the first snapshot
    ttft_s: HistogramSnapshot
    itl_s: HistogramSnapshot
    requests_aborted: int  # clients that went away (or hit a stop string) before the finish
    requests_failed: int  # failed by an engine error (a 500)


class ServeMetrics:
    """The server's figures. The engine thread writes, the HTTP handlers read a snapshot."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ttft = Histogram(TTFT_BOUNDS_S)
        self._itl = Histogram(ITL_BOUNDS_S)
        self._stats = None
        self._aborted = 0
        self._failed = 0

    def first_token(self, ttft_s: float) -> None:
        with self._lock:
            self._ttft.observe(ttft_s)

    def later_tokens(self, gap_s: float, num_tokens: int) -> None:
        with self._lock:
            self._itl.observe(gap_s / num_tokens, num_tokens)

    def engine_stats(self, stats) -> None:
        with self._lock:
            self._stats = stats

    def aborted(self) -> None:
        with self._lock:
            self._aborted += 1

    def failed(self, num_requests: int) -> None:
        with self._lock:
            self._failed += num_requests

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(self._stats, self._ttft.snapshot(), self._itl.snapshot(), self._aborted,
                                   self._failed)


def render(snapshot: MetricsSnapshot) -> str:
    """The Prometheus text exposition of ``snapshot``."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}",
                      f"{PREFIX}_{name} {_number(value)}"])

    s = snapshot.stats
    if s is not None:
        metric("num_requests_running", "gauge", "Requests in the running batch.", s.num_running)
        metric("num_requests_waiting", "gauge", "Requests waiting to be admitted.", s.num_waiting)
        metric("num_requests_waiting_late", "gauge",
               "Requests waiting past the TTFT target (--ttft-target): they run when none in time does.",
               s.num_waiting_late)
        metric("requests_late_total", "counter", "Requests admitted past the TTFT target.", s.num_late)
        metric("kv_cache_bytes", "gauge", "KV bytes the running requests' caches hold.", s.kv_bytes)
        metric("prefix_store_bytes", "gauge", "Bytes held by the prefix store.", s.store_bytes)
        metric("num_preemptions_total", "counter", "Requests preempted (their KV recomputed later).",
               s.num_preemptions)
        metric("requests_finished_total", "counter", "Requests the engine finished.", s.num_requests_finished)
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", s.prompt_tokens)
        metric("prefix_hit_tokens_total", "counter", "Prompt tokens reused from the prefix store.",
               s.prefix_hit_tokens)
        metric("prefix_hit_rate", "gauge", "Prefix-hit tokens over prompt tokens, finished requests.",
               s.prefix_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0)
        metric("spec_rounds_total", "counter", "Speculation rounds of finished requests.", s.rounds)
        metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted, finished requests.",
               s.accepted_tokens)
        metric("spec_accepted_tokens_per_round", "gauge", "Draft tokens accepted per speculation round.",
               s.accepted_tokens / s.rounds if s.rounds else 0.0)
    metric("requests_aborted_total", "counter", "Requests dropped before their finish (client gone, stop string).",
           snapshot.requests_aborted)
    metric("requests_failed_total", "counter", "Requests failed by an engine error.", snapshot.requests_failed)
    _histogram(lines, "time_to_first_token_seconds", "From the request's arrival to its first token.",
               snapshot.ttft_s)
    _histogram(lines, "inter_token_latency_seconds", "Between a request's tokens (a step's k tokens: k of gap/k).",
               snapshot.itl_s)
    return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_text: str, h: HistogramSnapshot) -> None:
    full = f"{PREFIX}_{name}"
    lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} histogram"])
    for bound, count in zip(h.bounds + (math.inf,), h.cumulative):
        lines.append(f'{full}_bucket{{le="{_number(bound)}"}} {count}')
    lines.extend([f"{full}_sum {_number(h.sum)}", f"{full}_count {h.count}"])


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))
