"""Run a classifier over input rows: bad rows become per-row errors, results keep input order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from slimroute.data import Row
from slimroute.labels import Prediction


def classify_rows(classifier, rows: list[Row], progress: Callable[[int], None] | None = None) -> list[Prediction]:
    """One prediction per row, in order. A row with an error, or one the model fails on, gets an error
    prediction; every other row is still classified."""
    preds = [Prediction.failed(row.error) if row.error else None for row in rows]
    good = [i for i, row in enumerate(rows) if row.error is None]
    if progress and len(good) < len(rows):
        progress(len(rows) - len(good))
    try:
        results = classifier.classify([rows[i].text for i in good], progress=progress)
    except Exception:  # isolate the failing item(s); the others keep their answers
        results = []
        for i in good:
            try:
                results.extend(classifier.classify([rows[i].text]))
            except Exception as exc:
                results.append(Prediction.failed(f"model failed on this row: {type(exc).__name__}: {exc}"))
    for i, pred in zip(good, results, strict=True):
        preds[i] = pred
    return preds


@dataclass
class JobSummary:
    labels: list[str]
    num_items: int = 0
    num_errors: int = 0
    num_truncated: int = 0
    seconds: float = 0.0
    confusion: Counter = field(default_factory=Counter)  # (gold, predicted) -> count
    padding_overhead: float | None = None

    @property
    def items_per_s(self) -> float:
        return self.num_items / self.seconds if self.seconds else 0.0

    @property
    def num_gold(self) -> int:
        return sum(self.confusion.values())

    @property
    def accuracy(self) -> float | None:
        if not self.num_gold:
            return None
        return sum(n for (gold, pred), n in self.confusion.items() if gold == pred) / self.num_gold

    def add(self, rows: Iterable[Row], preds: Iterable[Prediction]) -> None:
        for row, pred in zip(rows, preds, strict=True):
            self.num_items += 1
            if pred.error:
                self.num_errors += 1
                continue
            self.num_truncated += int(pred.truncated)
            if row.gold is not None:
                self.confusion[(row.gold, pred.label)] += 1

    def to_dict(self) -> dict:
        return {
            "items": self.num_items,
            "errors": self.num_errors,
            "truncated": self.num_truncated,
            "seconds": round(self.seconds, 3),
            "items_per_s": round(self.items_per_s, 3),
            "accuracy": self.accuracy,
            "padding_overhead": self.padding_overhead,
            "confusion": [[g, p, n] for (g, p), n in sorted(self.confusion.items())],
        }
