"""The trace schema: the one place where table and column names are defined. Imports no torch.

Four Parquet tables (DESIGN.md section 3):

- ``requests``: one prompt, its target greedy output and, per drafter, the run length m_t
  and proposal length at every output position t (section 2): a round at t with draft
  length k accepts exactly min(k, m_t), so these replay acceptance exactly; and the draft
  model's probability of its own token at every t (teacher-forced), for stops on the
  draft's confidence.
- ``ops``: one timed operation of one model (``rakv.op_timing.OpRow``); ``repeat`` is the
  0-based index of the measurement among repeats of the same shape, so the key columns
  identify a row.
- ``runs``: one timed end-to-end request under one policy's action (r, drafter, k), with
  its token cap and every speculation round.
- ``decisions``: one controller decision: features seen, action chosen, cost predicted,
  end-to-end seconds measured (NaN when not measured).
- ``served``: one request served under load by the batching engine (``rakv.batch_engine``):
  its times from the load's start (arrival, admission, first token, finish), preemptions,
  decision, output and rounds; ``load`` names the load (``c=4``: four in flight; ``rate=0.5``:
  Poisson arrivals at 0.5 requests/s).
- ``steps``: one step of that engine: which requests ran, each one's kind (prefill chunk,
  decode, verify) and rows, its context before the step, its round's drafter and k, and the
  step's seconds (the draft's proposals, the target's forward, all of its works).

Beside the tables, ``policies/NAME/`` holds a copy of each learned policy a recording
served (``policy_copy_dir``), so that its replays decide with the files it ran after the
shipped policy is trained again; in a directory of traces, a link to the one copy they
share (``profiler.policy_copies``).

Every file carries in its Parquet key-value metadata ``rakv.schema_version`` (major.minor),
``rakv.table`` and the JSON objects ``rakv.hardware``, ``rakv.models``, ``rakv.config``
(``TraceMeta``); from 1.2, ``rakv.config`` holds under ``decision_inputs`` the
``rakv.settings.DecisionInputs`` the recording's engines decided with (its settings and
its facts), and a trace without ops may name its timing trace (``META_TIMING_TRACE``).
Readers accept any minor of their major that holds every required column: a newer
minor's extra columns are kept; a file that lacks one (an older engine's) is refused
with a one-line error that says how to re-record it. An optional column (nullable: a
measurement a recording may not take) that a file lacks reads as None.

``RequestRow``, ``OpRow``, ``RunRow``, ``DecisionRow``: frozen dataclasses whose fields are
the columns, in order; ``rows_to_table`` / ``table_to_rows`` convert. Sequences are stored
as tuples, so rows compare equal after a round trip.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from rakv.op_timing import OP_KEY_FIELDS, OpRow

# 1.1: runs gained start_per_round and drafter_per_round. 1.2: requests gained
# draft_top1_probs, runs max_new_tokens; the metadata holds the decision inputs
# (META_DECISION_INPUTS) and run lengths reach 32. 1.3: ops and runs gained the optional
# probe_s (the machine's speed beside each timing, ``profiler.run_noise.MachineSpeed``).
# 1.4: the served and steps tables (serving under load); ops gained the optional
# num_requests (batched forwards, op "batch"; 1 where a file lacks it). 1.5: steps gained
# the optional probe_s (the machine's speed beside the step's load).
SCHEMA_VERSION = "1.5"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])
META_SCHEMA_VERSION = "rakv.schema_version"
META_TABLE = "rakv.table"
META_HARDWARE = "rakv.hardware"
META_MODELS = "rakv.models"
META_CONFIG = "rakv.config"
POLICY_COPIES = "policies"  # a trace's sub-directory of the learned policies it served


class TraceError(ValueError):
    """A trace that cannot be written or read as asked; the message is one line."""


def _table_schema(*columns: tuple[str, pa.DataType], optional: tuple[tuple[str, pa.DataType], ...] = ()
                  ) -> pa.Schema:
    """Required columns, then ``optional`` ones (nullable; None where a file lacks them)."""
    return pa.schema([pa.field(name, dtype, nullable=False) for name, dtype in columns]
                     + [pa.field(name, dtype, nullable=True) for name, dtype in optional])


RUN_LENGTHS_TYPE = pa.list_(pa.struct([
    pa.field("drafter", pa.string(), nullable=False),
    pa.field("max_k", pa.int32(), nullable=False),
    pa.field("run_lengths", pa.list_(pa.int16()), nullable=False),
    pa.field("proposal_lengths", pa.list_(pa.int16()), nullable=False),
]))

# Seconds of the machine-speed probe beside a timing: the one just before an op; for a
# run, the mean of those just before and just after it; for a served step, those of its
# load (every step of a load holds the same). None: the recording did not probe.
PROBE_COLUMN = ("probe_s", pa.float64())

TABLES: dict[str, pa.Schema] = {
    "requests": _table_schema(
        ("request_id", pa.int64()),
        ("workload", pa.string()),
        ("group_id", pa.string()),  # conversation or prefix family
        ("turn", pa.int32()),
        ("arrival_s", pa.float64()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),  # the target's greedy output
        ("max_new_tokens", pa.int32()),
        ("run_lengths", RUN_LENGTHS_TYPE),  # one entry per drafter
        # the draft model's probability of its own greedy token at every output position,
        # teacher-forced on the true prefix; empty when the pair has no draft model
        ("draft_top1_probs", pa.list_(pa.float32())),
    ),
    "ops": _table_schema(
        ("model", pa.string()),  # target, draft, store, ngram
        ("op", pa.string()),  # prefill, decode, verify, clone, lookup, insert, propose
        ("num_new_tokens", pa.int32()),
        ("num_cached_tokens", pa.int32()),
        ("k", pa.int32()),
        ("num_bytes", pa.int64()),
        ("repeat", pa.int32()),
        ("seconds", pa.float64()),
        optional=(PROBE_COLUMN, ("num_requests", pa.int32())),
    ),
    "runs": _table_schema(
        ("request_id", pa.int64()),
        ("policy", pa.string()),  # the policy that ran it: a fixed one, or the adaptive one
        ("r", pa.int8()),
        ("drafter", pa.string()),
        ("k", pa.int8()),
        ("max_new_tokens", pa.int32()),  # the run's token cap (before the context limit)
        ("hit_tokens", pa.int32()),
        ("reused_tokens", pa.int32()),
        ("hit_kind", pa.string()),  # miss, partial, exact
        ("ttft_s", pa.float64()),
        ("e2e_s", pa.float64()),
        ("num_output_tokens", pa.int32()),
        ("num_rounds", pa.int32()),
        ("start_per_round", pa.list_(pa.int32())),  # output position t of the round's first draft token
        ("drafter_per_round", pa.list_(pa.string())),  # rakv may switch drafters between rounds
        ("accepted_per_round", pa.list_(pa.int16())),
        ("k_per_round", pa.list_(pa.int16())),
        ("proposed_per_round", pa.list_(pa.int16())),
        ("identical_to_ar", pa.bool_()),
        optional=(PROBE_COLUMN,),
    ),
    "decisions": _table_schema(
        ("request_id", pa.int64()),
        ("policy", pa.string()),
        ("num_prompt_tokens", pa.int32()),
        ("num_new_tokens", pa.int32()),
        ("target_hit_tokens", pa.int32()),
        ("draft_hit_tokens", pa.int32()),
        ("exact_repeat", pa.bool_()),
        ("acceptance_draft", pa.float64()),
        ("acceptance_ngram", pa.float64()),
        ("r", pa.int8()),
        ("drafter", pa.string()),
        ("k", pa.int8()),
        ("predicted_cost_s", pa.float64()),
        ("measured_e2e_s", pa.float64()),
    ),
    "served": _table_schema(
        ("load", pa.string()),  # c=N or rate=R
        ("policy", pa.string()),
        ("request_id", pa.int64()),  # the requests table's
        ("arrival_s", pa.float64()),  # seconds from the load's start
        ("admitted_s", pa.float64()),  # first admission: its store lookup and decision
        ("first_token_s", pa.float64()),
        ("finish_s", pa.float64()),
        ("num_preemptions", pa.int32()),
        ("r", pa.int8()),
        ("drafter", pa.string()),
        ("k", pa.int8()),
        ("hit_tokens", pa.int32()),
        ("reused_tokens", pa.int32()),
        ("output_ids", pa.list_(pa.int32())),
        ("identical_to_ar", pa.bool_()),  # equal to the requests table's greedy output
        ("start_per_round", pa.list_(pa.int32())),
        ("drafter_per_round", pa.list_(pa.string())),
        ("accepted_per_round", pa.list_(pa.int16())),
        ("k_per_round", pa.list_(pa.int16())),
        ("proposed_per_round", pa.list_(pa.int16())),
    ),
    "steps": _table_schema(
        ("load", pa.string()),
        ("policy", pa.string()),
        ("step", pa.int32()),  # 0-based, in order
        # seconds from the load's start: the boundary before the step at which the requests
        # that had arrived were submitted (recordings before 2026-12-06: just after them)
        ("start_s", pa.float64()),
        # the works: proposals, forward, rounds and finishes; not the scheduling and admissions
        # before them (the next step's start_s minus this one's is the whole step)
        ("seconds", pa.float64()),
        ("propose_s", pa.float64()),  # the draft model's batched forwards and prompt lookups
        ("forward_s", pa.float64()),  # the target's batched forward
        # one entry per request that ran, in the step's order
        ("request_ids", pa.list_(pa.int64())),
        ("kinds", pa.list_(pa.string())),  # prefill, decode, verify
        ("rows", pa.list_(pa.int32())),  # the rows it fed the target
        ("num_cached", pa.list_(pa.int32())),  # its target cache's positions before the step
        ("drafters", pa.list_(pa.string())),  # its round's drafter ("" where none)
        ("ks", pa.list_(pa.int16())),
        optional=(PROBE_COLUMN,),
    ),
}

# The metadata key of the ``rakv.settings.DecisionInputs`` (JSON) under ``config``, from 1.2.
META_DECISION_INPUTS = "decision_inputs"
# The key under ``config`` naming the timing trace (a sibling directory) of a trace recorded without ops.
META_TIMING_TRACE = "timing_trace"
# The key under ``config`` that says when a served request's ``first_token_s`` was timed:
# "delivery" (the end of the step that delivered it, as the server streams it) where the
# recording's engine timed it so; a recording without the key timed it when it was made
# (``profiler.serve_summary.delivered`` moves those to their delivery).
META_FIRST_TOKEN_AT = "first_token_at"

# Columns that identify a row: a recording resumed after a crash skips rows whose key exists.
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "requests": ("request_id",),
    "ops": OP_KEY_FIELDS,
    "runs": ("request_id", "policy"),
    "decisions": ("request_id", "policy"),
    "served": ("load", "policy", "request_id"),
    "steps": ("load", "policy", "step"),
}


def _freeze(row) -> None:
    """Store every list field of a frozen dataclass as a tuple (rows compare by value)."""
    for f in fields(row):
        value = getattr(row, f.name)
        if isinstance(value, list):
            object.__setattr__(row, f.name, tuple(value))


@dataclass(frozen=True)
class DrafterRunLengths:
    """One drafter's replay data for one request. Invariants: one entry per output position
    t, and 0 <= run_lengths[t] <= proposal_lengths[t] <= max_k (a draft model always
    proposes max_k; prompt lookup may propose fewer, or none)."""
    drafter: str
    max_k: int
    run_lengths: tuple[int, ...]
    proposal_lengths: tuple[int, ...]

    def __post_init__(self):
        _freeze(self)
        if len(self.run_lengths) != len(self.proposal_lengths):
            raise ValueError(f"drafter {self.drafter!r}: {len(self.run_lengths)} run lengths but "
                             f"{len(self.proposal_lengths)} proposal lengths")
        for t, (run, proposed) in enumerate(zip(self.run_lengths, self.proposal_lengths)):
            if not 0 <= run <= proposed <= self.max_k:
                raise ValueError(f"drafter {self.drafter!r} at t={t}: need 0 <= run length {run} "
                                 f"<= proposal length {proposed} <= max_k {self.max_k}")


@dataclass(frozen=True)
class RequestRow:
    """One prompt; ``run_lengths`` holds one ``DrafterRunLengths`` per drafter, each
    covering every position of ``output_ids`` (dicts with the same keys are accepted);
    ``draft_top1_probs`` one probability per output position, or none."""
    request_id: int
    workload: str
    group_id: str
    turn: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    max_new_tokens: int
    run_lengths: tuple[DrafterRunLengths, ...] = ()
    draft_top1_probs: tuple[float, ...] = ()

    def __post_init__(self):
        _freeze(self)
        runs = tuple(r if isinstance(r, DrafterRunLengths) else DrafterRunLengths(**r) for r in self.run_lengths)
        object.__setattr__(self, "run_lengths", runs)
        # as float32 reads back, so rows compare equal after a round trip
        object.__setattr__(self, "draft_top1_probs", tuple(float(p) for p in np.float32(self.draft_top1_probs)))
        if self.draft_top1_probs and len(self.draft_top1_probs) != len(self.output_ids):
            raise ValueError(f"request {self.request_id}: {len(self.draft_top1_probs)} draft probabilities for "
                             f"{len(self.output_ids)} output tokens")
        drafters = [r.drafter for r in runs]
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"request {self.request_id}: run lengths repeat a drafter: {drafters}")
        for r in runs:
            if len(r.run_lengths) != len(self.output_ids):
                raise ValueError(f"request {self.request_id}: drafter {r.drafter!r} has {len(r.run_lengths)} "
                                 f"run lengths for {len(self.output_ids)} output tokens")


@dataclass(frozen=True)
class RunRow:
    """One end-to-end request under the action (r, drafter, k). Rounds are speculation
    rounds (plain target steps are not): the per-round tuples have ``num_rounds`` entries,
    and round i accepted min(k_per_round[i], m_t) of its drafter at t = start_per_round[i]."""
    request_id: int
    policy: str
    r: int
    drafter: str
    k: int
    max_new_tokens: int
    hit_tokens: int
    reused_tokens: int
    hit_kind: str
    ttft_s: float
    e2e_s: float
    num_output_tokens: int
    num_rounds: int
    start_per_round: tuple[int, ...]
    drafter_per_round: tuple[str, ...]
    accepted_per_round: tuple[int, ...]
    k_per_round: tuple[int, ...]
    proposed_per_round: tuple[int, ...]
    identical_to_ar: bool
    probe_s: float | None = None  # PROBE_COLUMN

    def __post_init__(self):
        _freeze(self)
        lengths = {len(self.start_per_round), len(self.drafter_per_round), len(self.accepted_per_round),
                   len(self.k_per_round), len(self.proposed_per_round)}
        if lengths != {self.num_rounds}:
            raise ValueError(f"run of request {self.request_id}: per-round lists must have num_rounds="
                             f"{self.num_rounds} entries, got {sorted(lengths)}")


@dataclass(frozen=True)
class DecisionRow:
    """One controller decision: features seen, action chosen, cost predicted and measured."""
    request_id: int
    policy: str
    num_prompt_tokens: int
    num_new_tokens: int
    target_hit_tokens: int
    draft_hit_tokens: int
    exact_repeat: bool
    acceptance_draft: float
    acceptance_ngram: float
    r: int
    drafter: str
    k: int
    predicted_cost_s: float
    measured_e2e_s: float = float("nan")


@dataclass(frozen=True)
class ServedRow:
    """One request served under ``load`` by the batching engine; its per-round tuples as
    ``RunRow``'s. Times are seconds from the load's start."""
    load: str
    policy: str
    request_id: int
    arrival_s: float
    admitted_s: float
    first_token_s: float
    finish_s: float
    num_preemptions: int
    r: int
    drafter: str
    k: int
    hit_tokens: int
    reused_tokens: int
    output_ids: tuple[int, ...]
    identical_to_ar: bool
    start_per_round: tuple[int, ...]
    drafter_per_round: tuple[str, ...]
    accepted_per_round: tuple[int, ...]
    k_per_round: tuple[int, ...]
    proposed_per_round: tuple[int, ...]

    def __post_init__(self):
        _freeze(self)
        if not self.arrival_s <= self.admitted_s <= self.first_token_s <= self.finish_s:
            raise ValueError(f"served request {self.request_id}: times out of order: arrival {self.arrival_s}, "
                             f"admitted {self.admitted_s}, first token {self.first_token_s}, finish {self.finish_s}")


@dataclass(frozen=True)
class StepRow:
    """One batched step; the tuples have one entry per request that ran in it."""
    load: str
    policy: str
    step: int
    start_s: float
    seconds: float
    propose_s: float
    forward_s: float
    request_ids: tuple[int, ...]
    kinds: tuple[str, ...]
    rows: tuple[int, ...]
    num_cached: tuple[int, ...]
    drafters: tuple[str, ...]
    ks: tuple[int, ...]
    probe_s: float | None = None  # PROBE_COLUMN: the load's

    def __post_init__(self):
        _freeze(self)
        lengths = {len(self.request_ids), len(self.kinds), len(self.rows), len(self.num_cached),
                   len(self.drafters), len(self.ks)}
        if len(lengths) != 1:
            raise ValueError(f"step {self.step}: per-request lists of different lengths {sorted(lengths)}")


ROW_TYPES: dict[str, type] = {"requests": RequestRow, "ops": OpRow, "runs": RunRow, "decisions": DecisionRow,
                              "served": ServedRow, "steps": StepRow}
for _name, _row_type in ROW_TYPES.items():  # the row classes are the schema, spelled in Python
    assert [f.name for f in fields(_row_type)] == TABLES[_name].names, _name


def check_table_name(table: str) -> None:
    """Raise TraceError for a name that is not in TABLES."""
    if table not in TABLES:
        raise TraceError(f"unknown trace table {table!r}; the tables are {', '.join(TABLES)}")


def rows_to_table(table: str, rows: Sequence) -> pa.Table:
    """A ``pyarrow.Table`` with exactly ``TABLES[table]`` (no metadata) holding ``rows``."""
    check_table_name(table)
    schema, row_type = TABLES[table], ROW_TYPES[table]
    for row in rows:
        if not isinstance(row, row_type):
            raise TypeError(f"table {table!r} takes {row_type.__name__}, got {type(row).__name__}")
    arrays = []
    for f in schema:
        values = [getattr(row, f.name) for row in rows]
        if f.type == RUN_LENGTHS_TYPE:
            values = [[asdict(d) for d in v] for v in values]
        try:
            array = pa.array(values, type=f.type)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ValueError(f"table {table!r} column {f.name!r} ({f.type}): {exc}") from None
        if array.null_count and not f.nullable:
            raise ValueError(f"table {table!r} column {f.name!r}: {array.null_count} missing values")
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=schema)


def table_to_rows(table: str, data: pa.Table) -> list:
    """The rows of ``data`` as ``ROW_TYPES[table]``; columns a newer minor version added are
    dropped, optional ones ``data`` lacks take their field's default (None)."""
    check_table_name(table)
    row_type = ROW_TYPES[table]
    return [row_type(**row) for row in data.select([n for n in TABLES[table].names if n in data.column_names])
            .to_pylist()]


