"""Classification metrics from (gold, predicted) counts, and a confusion-matrix PNG.

Accuracy is the share of items whose predicted label is the gold one. Per label: precision (of the
items predicted as it), recall (of its gold items), F1 and support (its gold items); a ratio with
nothing to divide by is 0. Macro-F1 is the unweighted mean F1 over the labels that occur as gold or as
prediction (as scikit-learn's default `f1_score(average="macro")` does). Plain Python; the plot needs
matplotlib (the `plot` extra).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LabelScores:
    precision: float
    recall: float
    f1: float
    support: int  # gold items of this label
    predicted: int  # items predicted as this label


@dataclass(frozen=True)
class Metrics:
    labels: tuple[str, ...]  # the task's labels, then any other label seen, in first-seen order
    confusion: tuple[tuple[int, ...], ...]  # confusion[gold][predicted], both in `labels` order

    @classmethod
    def from_counts(cls, counts: Counter | dict, labels: Iterable[str] = ()) -> Metrics:
        """counts: (gold, predicted) -> number of items."""
        order = list(dict.fromkeys(labels))
        for gold, pred in counts:
            order += [label for label in (gold, pred) if label not in order]
        index = {label: i for i, label in enumerate(order)}
        matrix = [[0] * len(order) for _ in order]
        for (gold, pred), n in counts.items():
            if n < 0:
                raise ValueError(f"count of ({gold!r}, {pred!r}) is negative: {n}")
            matrix[index[gold]][index[pred]] += n
        return cls(tuple(order), tuple(tuple(row) for row in matrix))

    @classmethod
    def from_pairs(cls, golds: Iterable[str], preds: Iterable[str], labels: Iterable[str] = ()) -> Metrics:
        return cls.from_counts(Counter(zip(golds, preds, strict=True)), labels)

    @property
    def num_items(self) -> int:
        return sum(map(sum, self.confusion))

    @property
    def num_correct(self) -> int:
        return sum(self.confusion[i][i] for i in range(len(self.labels)))

    @property
    def accuracy(self) -> float | None:
        return self.num_correct / self.num_items if self.num_items else None

    @property
    def per_label(self) -> dict[str, LabelScores]:
        scores = {}
        for i, label in enumerate(self.labels):
            hits = self.confusion[i][i]
            support = sum(self.confusion[i])
            predicted = sum(row[i] for row in self.confusion)
            precision = hits / predicted if predicted else 0.0
            recall = hits / support if support else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            scores[label] = LabelScores(precision, recall, f1, support, predicted)
        return scores

    @property
    def macro_f1(self) -> float | None:
        return self.macro_f1_except(None)

    def is_route(self, fallback: str | None) -> bool:
        """Whether `fallback` is a route here, not a class: a label no item has as gold."""
        return fallback in self.labels and not sum(self.confusion[self.labels.index(fallback)])

    def macro_f1_except(self, fallback: str | None) -> float | None:
        """Macro-F1 leaving out a fallback label that is a route (is_route; its rows still lower their gold
        labels' recall)."""
        route = fallback if self.is_route(fallback) else None
        seen = [s.f1 for label, s in self.per_label.items() if (s.support or s.predicted) and label != route]
        return sum(seen) / len(seen) if seen else None

    def without_prediction(self, label: str) -> Metrics:
        """The metrics of the items not predicted as `label` (e.g. a fallback label: the rows answered)."""
        counts = Counter()
        for i, gold in enumerate(self.labels):
            for j, pred in enumerate(self.labels):
                if pred != label and self.confusion[i][j]:
                    counts[(gold, pred)] += self.confusion[i][j]
        return Metrics.from_counts(counts, [name for name in self.labels if name != label])

    def to_dict(self) -> dict:
        return {
            "items": self.num_items, "accuracy": self.accuracy, "macro_f1": self.macro_f1,
            "per_label": {label: {"precision": s.precision, "recall": s.recall, "f1": s.f1, "support": s.support}
                          for label, s in self.per_label.items()},
            "labels": list(self.labels), "confusion": [list(row) for row in self.confusion],
        }


@dataclass(frozen=True)
class FloorPoint:
    """What a fallback floor at `min_prob` does to a labelled run: how many items it still answers (their
    probability >= min_prob) and how many of those are right."""

    min_prob: float
    answered: int
    correct: int
    total: int

    @property
    def coverage(self) -> float:
        return self.answered / self.total if self.total else 0.0

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.answered if self.answered else None

    def to_dict(self) -> dict:
        return {"min_prob": self.min_prob, "answered": self.answered, "coverage": self.coverage,
                "accuracy": self.accuracy}


COVERAGES = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)


