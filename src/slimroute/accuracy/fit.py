"""Fit a head's linear classifier on feature rows, every choice made by stratified cross-validation on those rows.

`fit_head(x, y, config)`: the features are standardised and each candidate classifier (tune.TuneConfig.candidates)
is scored out of fold (the scaler fitted inside each fold): a multinomial LogisticRegression for each C of a small
grid — walked from the strongest regularisation up, each fit warm-started from the last, as LogisticRegressionCV
walks its path — and linear discriminant analysis with Ledoit-Wolf shrinkage ("lda", which does better with a
handful of rows per label). The best is refitted on every row; its out-of-fold accuracy and macro-F1 are reported
(slightly optimistic: the candidate is chosen on those same folds), and its logits divided by one temperature.

`fit_options(candidates, y, ...)`: before that, which features: the prompt they were read through (prompts.py),
whether the label rows join the training rows, and which middle layer's mean joins the final states. Each option
is scored with the cheap LDA under the same folds; the best (ties: the first listed — the task's prompt, no label
rows, fewer layers) goes through fit_head. Label rows (`extra`) only ever join the rows a classifier is fitted on
(each fold's training part, then the refit), never the rows it is scored on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch


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
    prompt: str = "task"  # the prompt the features were read through (prompts.prompt_tasks)
    label_rows: str = "none"  # "names": the label rows joined the training rows
    option_scores: dict = field(default_factory=dict)  # option name -> out-of-fold accuracy with LDA (fit_options)

    @property
    def chosen(self) -> str:
        return f"logistic C={self.c:g}" if self.classifier == "logistic" else self.classifier

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Candidate:
    """Features read through one prompt: the rows' x (N, F) and the label rows' extra (M, F), each laid out as
    [final states (width), the mean of each of `layers` (hidden each), the label log-probs (the rest)]."""

    x: np.ndarray
    extra: np.ndarray
    config: object  # the tune.TuneConfig resolved for this prompt (its states, classifiers, folds)
    layer_options: list[tuple[int, ...]]  # the layer sets tried, in the order ties are broken
    hidden: int

    @property
    def layers(self) -> list[int]:
        return sorted({k for option in self.layer_options for k in option})

    def columns(self, option: tuple[int, ...]) -> np.ndarray:
        width = self.hidden * (2 if self.config.with_mean else 1)
        return option_columns(self.x.shape[1], width, self.hidden, self.layers, option)


def option_columns(num_features: int, width: int, hidden: int, layers: list[int], option: tuple[int, ...]
                   ) -> np.ndarray:
    """The columns of features laid out as [final states (width), the mean of each of `layers` (hidden each),
    label log-probs (the rest)] that a head reading the layers of `option` takes."""
    picked = [np.arange(width)] + [width + hidden * layers.index(k) + np.arange(hidden) for k in option]
    return np.concatenate(picked + [np.arange(width + hidden * len(layers), num_features)])


def option_name(prompt: str, label_rows: str, layers: tuple[int, ...]) -> str:
    parts = [f"{prompt} prompt"] + [f"layer {k}" for k in layers] + (["label rows"] if label_rows == "names" else [])
    return " + ".join(parts)


def fit_options(candidates: dict[str, Candidate], y: np.ndarray, extra_y: np.ndarray, label_rows: list[str]
                ) -> tuple[str, dict, CVReport]:
    """(the chosen prompt's name, the head's tensors, its report): each option (prompt x label rows x layer set)
    scored with LDA when there is more than one, the best through fit_head. label_rows: the settings tried, of
    "none" and "names"."""
    options = [(prompt, rows, layers) for prompt, found in candidates.items() for rows in label_rows
               for layers in found.layer_options]

    def pieces(option):
        found = candidates[option[0]]
        columns = found.columns(option[2])
        extra = found.extra[:, columns] if option[1] == "names" else found.extra[:0, columns]
        return found.x[:, columns], extra, extra_y[:len(extra)], found.config

    scores = {}
    if len(options) > 1:
        for option in options:
            x, extra, ey, config = pieces(option)
            lda = replace(config, classifier="lda")
            scores[option_name(*option)] = _cv_scores(x, y, lda, extra, ey)[0]["lda"]
    best = max(options, key=lambda option: scores.get(option_name(*option), 0.0))  # ties: the first
    x, extra, ey, config = pieces(best)
    tensors, report = fit_head(x, y, config, extra, ey)
    return best[0], tensors, replace(report, prompt=best[0], label_rows=best[1], layers=best[2],
                                     option_scores=scores)


def fit_head(features: np.ndarray, y: np.ndarray, config, extra: np.ndarray | None = None,
             extra_y: np.ndarray | None = None) -> tuple[dict, CVReport]:
    """features (N, F), y (N,) ints 0..C-1 [+ extra (M, F), extra_y (M,): rows fitted on, never scored] -> the
    head's tensors (on standardised features) and its CV report."""
    from sklearn.metrics import f1_score
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    candidates = config.candidates()
    scores, logits = _cv_scores(features, y, config, extra, extra_y)
    best = max(candidates, key=lambda name: scores[name])  # ties: the first (stronger regularisation)
    kind, c = candidates[best]
    temperature = fit_temperature(logits[best], y)
    report = CVReport(config.folds, kind, c, scores[best],
                      float(f1_score(y, logits[best].argmax(axis=1), average="macro")), scores, temperature)
    fit_x, fit_y = _with_extra(features, y, extra, extra_y)
    # BLAS threads as many as torch's (--threads): on a busy 2-core CPU, spare threads only spin (10x slower).
    with threadpool_limits(limits=torch.get_num_threads()):
        scaler = StandardScaler().fit(fit_x)
        final = _classifier(kind, c, config).fit(scaler.transform(fit_x), fit_y)
    weight, bias = final.coef_, final.intercept_
    if weight.shape[0] == 1:  # two labels: sklearn keeps one logit (label 1 vs 0); softmax([0, t]) = sigmoid(t)
        weight, bias = np.vstack([np.zeros_like(weight), weight]), np.concatenate([[0.0], bias])
    weight, bias = weight / temperature, bias / temperature  # the same decisions, calibrated probabilities
    tensors = {"weight": weight, "bias": bias, "mean": scaler.mean_, "std": scaler.scale_}
    return {k: torch.tensor(np.asarray(v), dtype=torch.float64) for k, v in tensors.items()}, report


