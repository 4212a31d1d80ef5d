"""A scikit-learn classifier over texts: `SlimRouteClassifier(model=...).fit(texts, labels).predict(texts)`.

`fit` tunes a head (tune.py, mode="head") on the fast engine's features of the texts, or fits per-label
calibration offsets (calibration.fit_offsets, mode="calibration") to the model's zero-shot label log-probs
over the classes; `predict` / `predict_proba` classify with the fast engine and that head, or those offsets.
As scikit-learn expects, the constructor only stores its parameters and fitted state ends in `_`, so `clone`,
`GridSearchCV` and `cross_val_score` work. The model itself is not a parameter: it is loaded at the first
`fit` and shared by every estimator of the process with the same (model, dtype, threads, device) through a
small cache (two models at most), so cloned estimators in cross-validation do not load it again.
`clear_model_cache()` frees it.
"""

from __future__ import annotations

import functools

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from slimroute.accuracy.calibration import fit_offsets
from slimroute.accuracy.tune import DEFAULT_CS, TuneConfig, tune_head
from slimroute.config import EngineConfig
from slimroute.router import Router
from slimroute.runtime.load import LoadedModel, load_model
from slimroute.runtime.packaged import DEFAULT_MODEL
from slimroute.task import DEFAULT_INSTRUCTIONS, Task

MODES = ("head", "calibration")


@functools.lru_cache(maxsize=2)
def _loaded_model(model: str, dtype: str, threads: int | None, device: str) -> LoadedModel:
    return load_model(model, dtype, threads, device)


def clear_model_cache() -> None:
    """Forget the models loaded by estimators (they are freed once no estimator holds an engine on them)."""
    _loaded_model.cache_clear()


def _texts(X) -> list[str]:
    """A 1-D sequence of non-empty strings (a list, a 1-D array, a pandas Series)."""
    if isinstance(X, str) or getattr(X, "ndim", 1) != 1:
        raise ValueError("X must be a 1-D sequence of texts (one string per item), e.g. a list or a Series")
    texts = list(X)
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"X[{i}] must be a non-empty string, got {text!r}")
    return texts


class SlimRouteClassifier(ClassifierMixin, BaseEstimator):
    """Texts in, labels out: a head tuned on the model's hidden states (see `slimroute tune`), or zero-shot
    label scoring with fitted per-label offsets.

    model: packaged name, HF repo id, model folder or .gguf file. mode: "head" (a tuned head; fitted state
    head_, cv_) or "calibration" (zero-shot over the classes as labels, with per-label offsets fitted to the
    gold labels: offsets_; a class name is then a label the model scores, so give meaningful names).
    instructions: the prompt's instructions (labels are the classes seen in fit). folds, cs,
    with_label_logprobs, with_mean, classifier, layer, prompt, label_rows: as in `slimroute tune` (TuneConfig;
    mode="head").
    batch_size, max_batch_tokens: the engine's. truncate_tokens: read only each text's first this many tokens (the
    task's truncate_tokens; None: whole texts)."""

    def __init__(self, model: str = DEFAULT_MODEL, *, mode: str = "head", instructions: str | None = None,
                 dtype: str = "auto", threads: int | None = None, device: str = "cpu",
                 with_label_logprobs: bool = False, with_mean: bool | None = None, classifier: str = "auto",
                 layer: int | str | None = "auto", prompt: str = "represent", label_rows: str = "auto",
                 folds: int = 5, cs: tuple[float, ...] = DEFAULT_CS,
                 batch_size: int = 32, max_batch_tokens: int | None = 512, truncate_tokens: int | None = None):
        self.model = model
        self.mode = mode
        self.instructions = instructions
        self.dtype = dtype
        self.threads = threads
        self.device = device
        self.with_label_logprobs = with_label_logprobs
        self.with_mean = with_mean
        self.classifier = classifier
        self.layer = layer
        self.prompt = prompt
        self.label_rows = label_rows
        self.folds = folds
        self.cs = cs
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.truncate_tokens = truncate_tokens

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        tags.input_tags.string = True
        return tags

    def fit(self, X, y):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        texts, y = _texts(X), np.asarray(y)
        if y.ndim != 1 or len(y) != len(texts):
            raise ValueError(f"y must be 1-D with one label per text ({len(texts)}), got shape {y.shape}")
        classes = np.unique(y)
        names = [str(c) for c in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"the classes {list(classes)} are not distinct as strings")
        task = Task(tuple(names), self.instructions or DEFAULT_INSTRUCTIONS, truncate_tokens=self.truncate_tokens)
        loaded = self._loaded()
        engine = Router(loaded, task, self._engine_config()).engine
        golds = [str(label) for label in y]
        if self.mode == "calibration":  # zero-shot over the classes as labels, offsets fitted to the gold labels
            offsets = fit_offsets(engine.classify(texts), golds, task.labels, "SlimRouteClassifier.fit")
            self.classes_, self.offsets_, self.head_, self.task_ = classes, offsets, None, task
        else:
            config = TuneConfig(folds=self.folds, cs=tuple(self.cs), with_label_logprobs=self.with_label_logprobs,
                                with_mean=self.with_mean, classifier=self.classifier, layer=self.layer,
                                prompt=self.prompt, label_rows=self.label_rows)
            head, report = tune_head(engine, texts, golds, config, names,
                                     {"model": self.model, "dtype": loaded.precision})
            self.classes_, self.head_, self.cv_, self.task_, self.offsets_ = classes, head, report, head.task, None
        self._engine = None  # built at the first predict, for this head or these offsets
        return self

    def predict_proba(self, X) -> np.ndarray:
        """(N, C): the head's (or the calibrated label scores') probabilities, columns in `classes_` order."""
        return np.exp(self.predict_log_proba(X))

    def predict_log_proba(self, X) -> np.ndarray:
        preds = self._classify(X)
        labels = self._labels()
        if self.head_ is not None:  # the head's log-softmax over its labels
            return np.array([[p.logprobs[label] for label in labels] for p in preds], dtype=np.float64)
        scores = np.array([[p.calibrated_logprobs[label] for label in labels] for p in preds], dtype=np.float64)
        top = scores.max(axis=1, keepdims=True)  # log-softmax over the classes of log-prob minus offset
        return scores - top - np.log(np.exp(scores - top).sum(axis=1, keepdims=True))

    def predict(self, X) -> np.ndarray:
        preds = self._classify(X)
        index = {label: j for j, label in enumerate(self._labels())}
        return self.classes_[[index[p.label] for p in preds]]

    def _labels(self) -> tuple[str, ...]:
        return self.head_.labels if self.head_ is not None else self.task_.labels

    def _classify(self, X):
        check_is_fitted(self, "classes_")
        if getattr(self, "_engine", None) is None:
            self._engine = Router(self._loaded(), self.task_, self._engine_config(), self.head_, self.offsets_).engine
        return self._engine.classify(_texts(X))

    def _loaded(self):
        return _loaded_model(self.model, self.dtype, self.threads, self.device)

    def _engine_config(self) -> EngineConfig:
        """max-prob: predict is then the argmax of predict_proba also for multi-token class names (calibration)."""
        return EngineConfig(batch_size=self.batch_size, max_batch_tokens=self.max_batch_tokens, decision="max-prob")

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_engine", None)  # holds the model; rebuilt after unpickling from the model spec
        return state
