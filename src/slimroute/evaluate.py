"""`slimroute eval`: a predictions file (from classify) joined by id with a file of gold labels -> metrics.

Prediction rows with an error (no label) are counted, not scored, as in classify's summary; gold rows
without a prediction (e.g. a --limit run) and predictions without a gold label are counted too.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimroute.data import InputError, _optional_str, iter_records, record_columns
from slimroute.metrics import Metrics


@dataclass(frozen=True)
class Evaluation:
    metrics: Metrics
    num_predictions: int
    num_errors: int  # matched prediction rows without a label (error rows), not scored
    num_missing: int  # gold rows without a prediction
    num_without_gold: int  # prediction rows whose id has no gold label

    def to_dict(self) -> dict:
        return {**self.metrics.to_dict(), "predictions": self.num_predictions, "errors": self.num_errors,
                "gold_without_prediction": self.num_missing, "predictions_without_gold": self.num_without_gold}


def _by_id(path, id_column: str, label_column: str, what: str) -> dict[str, str | None]:
    columns = record_columns(path)
    if label_column not in columns:
        listed = ", ".join(repr(c) for c in columns) or "none"
        raise InputError(f"{what} {str(path)!r} has no column {label_column!r}; available columns: {listed}")
    labels: dict[str, str | None] = {}
    for index, record in enumerate(iter_records(path)):
        key = _optional_str(record.get(id_column)) or str(index)
        if key in labels:
            raise InputError(f"{what} {str(path)!r}: id {key!r} appears twice; eval joins the files by id "
                             f"(pass --id-column with a unique id)")
        labels[key] = _optional_str(record.get(label_column))
    return labels


def task_labels(path) -> list[str]:
    """The task's labels in order, from a predictions file's p_<label> columns."""
    return [c[2:] for c in record_columns(path) if c.startswith("p_")]


def evaluate_files(predictions, gold, id_column: str = "id", label_column: str = "label") -> Evaluation:
    """predictions: classify's output (columns id, label, p_<label>...); gold: any input file with ids
    (--id-column, else the row number, as classify numbers rows) and gold labels (--label-column)."""
    predicted = _by_id(predictions, "id", "label", "predictions file")
    golds = {k: v for k, v in _by_id(gold, id_column, label_column, "gold file").items() if v is not None}
    if not golds:
        raise InputError(f"gold file {str(gold)!r} has no gold labels in column {label_column!r}")
    matched = [(golds[k], predicted[k]) for k in golds if k in predicted]
    if not matched:
        raise InputError(f"no id of {str(predictions)!r} is in {str(gold)!r}; check --id-column")
    scored = [(g, p) for g, p in matched if p is not None]
    metrics = Metrics.from_pairs([g for g, _ in scored], [p for _, p in scored], task_labels(predictions))
    return Evaluation(metrics, len(predicted), len(matched) - len(scored), len(golds) - len(matched),
                      sum(k not in golds for k in predicted))
