"""Where a replay's costs come from: a trace's ops table (its own, or a timing trace of the
same model shapes recorded on another machine, joined by shape) and the overhead fitted
from its measured runs. Imports no torch.

A timing trace may hold the ops table alone (a random-weight recording on a GPU, say);
then the overhead beyond the ops is not known and is taken as zero. With another
machine's timing, the adaptive policy decides with that machine's calibration (the timing
trace's, else timings fitted from its ops), as it would if it ran there, and the store
counts that machine's bytes per token.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from profiler.schema import META_DECISION_INPUTS, META_TIMING_TRACE, RunRow, TraceError, TraceMeta, table_to_rows
from profiler.trace_io import read_meta, read_table
from rakv.cost_model import PairTimings, fit_timings
from rakv.settings import DecisionInputs, Settings, inputs_from_json
from simulator.costs import OpCosts, Overhead, OverheadSample, fit_op_costs, fit_overhead, request_cost
from simulator.session import replay_runs
from simulator.trace import Trace, load_trace

# config fields that fix a model's shapes, and so its timing (the weights' values do not)
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "n_embd", "n_layer", "n_head", "n_inner")


@dataclass(frozen=True)
class Timing:
    source: str  # the timing trace's directory name
    costs: OpCosts
    overhead: Overhead
    own: bool  # the acceptance trace's own timing
    inputs: DecisionInputs | None  # the timing trace's, if it recorded them
    fitted: PairTimings | None  # the cost model's timings fitted to its ops

    def decision_inputs(self, trace: Trace, settings: Settings | None) -> DecisionInputs:
        """What the replay's engine decides with: ``settings`` (None: the trace's recorded
        ones) over the trace's facts, on this timing's machine (its calibration and bytes
        per token) when it is another's."""
        # the machine sets timings and sizes, the settings the engine and controller: either order
        return self._machine_inputs(trace, trace.decision_inputs(settings))

    def _machine_inputs(self, trace: Trace, inputs: DecisionInputs) -> DecisionInputs:
        if self.own:
            return inputs
        timings = self.inputs.timings if self.inputs is not None and self.inputs.timings is not None else self.fitted
        if timings is not None and inputs.timings is not None:  # keep the recorded acceptance priors
            timings = replace(timings, acceptance_prior=inputs.timings.acceptance_prior,
                              ngram_acceptance_prior=inputs.timings.ngram_acceptance_prior)
        if self.inputs is not None:
            inputs = replace(inputs, target_sizes=self.inputs.target_sizes, draft_sizes=self.inputs.draft_sizes)
        return replace(inputs, timings=timings or inputs.timings)


def shape_of(meta: TraceMeta) -> dict:
    config = meta.models.get("target_config") or {}
    return {"target": {k: config[k] for k in SHAPE_KEYS if k in config}, "draft_layers": meta.models.get("draft_layers")}


def check_same_shapes(timing_meta: TraceMeta, trace_meta: TraceMeta, timing_path: Path) -> None:
    ours, theirs = shape_of(trace_meta), shape_of(timing_meta)
    if ours != theirs:
        raise TraceError(f"{timing_path}: timing trace of other model shapes ({theirs['target']}, draft layers "
                         f"{theirs['draft_layers']}) than the trace's ({ours['target']}, draft layers "
                         f"{ours['draft_layers']})")


def overhead_samples(trace: Trace, costs: OpCosts) -> list[tuple[RunRow, OverheadSample]]:
    """(run, its sample) for every recorded run of the trace, priced with zero overhead; its
    measured times as at the costs' speed (``OpCosts.at_usual_speed``: of a run, what its
    forwards would take at one row each, and its store copies, are what a slow phase slowed)."""
    inputs = trace.require_inputs()
    streamed = costs.streamed()
    samples = []
    for policy in sorted({r.policy for r in trace.runs}):
        for run, replayed in replay_runs(trace, policy):
            num_prompt = len(trace.by_id[run.request_id].prompt_ids)
            cost = request_cost(replayed, num_prompt, costs, inputs)
            part = request_cost(replayed, num_prompt, streamed, inputs)  # what a slow phase slows
            samples.append((run, OverheadSample(cost, len(replayed.rounds), replayed.adaptive,
                                                costs.at_usual_speed(run.ttft_s, run.probe_s, part.ttft_s),
                                                costs.at_usual_speed(run.e2e_s, run.probe_s, part.e2e_s))))
    return samples


def timing_path(trace: Trace) -> Path:
    """Where a trace's costs come from when no ``--timing`` is given: its own ops, else the
    timing trace its metadata names (a sibling directory)."""
    if trace.ops:
        return trace.path
    named = trace.meta.config.get(META_TIMING_TRACE)
    if named is None:
        raise TraceError(f"{trace.path}: the trace holds no ops and names no timing trace; give one (--timing DIR)")
    path = trace.path.parent / named
    if not path.is_dir():
        raise TraceError(f"{trace.path}: its timing trace {named!r} is not beside it ({path})")
    return path


def load_timing(path: str | Path | None, trace: Trace | None) -> Timing:
    """The timing at ``path`` for replaying ``trace`` (``path`` may be the trace itself, or
    None: ``timing_path(trace)``; ``trace`` None: the timing alone, for its own sake)."""
    path = timing_path(trace) if path is None else Path(path)
    own = trace is not None and path.resolve() == Path(trace.path).resolve()
    meta = trace.meta if own else read_meta(path, "ops")
    if trace is not None and not own:
        check_same_shapes(meta, trace.meta, path)
    ops = table_to_rows("ops", read_table(path, "ops"))
    costs = fit_op_costs(ops)
    source = trace if own else _full_trace(path)
    overhead = Overhead()
    if source is not None and source.runs and source.settings_problem is None:
        overhead = fit_overhead([sample for _, sample in overhead_samples(source, costs)])
    inputs = None
    if META_DECISION_INPUTS in meta.config:
        inputs = inputs_from_json(meta.config[META_DECISION_INPUTS])[0]
    try:
        fitted = fit_timings(ops)
    except ValueError:
        fitted = None
    return Timing(path.name, costs, overhead, own, inputs, fitted)


def _full_trace(path: Path) -> Trace | None:
    """The timing trace with its requests and runs, or None when it holds only ops."""
    try:
        return load_trace(path)
    except TraceError:
        return None
