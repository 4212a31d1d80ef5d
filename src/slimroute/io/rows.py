"""Input rows in: CSV / JSONL / Parquet / text lines, streamed (standard input is spooled into a file: stdio.py).

Reading never raises for a bad row: the row comes back with `error` set and `text` None, so
every other row is still processed. Problems with the file as a whole (missing, unknown
format, no text column) raise `InputError`, whose message says what to do.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}  # in and out
INPUT_FORMATS = {**FORMATS, ".txt": "txt"}  # .txt: one text per line (input only)
_MISSING = object()
_JSONL_LOOKAHEAD = 100  # lines inspected to decide whether a JSONL file has the text column at all
_BOM = b"\xef\xbb\xbf"

class InputError(ValueError):
    """A usage error about the input file; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Row:
    index: int  # 0-based row number in the input (blank lines are not rows)
    id: str  # value of the id column as str, else str(index)
    text: str | None  # None when the row has an error
    gold: str | None  # gold label if a label column exists and is filled in, else None
    error: str | None  # per-row problem, else None


@dataclass(frozen=True)
class _Columns:
    text: str
    id: str
    label: str | None  # None: no gold labels


def format_of(path: Path) -> str:
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"file {str(path)!r} has an unsupported extension {path.suffix!r}; "
                         f"use one of {', '.join(INPUT_FORMATS)}")
    return fmt


def _check_input(path) -> tuple[Path, str]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"input file {str(path)!r} does not exist; check the path")
    return path, format_of(path)


def _has_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _clean(value: str) -> str:
    """Replace undecodable bytes (kept as surrogates) with U+FFFD so the value can be written out."""
    if not _has_surrogates(value):
        return value
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in value)


def text_columns(spec: str, available=None) -> tuple[str, ...]:
    """The columns a --text-column names: one, or several separated by commas ("subject,body"), whose values make
    one text (_text_of). A column whose own name has a comma (in `available`) is taken whole."""
    if "," not in spec or (available is not None and spec in available):
        return (spec,)
    return tuple(part.strip() for part in spec.split(",") if part.strip())


def _resolve_columns(path: Path, available: list[str], text: str, id_: str, label: str | None) -> _Columns:
    """Check the file-level columns; `label=None` means 'label' if present, else no gold."""
    listed = ", ".join(repr(c) for c in available) or "none"
    for column in text_columns(text, available):
        if column not in available:
            raise InputError(f"text column {column!r} is not in {str(path)!r}; available columns: {listed}. "
                             "Pass --text-column with the column that holds the text")
    if label is not None and label not in available:
        raise InputError(f"label column {label!r} is not in {str(path)!r}; available columns: {listed}. "
                         "Pass --label-column with the column that holds the gold labels, or leave it out")
    if id_ != "id" and id_ not in available:
        raise InputError(f"id column {id_!r} is not in {str(path)!r}; available columns: {listed}. "
                         "Pass --id-column with the column that holds the ids, or leave it out")
    if label is None and "label" in available:
        label = "label"
    return _Columns(text, id_, label)


def text_of(record: Mapping, spec: str) -> tuple[str | None, str | None]:
    """(text, None), or (None, what is wrong with it). Several text columns (text_columns) make one text: each
    filled one as a paragraph "<column>: <value>", in the order given; empty, null or missing ones are left out (an
    email without a subject), and the row is an error only if none is left or one holds something not a text."""
    columns = text_columns(spec, record)
    if len(columns) == 1:
        return _checked_text(record.get(columns[0], _MISSING), columns[0], "text")
    parts = []
    for column in columns:
        value = record.get(column, _MISSING)
        if value is _MISSING or value is None or isinstance(value, (str, bytes)) and not value.strip():
            continue
        text, error = _checked_text(value, column, f"text column {column!r}")
        if error is not None:
            return None, error
        parts.append(f"{column}: {text.strip()}")
    if not parts:
        return None, f"text columns {', '.join(map(repr, columns))} are all empty or missing in this row"
    return "\n\n".join(parts), None


def _checked_text(value, column: str, what: str) -> tuple[str | None, str | None]:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, f"{what} is not valid UTF-8"
    if value is _MISSING:
        return None, f"text column {column!r} is missing in this row"
    if value is None:
        return None, f"{what} is null"
    if not isinstance(value, str):
        return None, f"{what} is not a string (got {type(value).__name__})"
    if _has_surrogates(value):
        return None, f"{what} is not valid UTF-8"
    if not value.strip():
        return None, f"{what} is empty"
    return value, None


