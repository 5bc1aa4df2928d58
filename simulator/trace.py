"""A recorded trace, read for replay: requests with every drafter's run lengths and
signals, the decision inputs, the measured runs and the op timings. Imports no torch.

Prompt lookup's signal (the length of the n-gram it matched) is not stored: it is a
function of the tokens and the n-gram config, so it is recomputed here with the run
lengths, which must then equal the stored ones (a check that the trace's n-gram config
is the one its run lengths were recorded with).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import numpy as np

from profiler.schema import META_DECISION_INPUTS, OpRow, RequestRow, RunRow, TraceError, TraceMeta, table_to_rows
from profiler.trace_io import read_meta, read_table
from rakv.drafters import DRAFT_MODEL, NGRAM, NgramConfig, RunLengths, ngram_run_lengths
from rakv.settings import DecisionInputs, Settings, inputs_from_json


@dataclass(frozen=True)
class RecordedRequest:
    request_id: int
    group_id: str
    turn: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # the target's greedy output, at most max_new_tokens
    max_new_tokens: int  # the cap the output was recorded under: no replay may ask for more
    lengths: Mapping[str, RunLengths]  # per drafter: m_t, proposal length and signal at every t
    max_k: int  # run lengths are capped here: no round may draft more
    draft_top1_probs: tuple[float, ...]
    token_ids: np.ndarray  # [prompt + output] int64, the store's view of the request; never mutated


@dataclass(frozen=True)
class Trace:
    path: Path
    meta: TraceMeta
    inputs: DecisionInputs  # the recorded facts, with the recorded settings (else today's: ``settings_problem``)
    settings_problem: str | None  # why the recorded settings cannot be read (an older engine's), or None
    target_namespace: str  # the models' fingerprints: the store's namespaces
    draft_namespace: str | None
    requests: tuple[RecordedRequest, ...]  # in workload order
    runs: tuple[RunRow, ...]
    ops: tuple[OpRow, ...]
    by_id: Mapping[int, RecordedRequest]

    def require_inputs(self) -> DecisionInputs:
        """The facts and settings the recording decided with: what ``--as-recorded``
        replays; a one-line ``TraceError`` if its settings are an older engine's."""
        if self.settings_problem is not None:
            raise TraceError(f"{self.path}: its recorded settings cannot be replayed ({self.settings_problem}); "
                             f"replay it under today's settings (without --as-recorded), or re-record it: "
                             f"bash scripts/record_traces.sh {self.path.name}")
        return self.inputs

    def decision_inputs(self, settings: Settings | None) -> DecisionInputs:
        """The trace's facts under ``settings`` (None: the recorded ones, ``require_inputs``)."""
        return self.require_inputs() if settings is None else self.inputs.with_settings(settings)


def load_trace(path: str | Path) -> Trace:
    """Every table of a trace directory, checked; a one-line ``TraceError`` otherwise."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace directory")
    meta = read_meta(path, "requests")
    if META_DECISION_INPUTS not in meta.config:
        raise TraceError(f"{path}: the trace records no decision inputs (an older engine's); "
                         f"re-record it: bash scripts/record_traces.sh {path.name}")
    try:
        inputs, problem = inputs_from_json(meta.config[META_DECISION_INPUTS])
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{path}: its decision inputs cannot be read: {exc}") from None
    if problem is not None:
        warnings.warn(f"{path.name}: recorded by an older engine ({problem}); it replays under today's settings "
                      f"only; re-record it with bash scripts/record_traces.sh {path.name}", stacklevel=2)
    ngram = inputs.engine.ngram
    requests = tuple(_recorded(row, ngram, path) for row in table_to_rows("requests", read_table(path, "requests")))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return Trace(path=path, meta=meta, inputs=inputs, settings_problem=problem,
                 target_namespace=meta.models.get("target"), draft_namespace=meta.models.get("draft"),
                 requests=requests,
                 runs=tuple(table_to_rows("runs", read_table(path, "runs"))),
                 ops=tuple(table_to_rows("ops", read_table(path, "ops"))), by_id={r.request_id: r for r in requests})


def under_ngram(trace: Trace, ngram: NgramConfig) -> Trace:
    """``trace`` with prompt lookup's run lengths and signals for ``ngram`` (the trace's own
    when it was recorded with it): they are functions of the stored tokens."""
    if ngram == trace.inputs.engine.ngram:
        return trace
    requests = tuple(
        replace(r, lengths={**r.lengths, NGRAM: ngram_run_lengths(r.prompt_ids, r.output_ids, r.max_k, ngram)})
        if NGRAM in r.lengths else r for r in trace.requests)
    return replace(trace, requests=requests, by_id={r.request_id: r for r in requests})


def _recorded(row: RequestRow, ngram: NgramConfig, path: Path) -> RecordedRequest:
    lengths: dict[str, RunLengths] = {}
    max_k = min((d.max_k for d in row.run_lengths), default=0)
    for stored in row.run_lengths:
        if stored.drafter == NGRAM:
            lengths[NGRAM] = ngram_run_lengths(row.prompt_ids, row.output_ids, stored.max_k, ngram)
            if (tuple(lengths[NGRAM].runs), tuple(lengths[NGRAM].proposed)) != (stored.run_lengths,
                                                                                 stored.proposal_lengths):
                raise TraceError(f"{path}: request {row.request_id}'s prompt-lookup run lengths disagree with the "
                                 f"trace's n-gram config {ngram}")
        elif stored.drafter == DRAFT_MODEL:
            lengths[DRAFT_MODEL] = RunLengths(list(stored.run_lengths), list(stored.proposal_lengths),
                                              [0] * len(stored.run_lengths), row.draft_top1_probs or None)
    return RecordedRequest(
        request_id=row.request_id, group_id=row.group_id, turn=row.turn, arrival_s=row.arrival_s,
        prompt_ids=row.prompt_ids, output_ids=row.output_ids, max_new_tokens=row.max_new_tokens,
        lengths=lengths, max_k=max_k, draft_top1_probs=row.draft_top1_probs,
        token_ids=np.array(row.prompt_ids + row.output_ids, dtype=np.int64))