def _with_extra(x: np.ndarray, y: np.ndarray, extra: np.ndarray | None, extra_y: np.ndarray | None):
    if extra is None or not len(extra):
        return x, y
    return np.concatenate([x, extra]), np.concatenate([y, extra_y])


def _cv_scores(features: np.ndarray, y: np.ndarray, config, extra: np.ndarray | None = None,
               extra_y: np.ndarray | None = None) -> tuple[dict, dict]:
    """Each candidate's out-of-fold accuracy and (N, C) logits under the config's stratified folds, the extra rows
    added to every fold's training part."""
    from sklearn.model_selection import StratifiedKFold
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    candidates = config.candidates()
    logistic = sorted((c, name) for name, (kind, c) in candidates.items() if kind == "logistic")
    logits = {name: np.zeros((len(y), int(y.max()) + 1)) for name in candidates}  # out-of-fold (N, C)
    folds = StratifiedKFold(config.folds, shuffle=True, random_state=config.seed)
    with threadpool_limits(limits=torch.get_num_threads()):
        for train, test in folds.split(features, y):
            fit_x, fit_y = _with_extra(features[train], y[train], extra, extra_y)
            scaler = StandardScaler().fit(fit_x)
            fit_x, test_x = scaler.transform(fit_x), scaler.transform(features[test])
            if "lda" in candidates:
                logits["lda"][test] = _logits(_classifier("lda", None, config).fit(fit_x, fit_y)
                                              .decision_function(test_x))
            model = _classifier("logistic", 1.0, config, warm_start=True)
            for c, name in logistic:  # the strongest regularisation first, each fit starting from the last
                logits[name][test] = _logits(model.set_params(C=c).fit(fit_x, fit_y).decision_function(test_x))
    return {name: float((values.argmax(axis=1) == y).mean()) for name, values in logits.items()}, logits


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


def _classifier(kind: str, c: float | None, config, warm_start: bool = False):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression

    if kind == "lda":
        return LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto")
    return LogisticRegression(C=c, max_iter=config.max_iter, warm_start=warm_start)
