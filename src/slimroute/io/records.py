"""Predictions out: the output columns and records, their CSV / JSONL encoding, and plain writers.

One output row per input row: id, label (model_label with a fallback floor), p_<label>... (raw_p_<label>... with
calibration), truncated, error. An error row has no label and no probabilities. durable.py commits these records
window by window; the Ray backend writes the same records into its shards.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from slimroute.io.rows import Row, format_of
from slimroute.labels import Prediction


def output_columns(labels: list[str], raw: bool = False, routed: bool = False) -> list[str]:
    """raw: calibration is on, so the model's own probabilities follow the calibrated ones; routed: a fallback
    floor is on, so the model's own choice (model_label) follows the answer."""
    raw_columns = [f"raw_p_{label}" for label in labels] if raw else []
    routed_columns = ["model_label"] if routed else []
    return ["id", "label", *routed_columns, *(f"p_{label}" for label in labels), *raw_columns, "truncated", "error"]


def output_record(row: Row, pred: Prediction, labels: list[str], raw: bool = False, routed: bool = False) -> dict:
    """One output row; an error row (from the input or the model) has no label and no probabilities.
    p_<label> are the probabilities the decision used (calibrated, when calibration is on); with raw=True
    raw_p_<label> are the model's own, both renormalised over the labels. With routed=True, model_label is the
    decision's choice and label the answer (the fallback label when the floor routed the row there)."""
    error = row.error or pred.error
    probs = {} if error else pred.probs
    record: dict = {"id": row.id, "label": None if error else pred.label}
    if routed:
        record["model_label"] = None if error else pred.model_label
    record.update({f"p_{label}": probs.get(label) for label in labels})
    if raw:
        raw_probs = {} if error else pred.raw_probs
        record.update({f"raw_p_{label}": raw_probs.get(label) for label in labels})
    record.update({"truncated": bool(pred.truncated), "error": error})
    return record


def output_schema(labels: list[str], raw: bool = False, routed: bool = False) -> pa.Schema:
    fields = [pa.field(name, pa.string()) for name in ("id", "label", "model_label")[:3 if routed else 2]]
    fields += [pa.field(name, pa.float64()) for name in output_columns(labels, raw, routed)[len(fields):-2]]
    return pa.schema(fields + [pa.field("truncated", pa.bool_()), pa.field("error", pa.string())])


def _csv_cell(value) -> object:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def flag_cell(value) -> bool:
    """A written boolean cell read back (an output's `truncated`): a bool in JSONL and Parquet, true/false in CSV
    (as _csv_cell writes it)."""
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def encode_records(fmt: str, records: list[dict], header: list[str] | None = None) -> str:
    """JSONL or CSV text of output records, exactly as PredictionWriter writes them (CSV: header first
    when given). Deterministic: floats are written as their shortest repr."""
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)  # \r\n line ends: then a lone \r in a value is quoted
        if header is not None:
            writer.writerow(header)
        writer.writerows([_csv_cell(v) for v in rec.values()] for rec in records)
        return buf.getvalue()
    return "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)


class PredictionWriter:
    """Append batches of predictions to a .csv / .jsonl / .parquet file (format by extension)."""

    def __init__(self, path, labels: list[str]):
        self.path, self.labels = Path(path), list(labels)
        self.format = format_of(self.path)
        if not self.labels or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be a non-empty list of distinct labels, got {self.labels!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._parquet = None
        self._schema = output_schema(self.labels)
        if self.format == "parquet":
            self._parquet = pq.ParquetWriter(self.path, self._schema)
        else:
            self._file = self.path.open("w", encoding="utf-8", newline="")
            if self.format == "csv":
                self._file.write(encode_records("csv", [], output_columns(self.labels)))

    def write(self, rows: list[Row], preds: list[Prediction]) -> None:
        """Append one batch, in the given order (one Parquet row group per call)."""
        if len(rows) != len(preds):
            raise ValueError(f"write got {len(rows)} rows but {len(preds)} predictions; pass one per row")
        if self._file is None and self._parquet is None:
            raise ValueError(f"PredictionWriter for {str(self.path)!r} is closed; open a new one to write")
        records = [output_record(r, p, self.labels) for r, p in zip(rows, preds, strict=True)]
        if not records:
            return
        if self._parquet is not None:
            table = pa.Table.from_pylist(records, schema=self._schema)
            self._parquet.write_table(table, row_group_size=len(records))
        else:
            self._file.write(encode_records(self.format, records))

    def close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> PredictionWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_records(path, records: list[dict]) -> None:
    """Plain records (e.g. synthetic tickets) to a .csv / .jsonl / .parquet file, by extension."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".csv":
        pacsv.write_csv(pa.Table.from_pylist(records), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
