"""Crash-safe writing and validated reading of traces. Imports no torch.

Layout of a trace directory::

    <trace_dir>/<table>.parquet                      finalized: one file per table
    <trace_dir>/<table>.parts/part-000000.parquet    in progress: one file per flush

A Parquet file is unreadable until its footer is written, so while a recording runs each
flush writes one part (one row group) to a hidden temp name in the parts directory,
fsyncs it and renames it into place. Invariants:

- a ``part-*.parquet`` file is always complete; a SIGKILL loses only the rows appended
  since the last flush (and leaves at most one hidden ``.part-*.tmp`` file, which a
  resume deletes);
- ``<table>.parquet`` appears atomically (temp file, then ``os.replace``) and holds every
  part; the parts directory is removed only after it. If both exist (a crash between the
  two steps) the final file is the complete one and the parts are stale;
- every file, part or final, carries the run's full metadata (``TraceMeta``).

Resume (``TraceWriter(..., resume=True)``): existing parts are kept, and a finalized
table is reopened by moving its final file to ``part-000000.parquet`` (after dropping
stale parts), so a later finalize merges old and new rows alike. The stored metadata
must equal the new run's (config, models and hardware); otherwise the writer refuses and
names the first differing key. ``existing_keys`` tells the caller which rows are already
recorded; the writer does not deduplicate by itself.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from profiler.schema import (KEY_COLUMNS, META_SCHEMA_VERSION, TABLES, TraceError, TraceMeta,
                             check_table_name, rows_to_table, table_of)

__all__ = ["TraceError", "TraceWriter", "read_table", "read_meta", "final_path", "parts_dir"]

COMPRESSION = "zstd"
_PART_RE = re.compile(r"part-(\d+)\.parquet")
_READ_ERRORS = (pa.ArrowException, OSError, ValueError, EOFError)


def final_path(trace_dir: str | os.PathLike, table: str) -> Path:
    return Path(trace_dir) / f"{table}.parquet"


def parts_dir(trace_dir: str | os.PathLike, table: str) -> Path:
    return Path(trace_dir) / f"{table}.parts"


def _part_files(directory: Path) -> list[Path]:
    """Complete parts in write order (temp files are hidden and never match)."""
    if not directory.is_dir():
        return []
    numbered = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _PART_RE.fullmatch(p.name))]
    return [p for _, p in sorted(numbered)]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(data: pa.Table, path: Path, fsync: bool) -> None:
    """Write ``data`` as one Parquet file at ``path``, which never exists half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(data, f, compression=COMPRESSION)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def _open_file(path: Path, table: str | None) -> tuple[pq.ParquetFile, str]:
    """Open a trace file, check its version, its columns and, if given, its table; returns
    (file, table)."""
    try:
        parquet = pq.ParquetFile(path)
        metadata = parquet.schema_arrow.metadata
    except _READ_ERRORS as exc:
        raise TraceError(f"{path}: not a readable Parquet file (truncated or corrupt): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    try:
        TraceMeta.from_metadata(metadata)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    stored = table_of(metadata)
    if stored not in TABLES:
        raise TraceError(f"{path}: names no known trace table (rakv.table={stored!r})")
    if table is not None and stored != table:
        raise TraceError(f"{path}: holds table {stored!r}, expected {table!r}")
    schema = parquet.schema_arrow
    missing = [f.name for f in TABLES[stored] if f.name not in schema.names and not f.nullable]
    if missing:
        version = metadata.get(META_SCHEMA_VERSION.encode(), b"?").decode()
        raise TraceError(f"{path}: table {stored!r} (schema {version}) lacks columns {', '.join(missing)}: "
                         f"recorded by an older engine; re-record it (bash scripts/record_traces.sh)")
    for f in (f for f in TABLES[stored] if f.name in schema.names):
        stored_type = schema.field(f.name).type
        if stored_type != f.type:
            raise TraceError(f"{path}: column {f.name!r} has type {stored_type}, expected {f.type}")
    return parquet, stored


def _read_file(path: Path, table: str | None, columns: list[str] | None = None) -> pa.Table:
    parquet, _ = _open_file(path, table)
    try:
        return parquet.read(columns=columns)
    except _READ_ERRORS as exc:
        raise TraceError(f"{path}: corrupt Parquet data: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None


def _table_files(path: Path, table: str) -> list[Path]:
    """The files that hold ``table`` under a trace directory: the final file, else the parts."""
    if path.name == f"{table}.parts":
        return _part_files(path)
    final = final_path(path, table)
    if final.is_file():
        return [final]
    parts = parts_dir(path, table)
    if parts.is_dir():
        return _part_files(parts)
    raise TraceError(f"{path}: no {table!r} table (neither {final.name} nor {parts.name}/)")


def _concat(tables: list[pa.Table], table: str) -> pa.Table:
    if not tables:
        return TABLES[table].empty_table()
    metadata = tables[0].schema.metadata
    merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables], promote_options="default")
    return merged.replace_schema_metadata(metadata)


