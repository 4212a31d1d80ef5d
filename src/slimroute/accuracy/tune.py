"""Tune a head on labelled texts: features from the fast engine, a cross-validated linear classifier.

`tune_head(engine, texts, labels)`: every text runs once through the engine (batched, prefix cache), its
head features (engine.features: by default the last hidden state and the mean over the item's tokens) are
standardised, and each candidate classifier is scored under stratified K-fold cross-validation (the scaler
is fitted inside each fold): a multinomial LogisticRegression for each regularisation strength C of a small
grid, and linear discriminant analysis with Ledoit-Wolf shrinkage ("lda", which does better than the
logistic regression with a handful of rows per label: BANKING77 at 8 per intent). The candidate with the best
out-of-fold accuracy is refitted on all rows; its out-of-fold accuracy and macro-F1 are reported (slightly
optimistic: the candidate is chosen on those same folds). Both are linear with softmax probabilities
(multiclass LDA's predict_proba is the softmax of its decision function), so either becomes the same head.

Layers (`layer="auto"`, the default): the features may also hold the mean over the item's tokens of one decoder
layer's output from the middle of the model, read in the same forward pass. The candidates (none, and the layers
a quarter, half and three quarters of the way up) are scored first, each with the cheap LDA under the same
folds; the best (ties: fewer features) then goes through the classifier search above. On BANKING77 the layer a
quarter of the way up, beside the final states, added 4 points of CV accuracy at 8 examples per intent (2.9 on
the held-out rows).
"""

from __future__ import annotations

import shlex
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version

import numpy as np
import torch

from slimroute.accuracy.calibration import CONTENT_FREE_TEXTS
from slimroute.accuracy.head import Head, task_spec
from slimroute.runtime.fingerprint import identity
from slimroute.runtime.packaged import PACKAGED_MODELS
from slimroute.task import Task

DEFAULT_CS = (0.01, 0.03, 0.1, 0.3, 1.0)
CLASSIFIERS = ("auto", "logistic", "lda")  # auto: whichever scores best in cross-validation
LAYER_DEPTHS = (0.25, 0.5, 0.75)  # where layer="auto" looks, as fractions of the model's depth


@dataclass(frozen=True)
class TuneConfig:
    folds: int = 5  # stratified cross-validation folds; every label needs at least this many examples
    cs: tuple[float, ...] = DEFAULT_CS  # inverse regularisation strengths tried
    with_label_logprobs: bool = False  # add the task labels' log-probs to the hidden state as features
    with_mean: bool = True  # add the mean of the item's hidden states to its last one (head.item_states)
    classifier: str = "auto"  # one of CLASSIFIERS
    layer: int | str | None = "auto"  # a decoder layer whose mean joins the features: "auto" (by CV), None, or k
    max_iter: int = 2000
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.folds, int) or self.folds < 2:
            raise ValueError(f"folds must be an integer >= 2, got {self.folds!r}")
        if not self.cs or any(not c > 0 for c in self.cs):
            raise ValueError(f"cs must be a non-empty list of positive numbers, got {self.cs!r}")
        object.__setattr__(self, "cs", tuple(float(c) for c in self.cs))
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {', '.join(CLASSIFIERS)}, got {self.classifier!r}")
        if not (self.layer in ("auto", None) or (isinstance(self.layer, int) and self.layer >= 1)):
            raise ValueError(f"layer must be 'auto', None or a decoder layer number >= 1, got {self.layer!r}")

    def layer_options(self, depth: int) -> list[tuple[int, ...]]:
        """The layer sets tried, in the order ties are broken: () is the final states alone. depth: the model's
        number of decoder layers (a layer must be below it: the last one's output is the final state)."""
        if self.layer is None:
            return [()]
        if self.layer != "auto":
            if self.layer >= depth:
                raise ValueError(f"layer {self.layer}: the model has {depth} decoder layers; give 1 to {depth - 1}")
            return [(self.layer,)]
        return [()] + [(k,) for k in sorted({max(1, round(depth * f)) for f in LAYER_DEPTHS}) if k < depth]

    @property
    def states(self) -> str:
        """The hidden states the head reads (head.item_states)."""
        return "last+mean" if self.with_mean else "last"

    @property
    def features(self) -> str:
        """The head's feature set (head.FEATURE_SETS)."""
        return "hidden" + ("+mean" if self.with_mean else "") + ("+label-logprobs" if self.with_label_logprobs else "")

    def candidates(self) -> dict[str, tuple[str, float | None]]:
        """name -> (classifier, C), in the order ties are broken (stronger regularisation first)."""
        found = {}
        if self.classifier in ("auto", "logistic"):
            found.update({f"logistic C={c:g}": ("logistic", c) for c in self.cs})
        if self.classifier in ("auto", "lda"):
            found["lda"] = ("lda", None)
        return found


