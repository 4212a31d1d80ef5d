"""`-` for classify: standard input spooled into a file, predictions streamed to standard output.

`spooled_stdin` reads standard input to its end into a temporary file (so the rows can be counted, fingerprinted
for --resume and read as any input file), named for what its first non-blank line is: a JSON object makes it JSONL,
anything else one text per line. `StreamOutput` takes DurableOutput's place for `--out -`: each window's
predictions go out as JSONL lines, in input order, as soon as the window is classified; nothing is kept, so there
is nothing to resume.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slimroute.io.durable import OutputError, ProgressRecord, check_errors_path, window_records
from slimroute.io.records import encode_records
from slimroute.io.rows import InputError, Row
from slimroute.labels import Prediction

STDIO = "-"
_PEEK_BYTES = 1 << 16


@contextmanager
def spooled_stdin(stream=None, text_column: str = "text") -> Iterator[Path]:
    """The whole of `stream` (default: standard input's bytes) as a temporary .jsonl or .txt file, removed on exit.

    A first line whose comma-separated fields include `text_column` reads as a CSV header: InputError, since a CSV
    (or Parquet) input is given as a file."""
    stream = stream if stream is not None else sys.stdin.buffer
    folder = Path(tempfile.mkdtemp(prefix="slimroute-stdin-"))
    try:
        spool = folder / "stdin"
        with spool.open("wb") as f:
            shutil.copyfileobj(stream, f)
        first = _first_line(spool)
        if first is None or first.lstrip().startswith("{") and _is_object(first):
            yield spool.rename(folder / "stdin.jsonl")
            return
        if text_column in (field.strip().strip('"') for field in first.split(",")):
            raise InputError(f"standard input looks like CSV (its first line names the column {text_column!r}); "
                             "give CSV and Parquet input as a file, or pipe JSONL or one text per line")
        yield spool.rename(folder / "stdin.txt")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _first_line(path: Path) -> str | None:
    with path.open("rb") as f:
        head = f.read(_PEEK_BYTES).lstrip(b"\xef\xbb\xbf")
    for line in head.splitlines():
        if line.strip():
            return line.decode("utf-8", "replace")
    return None


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


class StreamOutput:
    """DurableOutput's interface for `--out -`: each committed window's predictions as JSONL lines on `stream`
    (default: standard output), flushed; failed rows to `errors` (a .jsonl file) when given."""

    out = "standard output"

    def __init__(self, labels: list[str], input_fp: dict, settings: dict, *, resume: bool = False,
                 errors=None, raw_columns: bool = False, routed_column: bool = False, stream=None):
        if resume:
            raise OutputError("--resume needs an output file: standard output keeps nothing to resume from; "
                              "pass --out with a .jsonl, .csv or .parquet path")
        errors = Path(errors) if errors else None
        check_errors_path(errors)
        self.labels, self.errors = list(labels), errors
        self.raw_columns, self.routed_column = raw_columns, routed_column
        self.record, self.resuming = ProgressRecord(input_fp, settings), False
        self._stream = stream
        self._errors_file = None

    def start(self) -> None:
        if self._stream is None:
            self._stream = sys.stdout.buffer
        if self.errors is not None:
            self.errors.parent.mkdir(parents=True, exist_ok=True)
            self._errors_file = self.errors.open("wb")

    def commit(self, rows: list[Row], preds: list[Prediction], summary_state: dict) -> None:
        records, failed = window_records(rows, preds, self.labels, self.raw_columns, self.routed_column,
                                         self._errors_file is not None)
        if self._errors_file is not None:
            self._errors_file.write(encode_records("jsonl", failed).encode("utf-8"))
            self._errors_file.flush()
        self._stream.write(encode_records("jsonl", records).encode("utf-8"))
        self._stream.flush()
        self.record.add_window(len(rows), summary_state)

    def finish(self) -> None:
        self.close()

    def close(self) -> None:
        if self._errors_file is not None:
            self._errors_file.close()
            self._errors_file = None

    def __enter__(self) -> StreamOutput:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def silence_stdout() -> None:
    """After the reader closed standard output (`| head`): point it at /dev/null, so that exiting does not fail
    flushing it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
