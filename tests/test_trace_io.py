"""The trace schema and its crash-safe writer and validating reader (CPU, no torch needed)."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from profiler.schema import (KEY_COLUMNS, SCHEMA_VERSION, TABLES, DecisionRow, DrafterRunLengths, OpRow, RequestRow,
                             RunRow, ServedRow, StepRow, TraceError, TraceMeta, rows_to_table, table_to_rows)
from profiler.hardware import hardware_fingerprint
from profiler.trace_io import TraceWriter, final_path, parts_dir, read_meta, read_table

REPO_ROOT = Path(__file__).resolve().parents[1]
META = TraceMeta(hardware={"cpu_model": "test cpu", "gpu_name": None},
                 models={"target": {"name": "tiny", "fingerprint": "abc"}},
                 config={"max_new_tokens": 8, "k_choices": (0, 1, 2), "store": {"budget_bytes": 1 << 20}})


def request_row(i: int) -> RequestRow:
    output = [i % 7, 3, 4, 5]
    return RequestRow(request_id=i, workload="chat", group_id=f"conv-{i // 3}", turn=i % 3, arrival_s=0.25 * i,
                      prompt_ids=[1, 2, 3, i], output_ids=output, max_new_tokens=4,
                      run_lengths=[DrafterRunLengths("draft", 8, [2, 0, 8, 1], [8, 8, 8, 8]),
                                   DrafterRunLengths("ngram", 8, [0, 1, 0, 0], [0, 3, 2, 0])])


def op_row(i: int) -> OpRow:
    return OpRow(model="target" if i % 2 else "draft", op="verify" if i % 3 else "batch", num_new_tokens=i % 9 + 1,
                 num_cached_tokens=16 * i, k=i % 9, num_bytes=(1 << 33) + i, repeat=i, seconds=1e-3 * (i + 1),
                 num_requests=1 if i % 3 else 8)


def run_row(i: int) -> RunRow:
    return RunRow(request_id=i, policy="ar", r=i % 2, drafter="ngram" if i % 3 == 0 else "draft", k=(0, 1, 2, 4, 6, 8)[i % 6],
                  max_new_tokens=32, hit_tokens=i, reused_tokens=max(i - 1, 0), hit_kind=("miss", "partial", "exact")[i % 3],
                  ttft_s=0.01 * i, e2e_s=0.1 + i, num_output_tokens=5, num_rounds=2,
                  start_per_round=[1, 3], drafter_per_round=["draft", "ngram"], accepted_per_round=[1, 0], k_per_round=[2, 2], proposed_per_round=[2, 1], identical_to_ar=True)


def decision_row(i: int) -> DecisionRow:
    return DecisionRow(request_id=i, policy="rakv", num_prompt_tokens=30 + i, num_new_tokens=8, target_hit_tokens=i,
                       draft_hit_tokens=i // 2, exact_repeat=i % 4 == 0, acceptance_draft=0.5, acceptance_ngram=0.125,
                       r=1, drafter="draft", k=4, predicted_cost_s=0.03 * i,
                       measured_e2e_s=float("nan") if i == 0 else 0.04 * i)


def served_row(i: int) -> ServedRow:
    return ServedRow(load=f"c={1 + i % 4}", policy="rakv", request_id=i, arrival_s=0.5 * i, admitted_s=0.5 * i + 0.01,
                     first_token_s=0.5 * i + 0.2, finish_s=1.0 + i, num_preemptions=i % 2, r=1, drafter="draft", k=4,
                     hit_tokens=i, reused_tokens=i, output_ids=[5, 6, 7], identical_to_ar=True, start_per_round=[1],
                     drafter_per_round=["draft"], accepted_per_round=[1], k_per_round=[4], proposed_per_round=[4])


def step_row(i: int) -> StepRow:
    return StepRow(load="rate=0.5", policy="ar", step=i, start_s=0.1 * i, seconds=0.09, propose_s=0.01, forward_s=0.07,
                   request_ids=[i, i + 1], kinds=["prefill", "verify"], rows=[64, 5], num_cached=[0, 130],
                   drafters=["", "draft"], ks=[0, 4], probe_s=None if i % 2 else 0.004)


MAKERS = {"requests": request_row, "ops": op_row, "runs": run_row, "decisions": decision_row, "served": served_row,
          "steps": step_row}


def same_rows(a: list, b: list) -> bool:
    """Equality that treats NaN as equal to NaN (an unmeasured cost)."""
    def key(row):
        return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row.__dict__.values())
    return [key(r) for r in a] == [key(r) for r in b]


def test_row_fields_are_the_columns_and_keys_exist():
    for name, schema in TABLES.items():
        row = MAKERS[name](1)
        assert list(row.__dataclass_fields__) == schema.names
        assert set(KEY_COLUMNS[name]) <= set(schema.names)
        assert rows_to_table(name, [row]).schema == schema


def test_every_table_round_trips_with_metadata(tmp_path):
    rows = {name: [make(i) for i in range(10)] for name, make in MAKERS.items()}
    with TraceWriter(tmp_path / "t", META, flush_every_rows=4) as writer:
        for name, table_rows in rows.items():
            for row in table_rows:
                writer.append(name, [row])
    for name in TABLES:
        data = read_table(tmp_path / "t", name)
        assert same_rows(table_to_rows(name, data), rows[name])
        kv = pq.read_metadata(final_path(tmp_path / "t", name)).metadata
        assert kv[b"rakv.schema_version"] == SCHEMA_VERSION.encode() and kv[b"rakv.table"] == name.encode()
        assert read_meta(final_path(tmp_path / "t", name)) == META
    assert read_meta(tmp_path / "t") == META
    assert META.config["k_choices"] == [0, 1, 2]  # normalised as JSON reads it back


def test_rows_reject_broken_invariants_and_values():
    with pytest.raises(ValueError, match="run length"):
        DrafterRunLengths("draft", 4, [5], [4])
    with pytest.raises(ValueError, match="output tokens"):
        RequestRow(0, "w", "g", 0, 0.0, [1], [1, 2], 2, [DrafterRunLengths("draft", 4, [1], [4])])
    with pytest.raises(ValueError, match="num_rounds"):
        RunRow(0, "ar", 0, "draft", 2, 8, 0, 0, "miss", 0.0, 0.0, 3, 2, [1, 3], ["draft"] * 2, [1], [2, 2], [2, 2], True)
    with pytest.raises(ValueError, match="column 'k'"):
        rows_to_table("runs", [RunRow(0, "ar", 0, "draft", 300, 8, 0, 0, "miss", 0.0, 0.0, 0, 0, [], [], [], [], [], True)])
    with pytest.raises(TypeError, match="RunRow"):
        rows_to_table("runs", [op_row(0)])


def test_flushed_parts_are_readable_before_finalize(tmp_path):
    writer = TraceWriter(tmp_path, META, flush_every_rows=2, flush_every_s=None)
    writer.append("runs", [run_row(i) for i in range(3)])  # 3 >= 2: one part of 3 rows
    writer.append("runs", [run_row(3)])  # pending
    assert [p.name for p in parts_dir(tmp_path, "runs").iterdir()] == ["part-000000.parquet"]
    assert read_table(tmp_path, "runs")["request_id"].to_pylist() == [0, 1, 2]
    writer.flush()
    assert read_table(tmp_path, "runs")["request_id"].to_pylist() == [0, 1, 2, 3]
    assert pq.ParquetFile(parts_dir(tmp_path, "runs") / "part-000001.parquet").num_row_groups == 1
    assert read_meta(tmp_path) == META and not final_path(tmp_path, "runs").exists()


def test_finalize_writes_one_file_per_table_and_removes_parts(tmp_path):
    writer = TraceWriter(tmp_path, META, flush_every_rows=2, flush_every_s=None)
    writer.append("ops", [op_row(i) for i in range(5)])
    writer.append("requests", [request_row(0)])
    writer.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)
    assert read_table(tmp_path, "ops").num_rows == 5 and read_table(tmp_path, "runs").num_rows == 0
    assert writer.existing_keys("ops", ("repeat",)) == {(i,) for i in range(5)}
    with pytest.raises(TraceError, match="finalized"):
        writer.append("ops", [op_row(9)])


def test_exception_in_context_keeps_parts_unfinalized(tmp_path):
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path, META, flush_every_rows=100) as writer:
            writer.append("runs", [run_row(0)])
            raise RuntimeError("boom")
    assert not final_path(tmp_path, "runs").exists()
    assert read_table(tmp_path, "runs")["request_id"].to_pylist() == [0]


def _finalized_runs(path: Path, n: int = 40) -> Path:
    with TraceWriter(path, META) as writer:
        writer.append("runs", [run_row(i) for i in range(n)])
    return final_path(path, "runs")


def test_truncated_file_is_rejected(tmp_path):
    path = _finalized_runs(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(TraceError, match=r"runs\.parquet: not a readable Parquet file \(truncated or corrupt\)"):
        read_table(tmp_path, "runs")


def test_corrupt_file_is_rejected(tmp_path):
    path = final_path(tmp_path, "runs")
    path.write_bytes(os.urandom(4096))
    with pytest.raises(TraceError, match="truncated or corrupt") as info:
        read_table(path, "runs")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def _rewrite_metadata(path: Path, **changes: str) -> None:
    data = pq.read_table(path)
    metadata = dict(data.schema.metadata)
    for key, value in changes.items():
        metadata[key.replace("_", ".", 1).encode()] = value.encode()
    pq.write_table(data.replace_schema_metadata(metadata), path)


def test_wrong_major_version_is_rejected(tmp_path):
    path = _finalized_runs(tmp_path)
    _rewrite_metadata(path, rakv_schema_version="2.0")
    with pytest.raises(TraceError, match=r"trace schema 2\.0 is not readable by this version \(1\.x\); "
                                         "re-record or upgrade"):
        read_table(tmp_path, "runs")
    with pytest.raises(TraceError, match="2.0"):
        read_meta(path)


def test_missing_version_wrong_table_and_missing_columns_are_rejected(tmp_path):
    path = _finalized_runs(tmp_path)
    with pytest.raises(TraceError, match="holds table 'runs', expected 'ops'"):
        read_table(path, "ops")
    data = pq.read_table(path)
    pq.write_table(data.drop_columns(["e2e_s", "k"]), path)
    with pytest.raises(TraceError, match="lacks columns k, e2e_s"):
        read_table(path, "runs")
    pq.write_table(data.replace_schema_metadata({b"rakv.table": b"runs"}), path)
    with pytest.raises(TraceError, match="no rakv.schema_version"):
        read_table(path, "runs")


def test_older_engine_trace_is_refused_with_how_to_re_record(tmp_path):
    """A file that lacks a column (an older engine's) is refused in one line that says how
    to re-record it: nothing is filled in."""
    with TraceWriter(tmp_path, META) as writer:
        writer.append("requests", [request_row(i) for i in range(3)])
    path = final_path(tmp_path, "requests")
    data = pq.read_table(path)
    pq.write_table(data.drop_columns(["draft_top1_probs"]).replace_schema_metadata(
        {**data.schema.metadata, b"rakv.schema_version": b"1.1"}), path)
    with pytest.raises(TraceError, match=r"\(schema 1\.1\) lacks columns draft_top1_probs: .*scripts/record_traces\.sh"):
        read_table(tmp_path, "requests")


def test_an_optional_column_a_file_lacks_reads_as_none(tmp_path):
    """The machine-speed probe (``probe_s``, 1.3) is a measurement a recording may not
    take: a 1.2 file without it reads, as None, and a null is stored as null."""
    path = _finalized_runs(tmp_path, n=3)
    data = pq.read_table(path)
    pq.write_table(data.drop_columns(["probe_s"]).replace_schema_metadata(
        {**data.schema.metadata, b"rakv.schema_version": b"1.2"}), path)
    assert [r.probe_s for r in table_to_rows("runs", read_table(tmp_path, "runs"))] == [None] * 3
    probed = [replace(run_row(i), probe_s=0.25) for i in range(2)] + [run_row(2)]
    with TraceWriter(tmp_path / "probed", META) as writer:
        writer.append("runs", probed)
    assert [r.probe_s for r in table_to_rows("runs", read_table(tmp_path / "probed", "runs"))] == [0.25, 0.25, None]
    with pytest.raises(ValueError, match="column 'e2e_s'.*missing values"):  # a required column takes no null
        rows_to_table("runs", [replace(run_row(0), e2e_s=None)])


def test_newer_minor_version_with_extra_columns_is_accepted(tmp_path):
    path = _finalized_runs(tmp_path, n=3)
    data = pq.read_table(path)
    newer = data.append_column("energy_j", pa.array([1.0, 2.0, 3.0]))
    pq.write_table(newer.replace_schema_metadata({**data.schema.metadata, b"rakv.schema_version": b"1.7"}), path)
    read = read_table(tmp_path, "runs")
    assert "energy_j" in read.column_names
    assert same_rows(table_to_rows("runs", read), [run_row(i) for i in range(3)])


def test_refuses_to_overwrite_without_resume(tmp_path):
    _finalized_runs(tmp_path, n=2)
    with pytest.raises(TraceError, match="not empty; pass --resume .* or choose another --out"):
        TraceWriter(tmp_path, META)


def test_resume_refuses_another_config_and_names_the_key(tmp_path):
    writer = TraceWriter(tmp_path, META, flush_every_rows=1)
    writer.append("runs", [run_row(0)])
    other = TraceMeta(META.hardware, META.models, {**META.config, "store": {"budget_bytes": 1}})
    with pytest.raises(TraceError, match=r"cannot resume, config\.store\.budget_bytes differs"):
        TraceWriter(tmp_path, other, resume=True)
    assert read_table(tmp_path, "runs").num_rows == 1  # nothing was touched


@pytest.mark.parametrize("finalized", [False, True])
def test_resume_skips_existing_keys_without_duplicates(tmp_path, finalized):
    writer = TraceWriter(tmp_path, META, flush_every_rows=3, flush_every_s=None)
    writer.append("runs", [run_row(i) for i in range(7)])  # one part of 7 rows
    writer.append("requests", [request_row(0)])  # pending, lost below unless finalized
    if finalized:
        writer.finalize()
    del writer  # an interrupted recording: no finalize, no flush
    resumed = TraceWriter(tmp_path, META, resume=True, flush_every_rows=3, flush_every_s=None)
    done = resumed.existing_keys("runs")
    assert done == {(r.request_id, r.policy) for r in map(run_row, range(7))}
    assert resumed.existing_keys("requests") == ({(0,)} if finalized else set())
    for i in range(12):
        row = run_row(i)
        if (row.request_id, row.policy) not in done:
            resumed.append("runs", [row])
    resumed.finalize()
    assert read_table(tmp_path, "runs")["request_id"].to_pylist() == list(range(12))
    assert not parts_dir(tmp_path, "runs").exists()


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from profiler.trace_io import TraceWriter
    from tests.test_trace_io import META, run_row
    writer = TraceWriter(sys.argv[1], META, resume=True, flush_every_rows=3, flush_every_s=None, fsync=False)
    done = writer.existing_keys("runs", ("request_id",))
    for i in range(int(sys.argv[2])):
        if (i,) in done:
            continue
        writer.append("runs", [run_row(i)])
        if writer.pending_rows("runs") == 0:
            print("flushed", i + 1, flush=True)
        time.sleep(0.01)
    writer.finalize()
    print("finalized", flush=True)
""")


