"""`slimroute eval`: a predictions file (from classify) joined by id with a file of gold labels -> metrics.

Prediction rows with an error (no label) are counted, not scored, as in classify's summary; gold rows
without a prediction (e.g. a --limit run) and predictions without a gold label are counted too.

Floors: each scored row's probability of the model's own choice (p_<model_label>, else p_<label>) against
whether that choice is right gives, per coverage, the --min-prob that keeps it and the accuracy of the rows it
answers (metrics.floor_points). When the file was written with a floor (a model_label column), the rows it
routed to the fallback label are counted, and the metrics of the rows it answered are given beside the whole.
With a target accuracy, the floor that answers the most rows at that accuracy (metrics.floor_for_accuracy).
Truncation: the accuracy of the scored rows whose text was cut (`truncated`: by the context or --truncate-tokens)
beside that of the rest, to choose --truncate-tokens on labelled rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimroute.accuracy.metrics import FloorPoint, Metrics, floor_for_accuracy, floor_points
from slimroute.io.records import flag_cell
from slimroute.io.rows import InputError, iter_records, optional_str, record_columns


@dataclass(frozen=True)
class Evaluation:
    metrics: Metrics
    num_predictions: int
    num_errors: int  # matched prediction rows without a label (error rows), not scored
    num_missing: int  # gold rows without a prediction
    num_without_gold: int  # prediction rows whose id has no gold label
    floors: tuple[FloorPoint, ...] = ()  # per coverage: the floor, what it answers, their accuracy
    floored: bool = False  # the file was written with a floor (it has a model_label column)
    fallback_label: str | None = None  # the label the floor routed scored rows to (None if it routed none)
    num_fallback: int = 0  # scored rows routed there
    target_accuracy: float | None = None  # eval --target-accuracy
    target_floor: FloorPoint | None = None  # the floor answering the most rows at that accuracy (None: none does)
    truncated: tuple[int, int, int, int] | None = None  # scored rows cut and right among them, the rest and right;
    # None when the file has no truncated column

    @staticmethod
    def _share(right: int, rows: int) -> float | None:
        return right / rows if rows else None

    def truncation(self) -> dict | None:
        if self.truncated is None:
            return None
        cut, cut_right, rest, rest_right = self.truncated
        return {"rows": cut, "accuracy": self._share(cut_right, cut), "rest_rows": rest,
                "rest_accuracy": self._share(rest_right, rest)}

    @property
    def answered(self) -> Metrics | None:
        """The metrics of the scored rows the file's floor answered (None without a floor)."""
        if not self.floored:
            return None
        return self.metrics.without_prediction(self.fallback_label) if self.fallback_label else self.metrics

    def to_dict(self) -> dict:
        answered = self.answered
        return {**self.metrics.to_dict(), "macro_f1": self.metrics.macro_f1_except(self.fallback_label),
                "predictions": self.num_predictions, "errors": self.num_errors,
                "gold_without_prediction": self.num_missing, "predictions_without_gold": self.num_without_gold,
                "floors": [point.to_dict() for point in self.floors],
                "fallback": None if answered is None else {
                    "label": self.fallback_label, "rows": self.num_fallback, "answered": answered.num_items,
                    "answered_accuracy": answered.accuracy},
                "truncated": self.truncation(),
                **({} if self.target_accuracy is None else {"target": {
                    "accuracy": self.target_accuracy,
                    "floor": self.target_floor.to_dict() if self.target_floor is not None else None}})}


def _by_id(path, id_column: str, label_column: str, what: str) -> dict[str, dict]:
    """id -> record (the row number when the id is empty), checking the label column exists."""
    columns = record_columns(path)
    if label_column not in columns:
        listed = ", ".join(repr(c) for c in columns) or "none"
        raise InputError(f"{what} {str(path)!r} has no column {label_column!r}; available columns: {listed}")
    records: dict[str, dict] = {}
    for index, record in enumerate(iter_records(path)):
        key = optional_str(record.get(id_column)) or str(index)
        if key in records:
            raise InputError(f"{what} {str(path)!r}: id {key!r} appears twice; eval joins the files by id "
                             f"(pass --id-column with a unique id)")
        records[key] = record
    return records


def _probability(value) -> float | None:
    """A p_<label> cell as a float (None when the row has none)."""
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def task_labels(columns: list[str]) -> list[str]:
    """The task's labels in order, from a predictions file's p_<label> columns."""
    return [c[2:] for c in columns if c.startswith("p_")]


def evaluate_files(predictions, gold, id_column: str = "id", label_column: str = "label",
                   target_accuracy: float | None = None) -> Evaluation:
    """predictions: classify's output (columns id, label, p_<label>...); gold: any input file with ids
    (--id-column, else the row number, as classify numbers rows) and gold labels (--label-column).
    target_accuracy: also find the floor that answers the most rows at that accuracy (metrics.floor_for_accuracy)."""
    predicted = _by_id(predictions, "id", "label", "predictions file")
    golds = {k: v for k, r in _by_id(gold, id_column, label_column, "gold file").items()
             if (v := optional_str(r.get(label_column))) is not None}
    if not golds:
        raise InputError(f"gold file {str(gold)!r} has no gold labels in column {label_column!r}")
    matched = [(golds[k], predicted[k]) for k in golds if k in predicted]
    if not matched:
        raise InputError(f"no id of {str(predictions)!r} is in {str(gold)!r}; check --id-column")
    scored = []  # (gold, the answer, the model's own choice, that choice's probability)
    cut = [0, 0, 0, 0]  # truncated rows, right among them, the rest, right among them
    for g, r in matched:
        if (answer := optional_str(r.get("label"))) is not None:
            choice = optional_str(r.get("model_label")) or answer
            scored.append((g, answer, choice, _probability(r.get(f"p_{choice}"))))
            at = 0 if flag_cell(r.get("truncated")) else 2
            cut[at] += 1
            cut[at + 1] += answer == g
    columns = record_columns(predictions)
    metrics = Metrics.from_pairs([g for g, *_ in scored], [answer for _, answer, *_ in scored], task_labels(columns))
    rated = [(p, g == choice) for g, _, choice, p in scored if p is not None]
    routed = [answer for _, answer, choice, _ in scored if answer != choice]
    confidences, correct = [p for p, _ in rated], [ok for _, ok in rated]
    target = None if target_accuracy is None else floor_for_accuracy(confidences, correct, target_accuracy)
    return Evaluation(metrics, len(predicted), len(matched) - len(scored), len(golds) - len(matched),
                      sum(k not in golds for k in predicted), tuple(floor_points(confidences, correct)),
                      "model_label" in columns, routed[0] if routed else None, len(routed), target_accuracy, target,
                      tuple(cut) if "truncated" in columns else None)