def optional_str(value) -> str | None:
    if value is None or value is _MISSING:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    value = _clean(str(value)).strip()
    return value or None


def _make_row(index: int, record: Mapping, cols: _Columns) -> Row:
    text, error = text_of(record, cols.text)
    gold = optional_str(record.get(cols.label)) if cols.label else None
    return Row(index, optional_str(record.get(cols.id)) or str(index), text, gold, error)


def _error_row(index: int, error: str) -> Row:
    return Row(index, str(index), None, None, error)


def _lines(path: Path) -> Iterator[bytes]:
    """Non-blank lines, BOM stripped."""
    with path.open("rb") as f:
        for number, line in enumerate(f):
            if number == 0 and line.startswith(_BOM):
                line = line[len(_BOM):]
            if line.strip():
                yield line


def _parse_jsonl(line: bytes) -> tuple[object, str | None]:
    try:
        obj = json.loads(line.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as e:
        return None, f"row is not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"row is not a JSON object (got {type(obj).__name__})"
    return obj, None


def _jsonl_columns(path: Path, text: str, id_: str, label: str | None) -> _Columns:
    """JSONL has no header: the columns are the keys seen in the first objects of the file."""
    seen: dict[str, None] = {}
    for number, line in enumerate(_lines(path)):
        obj, _ = _parse_jsonl(line)
        if obj is not None:
            seen.update(dict.fromkeys(obj))
            texts = text_columns(text, seen)
            if all(c in seen for c in texts) and (label is None or label in seen) and (id_ == "id" or id_ in seen):
                break
        if number + 1 >= _JSONL_LOOKAHEAD:
            break
    if not seen:  # nothing parses: report it row by row
        return _Columns(text, id_, label or "label")
    cols = _resolve_columns(path, list(seen), text, id_, label)
    return _Columns(cols.text, cols.id, label or "label")  # 'label' read per row when present


def _iter_jsonl(path: Path, cols: _Columns) -> Iterator[Row]:
    for index, line in enumerate(_lines(path)):
        obj, error = _parse_jsonl(line)
        yield _error_row(index, error) if error else _make_row(index, obj, cols)


def _text_lines(path: Path) -> Iterator[str]:
    """A .txt file's texts: its non-blank lines, without their line ends (undecodable bytes kept as surrogates)."""
    for line in _lines(path):
        yield line.rstrip(b"\r\n").decode("utf-8", "surrogateescape")


def _iter_txt(path: Path) -> Iterator[Row]:
    """One text per non-blank line; the id is the row number."""
    cols = _Columns("text", "id", None)
    for index, text in enumerate(_text_lines(path)):
        yield _make_row(index, {"text": text}, cols)


def _open_csv(path: Path):
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # long texts are legitimate
    return path.open(encoding="utf-8-sig", errors="surrogateescape", newline="")


def _csv_records(path: Path) -> Iterator[list[str]]:
    """CSV records, header first; blank lines are not records."""
    with _open_csv(path) as f:
        reader = csv.reader(f)
        try:
            yield from (values for values in reader if values)
        except csv.Error as e:
            raise InputError(f"{str(path)!r} is not valid CSV near line {reader.line_num}: {e}; "
                             "fix the quoting or convert the file to JSONL") from e


def _iter_csv(path: Path, header: list[str], cols: _Columns) -> Iterator[Row]:
    records = _csv_records(path)
    next(records)
    for index, values in enumerate(records):
        yield _make_row(index, dict(zip(header, values, strict=False)), cols)


def _iter_parquet(pf: pq.ParquetFile, cols: _Columns, batch_size: int = 1024) -> Iterator[Row]:
    names = pf.schema_arrow.names
    wanted = [c for c in dict.fromkeys((*text_columns(cols.text, names), cols.id, cols.label)) if c in names]
    index = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=wanted):
        data = batch.to_pydict()
        for i in range(batch.num_rows):
            yield _make_row(index, {c: data[c][i] for c in wanted}, cols)
            index += 1


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{str(path)!r} is not a readable Parquet file ({e}); check the file") from e