def test_sigkilled_writer_leaves_readable_parts_and_resume_completes(tmp_path):
    trace, total = tmp_path / "trace", 30
    cmd = [sys.executable, "-c", KILLED_WRITER, str(trace), str(total)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env=env)
    flushed = [int(proc.stdout.readline().split()[1]) for _ in range(4)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and flushed == [3, 6, 9, 12]
    ids = read_table(trace, "runs")["request_id"].to_pylist()
    assert ids == list(range(len(ids))) and 12 <= len(ids) < total  # every flushed row, in order
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "finalized" in done.stdout, done.stderr
    assert read_table(trace, "runs")["request_id"].to_pylist() == list(range(total))
    assert sorted(p.name for p in trace.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)


def test_modules_and_hardware_fingerprint_do_not_import_torch():
    code = ("import sys, json; import profiler.schema, profiler.trace_io, profiler.hardware; "
            "hw = profiler.hardware.hardware_fingerprint(probe_gpu=False); json.dumps(hw); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch')); "
            "assert hw['python'] and hw['cpu_model']")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_hardware_fingerprint_is_json_metadata():
    hw = hardware_fingerprint()
    assert {"cpu_model", "gpu_name", "python", "torch", "transformers"} <= set(hw)
    assert TraceMeta.from_metadata(TraceMeta(hw, {}, {}).to_metadata("ops")).hardware == hw


def test_temp_files_are_ignored_and_a_half_finished_finalize_is_recovered(tmp_path):
    writer = TraceWriter(tmp_path, META, flush_every_rows=2, flush_every_s=None)
    writer.append("runs", [run_row(i) for i in range(4)])
    parts = parts_dir(tmp_path, "runs")
    (parts / ".part-000001.parquet.tmp").write_bytes(b"PAR1 half written")  # a write cut by SIGKILL
    assert read_table(tmp_path, "runs").num_rows == 4
    stale = tmp_path / "stale"
    os.rename(parts, stale)
    os.mkdir(parts)
    os.link(stale / "part-000000.parquet", parts / "part-000000.parquet")
    writer.finalize()
    os.rename(stale, parts)  # as if killed between os.replace of the final file and removing the parts
    assert read_table(tmp_path, "runs").num_rows == 4  # the final file wins
    resumed = TraceWriter(tmp_path, META, resume=True)
    assert [p.name for p in parts.iterdir()] == ["part-000000.parquet"]
    resumed.append("runs", [run_row(4)])
    resumed.finalize()
    assert read_table(tmp_path, "runs")["request_id"].to_pylist() == [0, 1, 2, 3, 4]
