"""A scikit-learn classifier over texts: `SlimRouteClassifier(model=...).fit(texts, labels).predict(texts)`.

`fit` tunes a head (tune.py) on the fast engine's features of the texts; `predict` / `predict_proba`
classify with the fast engine and that head. As scikit-learn expects, the constructor only stores its
parameters and fitted state ends in `_`, so `clone`, `GridSearchCV` and `cross_val_score` work. The model
itself is not a parameter: it is loaded at the first `fit` and shared by every estimator of the process
with the same (model, dtype, threads, device) through a small cache (two models at most), so cloned
estimators in cross-validation do not load it again. `clear_model_cache()` frees it.
"""

from __future__ import annotations

import functools

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from slimroute.config import EngineConfig
from slimroute.models import DEFAULT_MODEL
from slimroute.task import DEFAULT_INSTRUCTIONS, Task
from slimroute.tune import DEFAULT_CS, TuneConfig

MODES = ("head",)


@functools.lru_cache(maxsize=2)
def _loaded_model(model: str, dtype: str, threads: int | None, device: str):
    from slimroute.models import load_model

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
    """Texts in, labels out: a head tuned on the model's last hidden state (see `slimroute tune`).

    model: packaged name, HF repo id, model folder or .gguf file. mode: "head" (the only mode of this
    build). instructions: the prompt's instructions (labels are the classes seen in fit). folds, cs,
    with_label_logprobs, with_mean, classifier, layer: as in `slimroute tune` (TuneConfig). batch_size,
    max_batch_tokens: the engine's."""

    def __init__(self, model: str = DEFAULT_MODEL, *, mode: str = "head", instructions: str | None = None,
                 dtype: str = "auto", threads: int | None = None, device: str = "cpu",
                 with_label_logprobs: bool = False, with_mean: bool = True, classifier: str = "auto",
                 layer: int | str | None = "auto", folds: int = 5, cs: tuple[float, ...] = DEFAULT_CS,
                 batch_size: int = 32, max_batch_tokens: int | None = 512):
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
        self.folds = folds
        self.cs = cs
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False
        tags.input_tags.string = True
        return tags

    def fit(self, X, y):
        from slimroute.engine import Engine
        from slimroute.tune import tune_head

        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        texts, y = _texts(X), np.asarray(y)
        if y.ndim != 1 or len(y) != len(texts):
            raise ValueError(f"y must be 1-D with one label per text ({len(texts)}), got shape {y.shape}")
        classes = np.unique(y)
        names = [str(c) for c in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"the classes {list(classes)} are not distinct as strings")
        config = TuneConfig(folds=self.folds, cs=tuple(self.cs), with_label_logprobs=self.with_label_logprobs,
                            with_mean=self.with_mean, classifier=self.classifier, layer=self.layer)
        task = Task(tuple(names), self.instructions or DEFAULT_INSTRUCTIONS)
        loaded = self._loaded()
        engine = Engine.from_loaded(loaded, task, self._engine_config())
        head, report = tune_head(engine, texts, [str(label) for label in y], config, names,
                                 {"model": self.model, "dtype": loaded.precision})
        self.classes_, self.head_, self.cv_ = classes, head, report
        self._engine = None  # built at the first predict, for this head
        return self

    def predict_proba(self, X) -> np.ndarray:
        """(N, C): the head's probabilities, columns in `classes_` order."""
        preds = self._classify(X)
        return np.array([[p.probs[label] for label in self.head_.labels] for p in preds], dtype=np.float64)

    def predict_log_proba(self, X) -> np.ndarray:
        preds = self._classify(X)
        return np.array([[p.logprobs[label] for label in self.head_.labels] for p in preds], dtype=np.float64)

    def predict(self, X) -> np.ndarray:
        preds = self._classify(X)
        index = {label: j for j, label in enumerate(self.head_.labels)}
        return self.classes_[[index[p.label] for p in preds]]

    def _classify(self, X):
        from slimroute.engine import Engine

        check_is_fitted(self, "head_")
        if getattr(self, "_engine", None) is None:
            self._engine = Engine.from_loaded(self._loaded(), self.head_.task, self._engine_config(), self.head_)
        return self._engine.classify(_texts(X))

    def _loaded(self):
        return _loaded_model(self.model, self.dtype, self.threads, self.device)

    def _engine_config(self) -> EngineConfig:
        return EngineConfig(batch_size=self.batch_size, max_batch_tokens=self.max_batch_tokens)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_engine", None)  # holds the model; rebuilt after unpickling from the model spec
        return state
