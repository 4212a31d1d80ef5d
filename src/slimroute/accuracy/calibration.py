"""Calibration: offsets subtracted from the label tokens' exact log-probs before the decision.

Offsets are kept per label and per label token (`values[i][k]` for label i's k-th token), so both
decision rules stay as they are and see calibrated per-token scores lp[i][k] - values[i][k]:
- max-prob compares label totals, which become total_i - sum_k values[i][k];
- greedy compares, at each step, the allowed next tokens' calibrated scores; labels sharing a path
  share its context, so the mean-based modes give them the same offset there.
Modes (`MODES`):
- content-free (Zhao et al. 2021): values = each token's mean log-prob over content-free inputs
  (`CONTENT_FREE_TEXTS`), scored once per task;
- batch (Zhou et al. 2023): values = each token's mean log-prob over a batch of real inputs (in a stream:
  the first window; see jobs.run_job), then fixed;
- fitted: one offset per label, on its last token, fitted to gold labels by maximum likelihood of
  p(label) = softmax(total - offset) (a few Newton steps; `fit_offsets`).
Both the reference and the engine apply the same `Offsets` through labels.make_prediction, so the
fast path still equals the reference; the model's own log-probs are kept next to the calibrated ones.
Calibration is for the label tokens' log-probs only: a tuned head (head.py) is refused (`check_head`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slimroute.io.durable import input_fingerprint
from slimroute.io.rows import read_labelled
from slimroute.labels import Prediction

MODES = ("none", "content-free", "batch", "fitted")
CONTENT_FREE_TEXTS = ("", "N/A", "[MASK]")  # "" is scored directly: only the row reader refuses empty texts
WITH_HEAD = ("--calibrate {mode} does not apply to a tuned head, whose per-label biases are already fitted on "
             "labelled rows; use --calibrate none with --head")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"calibrate must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_head(head, calibration) -> None:
    """Raise ValueError for calibration (offsets or a mode other than none) together with a tuned head: its
    answers are a softmax fitted on labelled rows, not label tokens (content-free texts lie outside what
    it saw, a batch mean would undo the label frequencies it learnt, and its bias is already a fitted offset)."""
    mode = getattr(calibration, "mode", "none") if calibration is not None else "none"
    if head is not None and mode != "none":
        raise ValueError(WITH_HEAD.format(mode=mode))


@dataclass(frozen=True)
class Offsets:
    mode: str  # content-free, batch or fitted
    labels: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]  # [label][token], subtracted from that token's log-prob
    num_inputs: int  # texts the offsets were estimated or fitted from
    source: str = ""  # what they came from, for the summary

    def __post_init__(self):
        if self.mode not in MODES[1:]:
            raise ValueError(f"offsets: mode must be one of {', '.join(MODES[1:])}, got {self.mode!r}")
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "values", tuple(tuple(float(v) for v in vs) for vs in self.values))
        if len(self.values) != len(self.labels):
            raise ValueError(f"offsets: {len(self.values)} offset lists for {len(self.labels)} labels")
        for label, vs in zip(self.labels, self.values, strict=True):
            if not vs or not all(math.isfinite(v) for v in vs):
                raise ValueError(f"offsets: label {label!r} needs finite offsets, one per token, got {vs!r}")

    def check(self, labels, label_ids) -> Offsets:
        """Raise unless these offsets fit the task's labels and their tokenisation."""
        if tuple(labels) != self.labels:
            raise ValueError(f"offsets are for the labels {list(self.labels)}, not {list(labels)}")
        for label, ids, vs in zip(self.labels, label_ids, self.values, strict=True):
            if len(ids) != len(vs):
                raise ValueError(f"offsets for {label!r} have {len(vs)} token(s) but the label has {len(ids)} "
                                 "with this tokenizer; estimate them with the same model")
        return self

    def totals(self) -> dict[str, float]:
        """Each label's offset on its total log-prob (what max-prob subtracts)."""
        return {label: math.fsum(vs) for label, vs in zip(self.labels, self.values, strict=True)}

    def to_dict(self) -> dict:
        return {"mode": self.mode, "labels": list(self.labels), "values": [list(vs) for vs in self.values],
                "num_inputs": self.num_inputs, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> Offsets:
        try:
            return cls(data["mode"], tuple(data["labels"]), tuple(map(tuple, data["values"])),
                       int(data["num_inputs"]), str(data.get("source", "")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"offsets: not an offsets record ({exc!r}); expected mode, labels, values") from exc

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path) -> Offsets:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _scored(predictions: list[Prediction]) -> list[Prediction]:
    """The predictions that carry the model's per-token log-probs (error rows carry none)."""
    return [p for p in predictions if p.error is None and p.token_logprobs]


def estimate_offsets(mode: str, predictions: list[Prediction], labels, source: str = "") -> Offsets:
    """Mean-based offsets (content-free or batch): each label token's mean log-prob over the predictions."""
    scored = _scored(predictions)
    if not scored:
        raise ValueError(f"{mode} calibration needs at least one scored text, got none")
    values = []
    for i in range(len(labels)):
        steps = len(scored[0].token_logprobs[i])
        values.append(tuple(math.fsum(p.token_logprobs[i][k] for p in scored) / len(scored) for k in range(steps)))
    return Offsets(mode, tuple(labels), tuple(values), len(scored), source)


def fit_offsets(predictions: list[Prediction], golds: list[str], labels, source: str = "", l2: float = 1e-3,
                max_steps: int = 50) -> Offsets:
    """Per-label offsets that maximise the mean log-likelihood of the gold labels under
    p(label | text) = softmax over labels of (total log-prob - offset), with a small L2 penalty
    (it fixes the free constant and keeps the fit finite). Newton's method with step halving."""
    labels = tuple(labels)
    pairs = [(p, g) for p, g in zip(predictions, golds, strict=True) if p.error is None and p.token_logprobs]
    check_golds([g for _, g in pairs], labels)
    totals = np.array([[math.fsum(lps) for lps in p.token_logprobs] for p, _ in pairs])  # (N, L)
    onehot = np.eye(len(labels))[[labels.index(g) for _, g in pairs]]  # (N, L)
    shift = np.zeros(len(labels))  # added to the totals; the offsets are its negative

    def loss(c):
        s = totals + c
        top = s.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(s - top).sum(axis=1))
        return -(s * onehot).sum(axis=1).mean() + lse.mean() + 0.5 * l2 * c @ c

    for _ in range(max_steps):
        s = totals + shift
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)  # (N, L)
        grad = p.mean(axis=0) - onehot.mean(axis=0) + l2 * shift
        if np.abs(grad).max() < 1e-10:
            break
        hess = np.diag(p.mean(axis=0)) - p.T @ p / len(p) + l2 * np.eye(len(labels))
        step, before = np.linalg.solve(hess, grad), loss(shift)
        while loss(shift - step) > before and np.abs(step).max() > 1e-12:
            step = step / 2
        shift = shift - step
    values = tuple((0.0,) * (len(lps) - 1) + (-float(c),) for lps, c in zip(pairs[0][0].token_logprobs, shift,
                                                                             strict=True))
    return Offsets("fitted", labels, values, len(pairs), source)