def as_min_prob(probability: float) -> float:
    """A probability rounded down to 3 decimals: a --min-prob that still answers the item it came from."""
    return math.floor(probability * 1000) / 1000


def floor_points(confidences: list[float], correct: list[bool], coverages=COVERAGES) -> list[FloorPoint]:
    """For each coverage c, a floor that answers at least c of the items (the probability of the ceil(c * n)-th
    most confident one, rounded down to 3 decimals: a value to pass as --min-prob), with what it answers and how
    many of those are right. An item with probability p is answered by a floor t when p >= t, as the
    classifier's --min-prob does."""
    ranked = sorted(zip(confidences, correct, strict=True), key=lambda pair: -pair[0])
    total, points = len(ranked), []
    for c in coverages:
        if not total:
            break
        floor = as_min_prob(ranked[max(1, math.ceil(c * total - 1e-9)) - 1][0])
        kept = [ok for p, ok in ranked if p >= floor]
        point = FloorPoint(floor, len(kept), sum(kept), total)
        if not points or point.answered != points[-1].answered:
            points.append(point)
    return points


def floor_for_accuracy(confidences: list[float], correct: list[bool], target: float) -> FloorPoint | None:
    """The floor (a --min-prob, 3 decimals) that answers the most items while the items it answers are right at
    least `target` of the time, or None when no floor gets there. Every floor a probability rounds down to is
    tried (at most 1001), since the accuracy of the items kept need not rise with the floor."""
    if not 0 < target <= 1:
        raise ValueError(f"a target accuracy is a share in (0, 1], e.g. 0.9 for 90%; got {target!r}")
    ranked = sorted(zip(confidences, correct, strict=True), key=lambda pair: -pair[0])
    best, answered, right = None, 0, 0
    for floor in sorted({as_min_prob(p) for p, _ in ranked}, reverse=True):
        while answered < len(ranked) and ranked[answered][0] >= floor:
            right += ranked[answered][1]
            answered += 1
        if right >= target * answered - 1e-9:
            best = FloorPoint(floor, answered, right, len(ranked))
    return best


def check_plotting(path) -> None:
    """Raise ValueError unless a PNG can be plotted to `path` (matplotlib installed, a .png name)."""
    import importlib.util

    if Path(path).suffix.lower() != ".png":
        raise ValueError(f"--plot {str(path)!r} must end in .png")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'slimroute[plot]'")


def plot_confusion(metrics: Metrics, path, title: str = "") -> Path:
    """A confusion-matrix heat map (rows: gold, columns: predicted) as a PNG."""
    check_plotting(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path, n = Path(path), len(metrics.labels)
    size = 2.5 + 0.6 * n
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(metrics.confusion, cmap="Blues")
    ax.set_xticks(range(n), metrics.labels, rotation=45, ha="right")
    ax.set_yticks(range(n), metrics.labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    top = max((max(row) for row in metrics.confusion), default=0)
    for i, row in enumerate(metrics.confusion):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center", color="white" if count > top / 2 else "black")
    accuracy = "-" if metrics.accuracy is None else f"{100 * metrics.accuracy:.1f}%"
    macro = "-" if metrics.macro_f1 is None else f"{metrics.macro_f1:.3f}"
    ax.set_title(f"{title + ': ' if title else ''}accuracy {accuracy}, macro-F1 {macro} ({metrics.num_items} items)")
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
