"""The statistics of ``python -m bench.serve``: what one streamed request measured, and a
run's latency percentiles, throughput and goodput. Pure functions over numbers: no
network, no clock, no torch.

Definitions (every time in seconds, from the moment the request was sent):

- TTFT: to the first streamed chunk that carries text.
- Inter-token latency (ITL): each later text chunk's gap after the previous text chunk,
  divided among the tokens the chunk carries (a speculative server streams several at
  once: a chunk of 3 tokens after 30 ms counts as three 10 ms latencies). The first
  chunk's extra tokens arrived with it: they add no ITL.
- e2e: to the end of the stream.
- Percentiles: numpy's linear interpolation between order statistics (as ``vllm bench
  serve``); the ITL percentiles pool every token of every request of the run.
- Output tok/s and request/s: output tokens (requests completed) over the run's wall time,
  from its first send to its last finish.
- Goodput under an SLO: requests that completed and met every stated bound, per second of
  wall time; the request's ITL for the bound is its mean (vLLM's TPOT), so one slow chunk
  in a long answer does not fail it. Its share is over every request sent, failed ones
  included. (``Percentiles``, ``Slo`` and ``parse_slo`` are ``profiler.serve_summary``'s,
  shared with the simulator's loads.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# defined once for measured, simulated and benchmarked loads; bench's callers import them here
from profiler.serve_summary import SLO_KEYS, Percentiles, Slo, parse_slo, percentiles  # noqa: F401


@dataclass(frozen=True)
class RequestRecord:
    """One request of a run as the client saw it. ``sent_s`` is from the run's start;
    ``token_ids`` is the output's ids where the server streamed them (else None);
    ``tokens_from`` says where ``output_tokens`` came from (``usage``, ``token_ids`` or
    ``chunks``: one per text chunk); ``error`` is set (one line) when the request failed."""

    index: int  # the prompt's position in the workload
    sent_s: float
    ttft_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...]
    output_tokens: int
    tokens_from: str
    text: str
    token_ids: tuple[int, ...] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None


def failed_record(index: int, sent_s: float, error: str) -> RequestRecord:
    return RequestRecord(index, sent_s, None, None, (), 0, "chunks", "", None, error)


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Whether a completed request met every stated bound (a failed one never does)."""
    return record.ok and slo.met(record.ttft_s, record.mean_itl_s, record.e2e_s)


def split_tokens(chunk_chars: list[int], total_tokens: int) -> list[int]:
    """``total_tokens`` spread over chunks in proportion to their characters (largest
    remainder, every chunk at least one token while there are enough): the guess for a
    server that reports the count (usage) but not each chunk's tokens. Characters per
    token vary far less than tokens per chunk under speculation."""
    count = len(chunk_chars)
    if count == 0:
        return []
    if total_tokens <= count:  # fewer tokens than chunks: a usage that disagrees; one per chunk
        return [1] * count
    weights = np.maximum(np.asarray(chunk_chars, dtype=float), 1e-9)
    spare = total_tokens - count  # one each first, then the rest by characters
    shares = spare * weights / weights.sum()
    base = np.floor(shares).astype(int)
    left = spare - int(base.sum())
    order = np.argsort(-(shares - base), kind="stable")[:left]
    base[order] += 1
    return (base + 1).tolist()


def inter_token_latencies(chunk_times_s: list[float], chunk_tokens: list[int]) -> tuple[float, ...]:
    """Per-token latencies from the arrival times of the text chunks and their token counts:
    chunk i > 0 gives ``chunk_tokens[i]`` latencies of ``gap / chunk_tokens[i]``."""
    itl: list[float] = []
    for i in range(1, len(chunk_times_s)):
        tokens = max(chunk_tokens[i], 1)
        itl += [(chunk_times_s[i] - chunk_times_s[i - 1]) / tokens] * tokens
    return tuple(itl)


@dataclass(frozen=True)
class ExactnessCheck:
    """How many of a loaded run's outputs differ from the same server's concurrency-1
    output of the same prompt, over the requests that completed in both."""

    differ: int
    compared: int
    by_token_ids: int  # of ``compared``: compared by token ids (both streamed them), the rest by text

    def describe(self) -> str:
        return f"{self.differ} of {self.compared} differ"


def count_differences(records: tuple[RequestRecord, ...], reference: tuple[RequestRecord, ...]) -> ExactnessCheck:
    ref = {r.index: r for r in reference if r.ok}
    differ = compared = by_ids = 0
    for record in records:
        other = ref.get(record.index)
        if not record.ok or other is None:
            continue
        compared += 1
        if record.token_ids is not None and other.token_ids is not None:
            by_ids += 1
            differ += record.token_ids != other.token_ids
        else:
            differ += record.text != other.text
    return ExactnessCheck(differ, compared, by_ids)


@dataclass(frozen=True)
class RunSummary:
    """One server at one load point. ``mode`` is ``rate`` (Poisson arrivals at ``load``
    requests/s; inf: all at once) or ``concurrency`` (``load`` requests kept in flight)."""

    server: str
    mode: str
    load: float
    num_requests: int
    completed: int
    failed: int
    wall_s: float
    output_tokens: int
    output_tok_per_s: float
    requests_per_s: float
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    slo: str
    goodput_per_s: float
    goodput_share: float
    max_in_flight: int
    check: ExactnessCheck | None = None

    @property
    def load_label(self) -> str:
        if self.mode == "concurrency":
            return f"c={self.load:g}"
        return "rate=inf" if math.isinf(self.load) else f"rate={self.load:g}/s"


def wall_s(records: tuple[RequestRecord, ...]) -> float:
    """From the first send to the last finish (a failed request's send counts; its finish
    is unknown and ignored)."""
    if not records:
        return 0.0
    first = min(r.sent_s for r in records)
    last = max((r.sent_s + r.e2e_s for r in records if r.ok), default=first)
    return last - first


def summarize(records: tuple[RequestRecord, ...], server: str, mode: str, load: float, slo: Slo,
              max_in_flight: int) -> RunSummary:
    done = [r for r in records if r.ok]
    wall = wall_s(records)
    tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo) for r in records)

    def per_s(count: float) -> float:
        return count / wall if wall > 0 else math.nan

    return RunSummary(server=server, mode=mode, load=load, num_requests=len(records), completed=len(done),
                      failed=len(records) - len(done), wall_s=wall, output_tokens=tokens,
                      output_tok_per_s=per_s(tokens), requests_per_s=per_s(len(done)),
                      ttft=percentiles(r.ttft_s for r in done if r.ttft_s is not None),
                      itl=percentiles(t for r in done for t in r.itl_s), e2e=percentiles(r.e2e_s for r in done),
                      slo=slo.describe(), goodput_per_s=per_s(good),
                      goodput_share=good / len(records) if records else math.nan, max_in_flight=max_in_flight)
