"""Durable, resumable prediction output, committed window by window.

For `--out preds.jsonl` (or `.csv`) the files on disk are
  preds.jsonl                the predictions of every committed window, in input order
  preds.jsonl.progress.json  only while the job is unfinished: rows done, bytes committed, fingerprints
and for `--out preds.parquet`, which cannot be appended to once closed,
  preds.parquet.parts/       one part file per committed window, assembled into preds.parquet at the end.

Commit order, so that the progress record never points past data that is on disk:
  1. append the window's bytes (or write its part to a temp file and rename it), flush, fsync;
  2. replace the progress record atomically (temp file, fsync, os.replace, fsync of the folder).
A crash between 1 and 2 leaves extra bytes after the recorded length; resuming truncates them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slimroute.io.records import encode_records, output_columns, output_record, output_schema
from slimroute.io.rows import FORMATS, Row
from slimroute.labels import Prediction

RECORD_VERSION = 1
_CHUNK_BYTES = 1 << 20


class OutputError(ValueError):
    """A usage error about the output (it exists, or the job cannot resume); the message says what to do."""


def progress_path(out: Path) -> Path:
    return out.with_name(out.name + ".progress.json")


def parts_path(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def input_fingerprint(path) -> dict:
    """Size and SHA-256 of the whole file (about a second per GB; small beside classifying it). Not the
    modification time, so a copied or touched input still resumes."""
    path, digest = Path(path), hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return {"path": str(path.resolve()), "size": path.stat().st_size, "sha256": digest.hexdigest()}


@dataclass
class ProgressRecord:
    input: dict
    settings: dict
    rows_done: int = 0  # input rows (good and bad) whose output is committed
    windows_done: int = 0
    output_bytes: int = 0  # committed length of the JSONL / CSV output (0 for Parquet)
    errors_bytes: int = 0  # committed length of the --errors file
    summary: dict = field(default_factory=dict)  # JobSummary.state() after the last committed window
    calibration: dict | None = None  # the calibration offsets in use (Offsets.to_dict()), once known
    version: int = RECORD_VERSION

    @classmethod
    def read(cls, path: Path) -> ProgressRecord | None:
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != RECORD_VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise OutputError(f"progress record {str(path)!r} is unreadable ({exc}); "
                              "pass --overwrite to start the job over") from exc

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=1).encode())

    def add_window(self, num_rows: int, summary_state: dict) -> None:
        self.rows_done += num_rows
        self.windows_done += 1
        self.summary = summary_state


def window_records(rows: list[Row], preds: list[Prediction], labels: list[str], raw: bool, routed: bool,
                   errors_apart: bool) -> tuple[list[dict], list[dict]]:
    """A window's output records, and with errors_apart (--errors) its failed rows' {index, id, error}, which are
    then left out of the output records."""
    records = [output_record(r, p, labels, raw, routed) for r, p in zip(rows, preds, strict=True)]
    if not errors_apart:
        return records, []
    failed = [{"index": row.index, "id": rec["id"], "error": rec["error"]}
              for row, rec in zip(rows, records, strict=True) if rec["error"] is not None]
    return [rec for rec in records if rec["error"] is None], failed


def check_errors_path(errors: Path | None, out: Path | None = None) -> None:
    if errors is not None and (errors.suffix.lower() not in (".jsonl", ".ndjson") or errors == out):
        raise OutputError(f"--errors {str(errors)!r} must be a .jsonl file other than --out")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old or the new content, never a mix, also after a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def interrupts_deferred():
    """Hold Ctrl-C until the block is done, so a window is committed entirely or not at all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _changed(old: dict, new: dict, keys) -> list[str]:
    return [f"{k}: was {old.get(k)!r}, now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


class DurableOutput:
    """`prepare` decides (touching nothing) whether the job starts fresh or resumes; `start` sets up the
    files; `commit` makes one window durable; `finish` completes the job; `close` leaves committed state."""

    def __init__(self, out: Path, labels: list[str], record: ProgressRecord, resuming: bool,
                 errors: Path | None = None, raw_columns: bool = False, routed_column: bool = False):
        self.out, self.labels, self.record, self.errors = out, list(labels), record, errors
        self.resuming, self.raw_columns, self.routed_column = resuming, raw_columns, routed_column
        self.format = FORMATS[out.suffix.lower()]
        self.progress, self.parts = progress_path(out), parts_path(out)
        self._out_file = self._errors_file = None

    @classmethod
    def prepare(cls, out, labels: list[str], input_fp: dict, settings: dict, *, resume: bool = False,
                overwrite: bool = False, errors=None, raw_columns: bool = False,
                routed_column: bool = False) -> DurableOutput:
        """raw_columns: calibration is on; rows carry raw_p_<label> next to p_<label>. routed_column: a fallback
        floor is on; rows carry model_label next to label."""
        out, errors = Path(out), Path(errors) if errors else None
        if out.suffix.lower() not in FORMATS:
            raise OutputError(f"--out {str(out)!r} must end in .jsonl, .csv or .parquet")
        check_errors_path(errors, out)
        if resume and overwrite:
            raise OutputError("give either --resume or --overwrite, not both")
        fresh = ProgressRecord(input_fp, settings)
        if overwrite:
            return cls(out, labels, fresh, False, errors, raw_columns, routed_column)
        record = ProgressRecord.read(progress_path(out))
        existing = [p for p in (out, errors) if p is not None and p.exists()]
        if record is None and not resume and existing:
            raise OutputError(f"{str(existing[0])!r} already exists; pass --overwrite to replace it "
                              "(nothing is overwritten without it)")
        if record is None and resume and existing:
            raise OutputError(f"nothing to resume: {str(existing[0])!r} has no progress record (the job that "
                              "wrote it finished, or it was not written by slimroute classify); "
                              "pass --overwrite to start over")
        if record is None:
            return cls(out, labels, fresh, False, errors, raw_columns, routed_column)
        if not resume:
            raise OutputError(f"an unfinished job for {str(out)!r} has {record.rows_done} rows committed; "
                              "pass --resume to continue it or --overwrite to start over")
        changes = _changed(record.input, input_fp, ("size", "sha256"))
        if changes:
            raise OutputError(f"cannot resume: the input {input_fp['path']!r} is not the file the job began "
                              f"with ({'; '.join(changes)}); pass --overwrite to start over")
        changes = _changed(record.settings, settings, sorted(set(record.settings) | set(settings)))
        if changes:
            raise OutputError(f"cannot resume: settings differ from the interrupted run "
                              f"({'; '.join(changes)}); rerun with the original settings, "
                              "or pass --overwrite to start over")
        job = cls(out, labels, record, True, errors, raw_columns, routed_column)
        job._check_committed()
        return job

    def _check_committed(self) -> None:
        if self.format == "parquet":
            missing = [p for p in self._part_files() if not p.is_file()]
            if missing:
                raise OutputError(f"cannot resume: part {str(missing[0])!r} is missing; pass --overwrite")
        elif self.record.output_bytes and self._size(self.out) < self.record.output_bytes:
            raise OutputError(f"cannot resume: {str(self.out)!r} is shorter than its committed "
                              f"{self.record.output_bytes} bytes; pass --overwrite to start over")
        if self.errors is not None and self._size(self.errors) < self.record.errors_bytes:
            raise OutputError(f"cannot resume: {str(self.errors)!r} is shorter than its committed "
                              f"{self.record.errors_bytes} bytes; pass --overwrite to start over")

    @staticmethod
    def _size(path: Path) -> int:
        return path.stat().st_size if path.exists() else 0

    def _part_file(self, k: int) -> Path:
        return self.parts / f"part-{k:06d}.parquet"

    def _part_files(self) -> list[Path]:
        """The committed windows' parts, in order."""
        return [self._part_file(k) for k in range(self.record.windows_done)]

    def start(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if not self.resuming:
            # The record comes first: from here on a crash leaves a job that resumes from row 0.
            self.record.write(self.progress)
            for path in (self.out, self.errors):
                if path is not None and path.exists():
                    path.unlink()
            shutil.rmtree(self.parts, ignore_errors=True)
        if self.format == "parquet":
            self.parts.mkdir(exist_ok=True)
            keep = set(self._part_files())
            for stray in self.parts.iterdir():  # parts of an uncommitted window, temp files
                if stray not in keep:
                    stray.unlink()
        else:
            self._out_file = self._open_at(self.out, self.record.output_bytes)
        if self.errors is not None:
            self._errors_file = self._open_at(self.errors, self.record.errors_bytes)

    @staticmethod
    def _open_at(path: Path, length: int):
        """Open for appending after the first `length` bytes; anything after them is dropped."""
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
        f.truncate(length)
        f.seek(length)
        os.fsync(f.fileno())
        return f

    def commit(self, rows: list[Row], preds: list[Prediction], summary_state: dict) -> None:
        """Make one window durable: its output, its error rows, then the progress record."""
        records, failed = window_records(rows, preds, self.labels, self.raw_columns, self.routed_column,
                                         self.errors is not None)
        with interrupts_deferred():
            if self.format == "parquet":
                self._write_part(self.record.windows_done, records)
            else:
                self.record.output_bytes += self._append(self._out_file, self._encode(records))
            if self._errors_file is not None:
                data = encode_records("jsonl", failed).encode("utf-8")
                self.record.errors_bytes += self._append(self._errors_file, data)
            self.record.add_window(len(rows), summary_state)
            self.record.write(self.progress)

    def _encode(self, records: list[dict]) -> bytes:
        first = self.format == "csv" and self.record.output_bytes == 0
        header = output_columns(self.labels, self.raw_columns, self.routed_column) if first else None
        return encode_records(self.format, records, header).encode("utf-8")

    @staticmethod
    def _append(f, data: bytes) -> int:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        return len(data)

    def _write_part(self, k: int, records: list[dict]) -> None:
        part = self._part_file(k)
        tmp = part.with_name(part.name + ".tmp")
        with open(tmp, "wb") as f:
            schema = output_schema(self.labels, self.raw_columns, self.routed_column)
            pq.write_table(pa.Table.from_pylist(records, schema=schema), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, part)
        fsync_dir(self.parts)

    def finish(self) -> None:
        """All windows are committed: complete the output, then drop the progress record."""
        with interrupts_deferred():
            if self.format == "parquet":
                self._assemble()
            elif self.record.output_bytes == 0:  # no rows at all: a CSV still gets its header
                self.record.output_bytes += self._append(self._out_file, self._encode([]))
            self.close()
            self.progress.unlink()
            fsync_dir(self.progress.parent)
            shutil.rmtree(self.parts, ignore_errors=True)

    def _assemble(self) -> None:
        """Concatenate the parts (one row group per window) into the final file, atomically; a crash in
        here leaves the parts and the record, so resuming assembles again."""
        tmp = self.out.with_name(self.out.name + ".tmp")
        with open(tmp, "wb") as f:
            writer = pq.ParquetWriter(f, output_schema(self.labels, self.raw_columns, self.routed_column))
            for part in self._part_files():
                table = pq.read_table(part)
                if table.num_rows:
                    writer.write_table(table, row_group_size=table.num_rows)
            writer.close()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out)
        fsync_dir(self.out.parent)

    def close(self) -> None:
        """Close the files, cutting them back to what is committed (after an interruption)."""
        committed = (self._out_file, self.record.output_bytes), (self._errors_file, self.record.errors_bytes)
        for f, length in committed:
            if f is not None:
                f.truncate(length)
                f.close()
        self._out_file = self._errors_file = None

    def __enter__(self) -> DurableOutput:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