def check_golds(golds: list[str], labels) -> None:
    unknown = sorted({g for g in golds if g not in labels})
    if unknown:
        raise ValueError(f"calibration data: gold label {unknown[0]!r} is not one of the labels {list(labels)}")
    missing = [label for label in labels if label not in set(golds)]
    if missing:
        raise ValueError(f"fitted calibration needs labelled rows of every label; {missing[0]!r} has none")


def content_free_offsets(classifier, labels, texts=CONTENT_FREE_TEXTS) -> Offsets:
    """Score the content-free texts once with `classifier` (an Engine or ReferenceClassifier)."""
    names = ", ".join(repr(t) for t in texts)
    return estimate_offsets("content-free", classifier.classify(list(texts)), labels, f"content-free inputs {names}")


@dataclass(frozen=True)
class CalibrationSettings:
    """--calibrate and --calibration-data: the mode and the file its offsets are estimated or fitted from
    (fitted: labelled rows; batch: texts, else the run's first window)."""

    mode: str = "none"
    data: Path | None = None
    text_column: str = "text"
    label_column: str = "label"

    def __post_init__(self):
        check_mode(self.mode)
        if self.data is not None and self.mode not in ("batch", "fitted"):
            raise ValueError(f"--calibration-data is used by --calibrate batch or fitted, not {self.mode!r}")
        if self.mode == "fitted" and self.data is None:
            raise ValueError("--calibrate fitted needs labelled rows: pass --calibration-data labelled.csv")

    @property
    def on(self) -> bool:
        return self.mode != "none"

    def fingerprint(self) -> dict | None:
        """What the offsets depend on besides the model and task (for a job's resume check)."""
        if not self.on:
            return None
        record: dict = {"mode": self.mode}
        if self.mode == "content-free":
            record["inputs"] = list(CONTENT_FREE_TEXTS)
        if self.data is not None:
            if not Path(self.data).is_file():
                raise ValueError(f"calibration data {str(self.data)!r} does not exist; check the path")
            fp = input_fingerprint(self.data)
            record["data"] = {"sha256": fp["sha256"], "size": fp["size"],
                              "columns": [self.text_column, self.label_column if self.mode == "fitted" else None]}
        return record

    def read_data(self) -> tuple[list[str] | None, list[str] | None]:
        """(texts, gold labels) of the calibration data; (None, None) without a file."""
        if self.data is None:
            return None, None
        label_column = self.label_column if self.mode == "fitted" else None
        pairs = read_labelled(self.data, self.text_column, label_column, "calibration data")
        return [t for t, _ in pairs], ([g for _, g in pairs] if label_column else None)

    def check_data(self, labels, head=None) -> None:
        """Raise ValueError if this cannot calibrate these labels: a tuned head (check_head), or calibration
        data that does not fit them (it is read here)."""
        check_head(head, self)
        texts, golds = self.read_data()
        if golds is not None:
            check_golds(golds, labels)

    def offsets(self, classifier, labels) -> Offsets | None:
        """Estimate or fit the offsets with `classifier`; None when off, or for batch without a file."""
        texts, golds = self.read_data()
        return prepare_offsets(classifier, self.mode, labels, texts, golds, str(self.data) if self.data else "")