def read_table(trace: str | os.PathLike, table: str, columns: list[str] | None = None) -> pa.Table:
    """The rows of ``table`` from a trace directory (its final file or, for an interrupted
    recording, all its complete parts in write order) or from one file. Every file is
    validated; any problem is a one-line ``TraceError`` naming the file. Columns a newer
    minor version added are kept; the schema metadata is that of the first file."""
    check_table_name(table)
    path = Path(trace)
    if path.is_file():
        return _read_file(path, table, columns)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file or directory")
    return _concat([_read_file(p, table, columns) for p in _table_files(path, table)], table)


def read_meta(trace: str | os.PathLike, table: str | None = None) -> TraceMeta:
    """The metadata of a trace file, or of a trace directory (from ``table``'s first file,
    or from the first table present when ``table`` is None)."""
    path = Path(trace)
    if path.is_file():
        parquet = _open_file(path, table)[0]
        return TraceMeta.from_metadata(parquet.schema_arrow.metadata)
    for name in ([table] if table is not None else list(TABLES)):
        check_table_name(name)
        if final_path(path, name).exists() or parts_dir(path, name).exists():
            files = _table_files(path, name)
            if files:
                return TraceMeta.from_metadata(_open_file(files[0], name)[0].schema_arrow.metadata)
    raise TraceError(f"{path}: no trace files")


def _first_difference(stored, new, prefix: str) -> str | None:
    """The dotted key of the first difference between two JSON values, or None."""
    if isinstance(stored, dict) and isinstance(new, dict):
        for key in sorted(set(stored) | set(new)):
            if key not in stored or key not in new:
                return f"{prefix}.{key}"
            found = _first_difference(stored[key], new[key], f"{prefix}.{key}")
            if found:
                return found
        return None
    return None if stored == new else prefix