def check_schema_version(version: str | None) -> None:
    """Refuse a missing or malformed version, or another major version than ours."""
    if version is None:
        raise TraceError(f"not a RAKV trace file (no {META_SCHEMA_VERSION} metadata)")
    match = re.fullmatch(r"(\d+)\.(\d+)", version)
    if match is None:
        raise TraceError(f"unrecognised trace schema version {version!r} (expected major.minor)")
    if int(match.group(1)) != SCHEMA_MAJOR:
        raise TraceError(f"trace schema {version} is not readable by this version ({SCHEMA_MAJOR}.x); "
                         "re-record or upgrade")


def _text_metadata(metadata: Mapping | None) -> dict[str, str]:
    decode = lambda x: x.decode() if isinstance(x, bytes) else x  # noqa: E731
    return {decode(k): decode(v) for k, v in (metadata or {}).items()}


def _json_object(value: Mapping, what: str) -> dict:
    """``value`` as JSON would return it (tuples become lists), so stored and fresh compare equal."""
    try:
        normalised = json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"trace {what} must be JSON-serialisable: {exc}") from None
    if not isinstance(normalised, dict):
        raise TypeError(f"trace {what} must be a dict, got {type(value).__name__}")
    return normalised


@dataclass(frozen=True)
class TraceMeta:
    """What every trace file records about its run. The dicts are normalised to what JSON
    returns on reading (so ``from_metadata(m.to_metadata(t)) == m``)."""
    hardware: dict = field(default_factory=dict)  # see hardware_fingerprint()
    models: dict = field(default_factory=dict)  # names and fingerprints of the models used
    config: dict = field(default_factory=dict)  # the resolved configuration of the run

    def __post_init__(self):
        for name in ("hardware", "models", "config"):
            object.__setattr__(self, name, _json_object(getattr(self, name), name))

    def to_metadata(self, table: str) -> dict[bytes, bytes]:
        """Parquet key-value metadata for a file of ``table``."""
        check_table_name(table)
        text = {META_SCHEMA_VERSION: SCHEMA_VERSION, META_TABLE: table, META_HARDWARE: self.hardware,
                META_MODELS: self.models, META_CONFIG: self.config}
        return {k.encode(): (v if isinstance(v, str) else json.dumps(v, sort_keys=True)).encode()
                for k, v in text.items()}

    @classmethod
    def from_metadata(cls, metadata: Mapping | None) -> "TraceMeta":
        """Parse key-value metadata (bytes or str keys); checks the schema version."""
        text = _text_metadata(metadata)
        check_schema_version(text.get(META_SCHEMA_VERSION))
        parsed = {}
        for name, key in (("hardware", META_HARDWARE), ("models", META_MODELS), ("config", META_CONFIG)):
            if key not in text:
                raise TraceError(f"trace metadata lacks {key}")
            try:
                parsed[name] = json.loads(text[key])
            except ValueError:
                raise TraceError(f"trace metadata {key} is not valid JSON") from None
        return cls(**parsed)


def table_of(metadata: Mapping | None) -> str | None:
    """The ``rakv.table`` a file's key-value metadata names, or None."""
    return _text_metadata(metadata).get(META_TABLE)


def policy_copy_dir(trace_dir: str | os.PathLike, policy_name: str) -> Path:
    """Where a trace keeps its copy of the learned policy it served as ``policy_name``
    (``learned``, ``learned=PATH``: one directory per name, its odd characters made ``_``)."""
    return Path(trace_dir) / POLICY_COPIES / re.sub(r"[^A-Za-z0-9._-]", "_", policy_name)