def prepare_offsets(classifier, mode: str, labels, texts=None, golds=None, source: str = "") -> Offsets | None:
    """The offsets a run starts with: None for `none`, and for `batch` without texts (the run then
    estimates them from its first window). `texts` (and `golds` for fitted) are the calibration data."""
    check_mode(mode)
    if mode == "none":
        return None
    if mode == "content-free":
        return content_free_offsets(classifier, labels)
    if mode == "fitted" and (texts is None or golds is None):
        raise ValueError("--calibrate fitted needs labelled rows: pass --calibration-data labelled.csv")
    if texts is None:
        return None
    if not texts:
        raise ValueError(f"{mode} calibration data has no usable rows")
    predictions = classifier.classify(list(texts))
    if mode == "batch":
        return estimate_offsets("batch", predictions, labels, source)
    return fit_offsets(predictions, list(golds), labels, source)


def calibrated(classifier, settings: CalibrationSettings, stored: dict | None = None):
    """(the classifier deciding with the run's offsets, the offsets): `stored` ones (a resumed job's),
    else estimated or fitted now with `classifier`; None when off, or for batch offsets that wait for the
    run's first window."""
    if stored is not None:
        offsets = Offsets.from_dict(stored)
    elif not settings.on:
        return classifier, None
    else:
        offsets = settings.offsets(classifier, classifier.labels)
    return (classifier.with_calibration(offsets) if offsets is not None else classifier), offsets