def iter_rows(path, text_column: str = "text", id_column: str = "id",
              label_column: str | None = None) -> Iterator[Row]:
    """Stream the rows of a .csv / .jsonl / .ndjson / .parquet / .txt file (.txt: a text per line, no columns).

    File-level problems raise InputError here, before the first row is read; row problems never raise.
    """
    path, fmt = _check_input(path)
    if fmt == "txt":
        named = [f"{flag} {value!r}" for flag, value, default in (("--text-column", text_column, "text"),
                 ("--id-column", id_column, "id"), ("--label-column", label_column, None)) if value != default]
        if named:
            raise InputError(f"{str(path)!r} holds one text per line and no columns, so {', '.join(named)} cannot "
                             "apply; leave it out, or give a CSV / JSONL / Parquet file with those columns")
        return _iter_txt(path)
    if fmt == "csv":
        header = next(_csv_records(path), None)
        if header is None:  # an empty file has no rows
            return iter(())
        header = [_clean(h) for h in header]
        return _iter_csv(path, header, _resolve_columns(path, header, text_column, id_column, label_column))
    if fmt == "parquet":
        pf = _open_parquet(path)
        return _iter_parquet(pf, _resolve_columns(path, pf.schema_arrow.names, text_column, id_column,
                                                  label_column))
    return _iter_jsonl(path, _jsonl_columns(path, text_column, id_column, label_column))


def read_rows(path, text_column: str = "text", id_column: str = "id",
              label_column: str | None = None) -> list[Row]:
    return list(iter_rows(path, text_column, id_column, label_column))


def count_rows(path) -> int | None:
    """Number of rows, cheaply, for progress bars; None when it cannot be told."""
    path = Path(path)
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    try:
        if fmt == "parquet":
            return pq.ParquetFile(path).metadata.num_rows
        if fmt in ("jsonl", "txt"):
            return sum(1 for _ in _lines(path))
        if fmt == "csv":
            return max(0, sum(1 for _ in _csv_records(path)) - 1)
    except (OSError, InputError, pa.ArrowException):
        return None
    return None


def iter_records(path) -> Iterator[dict]:
    """Every row of a .csv / .jsonl / .parquet file as a dict of its columns, for files read by column
    name (predictions, gold labels). A JSONL line that is not an object counts as a row with no columns."""
    path, fmt = _check_input(path)
    if fmt == "csv":
        records = _csv_records(path)
        header = [_clean(h) for h in next(records, [])]
        for values in records:
            yield {h: _clean(v) for h, v in zip(header, values, strict=False)}
    elif fmt == "parquet":
        for batch in _open_parquet(path).iter_batches():
            yield from batch.to_pylist()
    elif fmt == "txt":
        yield from ({"text": _clean(text)} for text in _text_lines(path))
    else:
        for line in _lines(path):
            obj, _ = _parse_jsonl(line)
            yield obj if obj is not None else {}


def record_columns(path) -> list[str]:
    """The file's column names (JSONL: the keys of its first objects)."""
    path, fmt = _check_input(path)
    if fmt == "csv":
        return [_clean(h) for h in next(_csv_records(path), [])]
    if fmt == "parquet":
        return list(_open_parquet(path).schema_arrow.names)
    if fmt == "txt":
        return ["text"]
    seen: dict[str, None] = {}
    for number, line in enumerate(_lines(path)):
        obj, _ = _parse_jsonl(line)
        seen.update(dict.fromkeys(obj or {}))
        if number + 1 >= _JSONL_LOOKAHEAD:
            break
    return list(seen)


def read_labelled(path, text_column: str = "text", label_column: str | None = "label",
                  what: str = "labelled file") -> list[tuple[str, str | None]]:
    """(text, label) pairs of a small curated file (few-shot examples, calibration data). Unlike the input
    to classify, a bad row is an InputError naming it; label_column=None reads texts only (label None)."""
    pairs = []
    for row in iter_rows(path, text_column, "id", label_column):
        where = f"{what} {str(path)!r}, row {row.index} (id {row.id})"
        if row.error is not None:
            raise InputError(f"{where}: {row.error}")
        if label_column is not None and row.gold is None:
            raise InputError(f"{where} has no label in column {label_column!r}")
        pairs.append((row.text, row.gold if label_column is not None else None))
    if not pairs:
        raise InputError(f"{what} {str(path)!r} has no rows")
    return pairs