@dataclass(frozen=True)
class CVReport:
    folds: int
    classifier: str  # the chosen candidate: "logistic" or "lda"
    c: float | None  # the chosen inverse regularisation strength (logistic; None for lda)
    accuracy: float  # out-of-fold, of the chosen candidate
    macro_f1: float
    scores: dict  # candidate name (TuneConfig.candidates) -> out-of-fold accuracy
    temperature: float = 1.0  # the head's logits are the classifier's divided by this (fit_temperature)
    layers: tuple[int, ...] = ()  # the decoder layers whose means joined the features
    layer_scores: dict = field(default_factory=dict)  # layer option name -> out-of-fold accuracy with LDA

    @property
    def chosen(self) -> str:
        return f"logistic C={self.c:g}" if self.classifier == "logistic" else self.classifier

    def to_dict(self) -> dict:
        return asdict(self)


def labelled_rows(rows, label_column: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of input rows (data.Row); a row without a usable text or label is a ValueError."""
    texts, labels = [], []
    for row in rows:
        if row.error:
            raise ValueError(f"row {row.index} (id {row.id}): {row.error}; every row needs a text to tune on")
        if row.gold is None:
            raise ValueError(f"row {row.index} (id {row.id}) has no label in column {label_column!r}")
        texts.append(row.text)
        labels.append(row.gold)
    return texts, labels


def check_labelled(texts: list[str], labels: list[str], folds: int) -> list[str]:
    """The distinct labels, sorted; ValueError naming the problem when tuning cannot work on these rows."""
    if len(texts) != len(labels):
        raise ValueError(f"got {len(texts)} texts but {len(labels)} labels")
    if not texts:
        raise ValueError("no labelled rows: the input is empty")
    for i, (text, label) in enumerate(zip(texts, labels, strict=True)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"row {i}: the text is empty or not a string ({text!r})")
        if not isinstance(label, str) or not label.strip():
            raise ValueError(f"row {i}: the label is empty or not a string ({label!r})")
    counts = Counter(labels)
    if len(counts) < 2:
        raise ValueError(f"only one label ({next(iter(counts))!r}) in the rows; a head needs at least two")
    label, fewest = min(counts.items(), key=lambda kv: (kv[1], kv[0]))
    if fewest < folds:
        raise ValueError(f"label {label!r} has {fewest} example{'s' if fewest != 1 else ''}; tuning needs at least "
                         f"{folds} per label ({folds}-fold cross-validation)")
    return sorted(counts)


def fit_head(features: np.ndarray, y: np.ndarray, config: TuneConfig) -> tuple[dict, CVReport]:
    """features (N, F), y (N,) ints 0..C-1 -> the head's tensors (on standardised features) and its CV report."""
    from sklearn.metrics import f1_score
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    candidates = config.candidates()
    scores, logits = _cv_scores(features, y, config)
    oof = {name: values.argmax(axis=1) for name, values in logits.items()}
    # BLAS threads as many as torch's (--threads): on a busy 2-core CPU, spare threads only spin (10x slower).
    with threadpool_limits(limits=torch.get_num_threads()):
        best = max(candidates, key=lambda name: scores[name])  # ties: the first (stronger regularisation)
        kind, c = candidates[best]
        temperature = fit_temperature(logits[best], y)
        report = CVReport(config.folds, kind, c, scores[best], float(f1_score(y, oof[best], average="macro")), scores,
                          temperature)
        scaler = StandardScaler().fit(features)
        final = _classifier(kind, c, config).fit(scaler.transform(features), y)
    weight, bias = final.coef_, final.intercept_
    if weight.shape[0] == 1:  # two labels: sklearn keeps one logit (label 1 vs 0); softmax([0, t]) = sigmoid(t)
        weight, bias = np.vstack([np.zeros_like(weight), weight]), np.concatenate([[0.0], bias])
    weight, bias = weight / temperature, bias / temperature  # the same decisions, calibrated probabilities
    tensors = {"weight": weight, "bias": bias, "mean": scaler.mean_, "std": scaler.scale_}
    return {k: torch.tensor(np.asarray(v), dtype=torch.float64) for k, v in tensors.items()}, report


def _cv_scores(features: np.ndarray, y: np.ndarray, config: TuneConfig) -> tuple[dict, dict]:
    """Each candidate's out-of-fold accuracy and (N, C) logits, under the config's stratified folds."""
    from sklearn.metrics import accuracy_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    folds = StratifiedKFold(config.folds, shuffle=True, random_state=config.seed)
    with threadpool_limits(limits=torch.get_num_threads()):
        logits = {name: _logits(cross_val_predict(make_pipeline(StandardScaler(), _classifier(kind, c, config)),
                                                  features, y, cv=folds, method="decision_function"))
                  for name, (kind, c) in config.candidates().items()}  # out-of-fold (N, C)
    return {name: float(accuracy_score(y, values.argmax(axis=1))) for name, values in logits.items()}, logits


def _logits(decision: np.ndarray) -> np.ndarray:
    """sklearn's decision_function -> (N, C) logits; two labels give one column (label 1 vs 0)."""
    return np.stack([np.zeros_like(decision), decision], axis=1) if decision.ndim == 1 else decision


def fit_temperature(logits: np.ndarray, y: np.ndarray) -> float:
    """The T > 0 that minimises the out-of-fold log-loss of softmax(logits / T) (temperature scaling, Guo et
    al. 2017). It leaves every decision as it was and makes the probabilities honest: LDA's logits, fitted on a
    few rows per label, run to hundreds (every answer "certain") and magnify the last bits of the hidden
    state (fp32 kernels' 1e-5 became 6e-4 in log-prob); scaled, they mean what they say."""
    from scipy.optimize import minimize_scalar
    from scipy.special import log_softmax

    def loss(log_t: float) -> float:
        return float(-log_softmax(logits / np.exp(log_t), axis=1)[np.arange(len(y)), y].mean())

    return float(np.exp(minimize_scalar(loss, bounds=(-5.0, 8.0), method="bounded").x))


def _classifier(kind: str, c: float | None, config: TuneConfig):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression

    if kind == "lda":
        return LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto")
    return LogisticRegression(C=c, max_iter=config.max_iter)


def tune_head(engine, texts: list[str], labels: list[str], config: TuneConfig | None = None,
              classes: list[str] | None = None, meta: dict | None = None, progress=None) -> tuple[Head, CVReport]:
    """Fit a head for `engine`'s model, tokenizer and task. classes: the head's labels in order (default:
    the distinct labels, sorted); meta: extra head.json fields (model spec, command)."""
    config = config or TuneConfig()
    found = check_labelled(texts, labels, config.folds)
    classes = list(classes or found)
    if set(classes) != set(found):
        raise ValueError(f"classes {classes} are not the labels found in the rows {found}")
    check_label_features(engine.task, classes, config.with_label_logprobs)
    options = config.layer_options(int(engine.model.config.num_hidden_layers))
    layers = tuple(sorted({k for option in options for k in option}))
    features = engine.features(texts, config.with_label_logprobs, progress, config.states, layers).numpy()  # (N, F)
    index = {label: j for j, label in enumerate(classes)}
    tensors, report = fit_tuned(features, np.array([index[label] for label in labels]), config, options,
                                int(engine.model.config.hidden_size))
    info = {"identity": identity(engine.model, engine.tokenizer, engine.task), "task": task_spec(engine.task),
            "cv": report.to_dict(), "num_examples": len(texts), "examples_per_label": dict(sorted(Counter(labels)
            .items())), "slimroute": version("slimroute"), **(meta or {})}
    return Head(tuple(classes), **tensors, features=config.features, meta=info, layers=report.layers), report


def parse_layer(text: str) -> int | str | None:
    """--layer: "auto", "none" or a decoder layer number."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--layer must be auto, none or a decoder layer number >= 1, got {text!r}")
    return int(text)


def layer_name(option: tuple[int, ...]) -> str:
    return "final states" if not option else "+ layer " + ", ".join(map(str, option))


def option_columns(num_features: int, width: int, hidden: int, layers: list[int], option: tuple[int, ...]
                   ) -> np.ndarray:
    """The columns of features laid out as [final states (width), the mean of each of `layers` (hidden each),
    label log-probs (the rest)] that a head reading the layers of `option` takes."""
    picked = [np.arange(width)] + [width + hidden * layers.index(k) + np.arange(hidden) for k in option]
    return np.concatenate(picked + [np.arange(width + hidden * len(layers), num_features)])


def fit_tuned(features: np.ndarray, y: np.ndarray, config: TuneConfig, options: list[tuple[int, ...]],
              hidden: int) -> tuple[dict, CVReport]:
    """fit_head after choosing the layer option. features (N, F): the final states (config.states), then the
    mean of each layer in sorted(union of options), H each, then the label log-probs if the config has them."""
    layers = sorted({k for option in options for k in option})

    def columns(option: tuple[int, ...]) -> np.ndarray:
        return option_columns(features.shape[1], hidden * (2 if config.with_mean else 1), hidden, layers, option)

    scores = {}
    if len(options) > 1:
        lda = replace(config, classifier="lda")
        scores = {layer_name(option): _cv_scores(features[:, columns(option)], y, lda)[0]["lda"] for option in options}
    best = max(options, key=lambda option: scores.get(layer_name(option), 0.0))  # ties: the first (fewer features)
    tensors, report = fit_head(features[:, columns(best)], y, config)
    return tensors, replace(report, layers=best, layer_scores=scores)


DESCRIPTION_SCALE = 100.0  # logits = scale x cosine similarity: sets the head's probabilities, not its decisions


def description_task(task: Task) -> Task:
    """The prompt a description head reads items through: the task's labels, instructions and examples, its
    label descriptions left out (they become the prototypes instead; in the system prompt too they cost
    accuracy: 88% against 98.5% on 200 sample tickets, int8). The task's truncate_tokens is left out too: the
    descriptions are read whole (description_head records the cap for the items)."""
    check_described(task.labels, dict(task.descriptions))
    return Task(task.labels, task.instructions, task.examples)


def description_head(engine, descriptions: dict[str, str], meta: dict | None = None,
                     scale: float = DESCRIPTION_SCALE, centre_texts: tuple[str, ...] = CONTENT_FREE_TEXTS,
                     truncate_tokens: int | None = None) -> Head:
    """A head from label descriptions alone, no labelled rows (`slimroute tune --from-descriptions`).

    engine: the model and prompt (description_task); descriptions: label -> text, for each of its task's labels.
    Each "label: description" runs through the engine as an item; the mean of its final hidden states over its
    tokens is the label's prototype. The content-free texts run too; their average is the centre. The head
    scores an item by the cosine similarity between its mean state and each prototype, both taken from the
    centre: features "mean", standardised with mean = centre and std = 1, normalised to unit length; weight
    rows = scale x the unit vectors from the centre to the prototypes; bias 0. truncate_tokens: the cap the head's
    task records for the items it will score (the descriptions themselves are read whole by the engine's task)."""
    labels = engine.task.labels
    check_described(labels, descriptions)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    texts = [f"{label}: {descriptions[label]}" for label in labels]
    prototypes = engine.features(texts, states="mean")  # (C, H)
    centre = engine.features(list(centre_texts), states="mean").mean(dim=0)  # (H,)
    directions = prototypes - centre
    weight = scale * directions / directions.norm(dim=1, keepdim=True)
    info = {"identity": identity(engine.model, engine.tokenizer, engine.task),
            "task": task_spec(replace(engine.task, truncate_tokens=truncate_tokens)),
            "from_descriptions": {"prototypes": texts, "centre_texts": list(centre_texts), "scale": scale},
            "slimroute": version("slimroute"), **(meta or {})}
    return Head(labels, weight, torch.zeros(len(labels), dtype=torch.float64), centre, torch.ones_like(centre),
                features="mean", meta=info, normalize=True)


def check_described(labels, descriptions: dict[str, str]) -> None:
    missing = [label for label in labels if not descriptions.get(label)]
    if missing:
        raise ValueError(f"--from-descriptions needs a description for every label; {', '.join(map(repr, missing))} "
                         "has none (give labels as {name, description} in the task file)")


def check_label_features(task: Task, classes: list[str], with_label_logprobs: bool) -> None:
    if with_label_logprobs and set(task.labels) != set(classes):
        raise ValueError(f"--with-label-logprobs needs the task's labels to be the head's labels; the task has "
                         f"{list(task.labels)}, the rows {sorted(classes)}")


def head_meta(model: str, dtype: str, input) -> dict:
    """What head.json records about how the head was made (beside its identity, task and scores)."""
    packaged = PACKAGED_MODELS.get(model)
    return {"model": model, "model_sha256": packaged.sha256 if packaged else None, "dtype": dtype,
            "input": str(input), "command": shlex.join(["slimroute", *sys.argv[1:]])}


def summary_rows(head: Head, report: CVReport, labels: list[str]) -> list[tuple[str, str]]:
    counts = Counter(labels)
    candidates = ", ".join(f"{name} {100 * acc:.1f}%" for name, acc in report.scores.items())
    layers = f" + mean of layer {', '.join(map(str, head.layers))}" if head.layers else ""
    if report.layer_scores:
        tried = ", ".join(f"{name} {100 * acc:.1f}%" for name, acc in report.layer_scores.items())
        layers += f" (LDA CV: {tried})"
    return [("rows", f"{len(labels)} ({len(counts)} labels, {min(counts.values())} to {max(counts.values())} "
                     "per label)"),
            ("features", f"{head.features}{layers} ({head.weight.shape[1]})"),
            ("classifier", f"{report.chosen} (of {candidates})"),
            ("CV accuracy", f"{100 * report.accuracy:.1f}%"),
            ("CV macro-F1", f"{100 * report.macro_f1:.1f}%")]