class TraceWriter:
    """Buffers rows per table and writes them as parts; ``finalize`` merges the parts.

    ``append`` flushes a table once it holds ``flush_every_rows`` pending rows, or once
    ``flush_every_s`` seconds have passed since its last flush (None: no time limit).
    As a context manager it finalizes on a clean exit; on an exception it flushes what it
    has and leaves the parts in place for ``resume=True``.
    """

    def __init__(self, trace_dir: str | os.PathLike, meta: TraceMeta, *, resume: bool = False,
                 flush_every_rows: int = 64, flush_every_s: float | None = 30.0, fsync: bool = True):
        if flush_every_rows < 1:
            raise ValueError(f"flush_every_rows must be >= 1, got {flush_every_rows}")
        self.trace_dir = Path(trace_dir)
        self.meta = meta
        self.flush_every_rows = flush_every_rows
        self.flush_every_s = flush_every_s
        self.fsync = fsync
        self._pending: dict[str, list] = {name: [] for name in TABLES}
        self._last_flush_s = {name: time.monotonic() for name in TABLES}
        self._next_part = {name: 0 for name in TABLES}
        self._finalized = False
        if self.trace_dir.exists() and not self.trace_dir.is_dir():
            raise TraceError(f"{self.trace_dir}: exists and is not a directory")
        if self.trace_dir.is_dir() and any(self.trace_dir.iterdir()):
            if not resume:
                raise TraceError(f"{self.trace_dir}: trace directory is not empty; pass --resume to continue "
                                 "that recording or choose another --out")
            self._reopen()
        self.trace_dir.mkdir(parents=True, exist_ok=True)

    def _reopen(self) -> None:
        """Check the stored metadata, drop temp files, turn final files back into parts."""
        for name in TABLES:  # check everything before changing anything
            if final_path(self.trace_dir, name).exists() or parts_dir(self.trace_dir, name).exists():
                files = _table_files(self.trace_dir, name)
                if files:
                    self._check_meta(files[0], name)
        for name in TABLES:
            final, parts = final_path(self.trace_dir, name), parts_dir(self.trace_dir, name)
            for tmp in self.trace_dir.glob(f".{name}.parquet.tmp"):
                tmp.unlink()
            if final.exists():
                if parts.exists():
                    shutil.rmtree(parts)  # stale: the final file already holds these parts
                parts.mkdir()
                os.replace(final, parts / "part-000000.parquet")
            if parts.is_dir():
                for tmp in parts.glob(".part-*.tmp"):
                    tmp.unlink()
                existing = _part_files(parts)
                self._next_part[name] = int(_PART_RE.fullmatch(existing[-1].name).group(1)) + 1 if existing else 0

    def _check_meta(self, path: Path, table: str) -> None:
        stored = TraceMeta.from_metadata(_open_file(path, table)[0].schema_arrow.metadata)
        for name in ("config", "models", "hardware"):
            key = _first_difference(getattr(stored, name), getattr(self.meta, name), name)
            if key is not None:
                raise TraceError(f"{self.trace_dir}: cannot resume, {key} differs from the stored recording's "
                                 "(resume with the same settings on the same machine, or choose another --out)")

    def append(self, table: str, rows: Iterable) -> None:
        """Queue ``rows`` (of ``ROW_TYPES[table]``); may flush ``table``."""
        if self._finalized:
            raise TraceError(f"{self.trace_dir}: trace already finalized")
        check_table_name(table)
        rows = list(rows)
        rows_to_table(table, rows)  # fail here, at the caller, not in a later flush
        self._pending[table].extend(rows)
        timed_out = (self.flush_every_s is not None
                     and time.monotonic() - self._last_flush_s[table] >= self.flush_every_s)
        if len(self._pending[table]) >= self.flush_every_rows or (timed_out and self._pending[table]):
            self._flush_table(table)

    def _flush_table(self, table: str) -> None:
        rows, self._pending[table] = self._pending[table], []
        self._last_flush_s[table] = time.monotonic()
        if not rows:
            return
        data = rows_to_table(table, rows).replace_schema_metadata(self.meta.to_metadata(table))
        directory = parts_dir(self.trace_dir, table)
        directory.mkdir(exist_ok=True)
        _write_atomically(data, directory / f"part-{self._next_part[table]:06d}.parquet", self.fsync)
        self._next_part[table] += 1

    def flush(self) -> None:
        """Write one part per table with pending rows."""
        for table in TABLES:
            self._flush_table(table)

    def pending_rows(self, table: str) -> int:
        return len(self._pending[table])

    def existing_keys(self, table: str, key_columns: tuple[str, ...] | None = None) -> set[tuple]:
        """Key tuples of the rows recorded so far, on disk and pending (default keys: KEY_COLUMNS)."""
        check_table_name(table)
        columns = list(key_columns or KEY_COLUMNS[table])
        keys: set[tuple] = set()
        final = final_path(self.trace_dir, table)
        for path in [final] if final.is_file() else _part_files(parts_dir(self.trace_dir, table)):
            data = _read_file(path, table, columns).to_pydict()
            keys.update(zip(*(data[c] for c in columns)))
        keys.update(tuple(getattr(row, c) for c in columns) for row in self._pending[table])
        return keys

    def finalize(self) -> None:
        """Flush, then merge each table's parts into ``<table>.parquet`` (every table gets a
        file, empty if it never had rows) and remove the parts. Idempotent."""
        if self._finalized:
            return
        self.flush()
        for table in TABLES:
            parts = parts_dir(self.trace_dir, table)
            merged = _concat([_read_file(p, table) for p in _part_files(parts)], table)
            merged = merged.replace_schema_metadata(self.meta.to_metadata(table))
            _write_atomically(merged, final_path(self.trace_dir, table), self.fsync)
            if parts.exists():
                shutil.rmtree(parts)
        self._finalized = True

    close = finalize

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.flush()  # keep what was recorded; parts stay for resume=True
