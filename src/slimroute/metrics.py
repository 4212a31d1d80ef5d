"""Classification metrics from (gold, predicted) counts, and a confusion-matrix PNG.

Accuracy is the share of items whose predicted label is the gold one. Per label: precision (of the
items predicted as it), recall (of its gold items), F1 and support (its gold items); a ratio with
nothing to divide by is 0. Macro-F1 is the unweighted mean F1 over the labels that occur as gold or as
prediction (as scikit-learn's default `f1_score(average="macro")` does). Plain Python; the plot needs
matplotlib (the `plot` extra).
"""

from __future__ import annotations

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
        seen = [s.f1 for s in self.per_label.values() if s.support or s.predicted]
        return sum(seen) / len(seen) if seen else None

    def to_dict(self) -> dict:
        return {
            "items": self.num_items, "accuracy": self.accuracy, "macro_f1": self.macro_f1,
            "per_label": {label: {"precision": s.precision, "recall": s.recall, "f1": s.f1, "support": s.support}
                          for label, s in self.per_label.items()},
            "labels": list(self.labels), "confusion": [list(row) for row in self.confusion],
        }


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
