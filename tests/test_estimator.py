"""SlimRouteClassifier follows scikit-learn's estimator conventions and classifies with the fast engine.

scikit-learn's full `check_estimator` suite feeds 2-D numeric arrays, which a text classifier cannot take
(with its tags saying string input it runs only the clone check), so the conventions that apply to any
estimator are run one by one, and the fitting conventions are checked on texts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import cross_val_score
from sklearn.utils import estimator_checks as checks
from test_tune import INTENTS, banking_rows

import slimroute
from slimroute.engine.reference import ReferenceClassifier
from slimroute.estimator import SlimRouteClassifier

ROWS = banking_rows(6)
TEXTS = [row["text"] for row in ROWS]
LABELS = [row["intent"] for row in ROWS]


@pytest.fixture
def estimator(model_dir):
    return SlimRouteClassifier(model_dir, threads=1, folds=3)


@pytest.mark.parametrize("check", [
    checks.check_no_attributes_set_in_init,
    checks.check_parameters_default_constructible,
    checks.check_get_params_invariance,
    checks.check_set_params,
    checks.check_estimator_cloneable,
    checks.check_estimator_repr,
    checks.check_estimator_tags_renamed,
    checks.check_valid_tag_types,
])
def test_scikit_learn_conventions(estimator, check):
    check(type(estimator).__name__, estimator)


def test_fit_predict_proba_score(estimator):
    fitted = estimator.fit(TEXTS, LABELS)
    assert fitted is estimator and list(estimator.classes_) == sorted(INTENTS)
    proba = estimator.predict_proba(TEXTS[:8])
    assert proba.shape == (8, 4) and np.allclose(proba.sum(axis=1), 1)
    predicted = estimator.predict(TEXTS[:8])
    assert list(predicted) == list(estimator.classes_[proba.argmax(axis=1)])
    assert np.allclose(np.exp(estimator.predict_log_proba(TEXTS[:8])), proba)
    assert 0 <= estimator.score(TEXTS, LABELS) <= 1
    assert estimator.cv_.folds == 3 and estimator.head_.labels == tuple(sorted(INTENTS))


def test_predictions_are_the_reference_with_the_head(estimator):
    estimator.fit(TEXTS, LABELS)
    loaded = estimator._loaded()
    ref = ReferenceClassifier(loaded.model, loaded.tokenizer, estimator.head_.task, head=estimator.head_)
    want = ref.classify(TEXTS[:10])
    assert list(estimator.predict(TEXTS[:10])) == [p.label for p in want]
    expected = np.array([[p.logprobs[label] for label in estimator.head_.labels] for p in want])
    assert np.abs(estimator.predict_log_proba(TEXTS[:10]) - expected).max() <= 1e-4


def test_calibration_mode_fits_offsets_and_predicts_as_the_reference(model_dir):
    """mode="calibration": zero-shot over the classes, per-label offsets fitted to the gold labels; its answers
    are the reference's with the same offsets, and the offsets make the gold labels likelier than raw scores."""
    estimator = SlimRouteClassifier(model_dir, mode="calibration", threads=1).fit(TEXTS, LABELS)
    assert estimator.head_ is None and estimator.offsets_.mode == "fitted"
    assert estimator.offsets_.labels == tuple(sorted(INTENTS)) == estimator.task_.labels
    proba = estimator.predict_proba(TEXTS)
    assert proba.shape == (len(TEXTS), 4) and np.allclose(proba.sum(axis=1), 1)
    assert list(estimator.predict(TEXTS)) == list(estimator.classes_[proba.argmax(axis=1)])
    loaded = estimator._loaded()
    want = ReferenceClassifier(loaded.model, loaded.tokenizer, estimator.task_, "max-prob",
                               calibration=estimator.offsets_).classify(TEXTS[:10])
    assert list(estimator.predict(TEXTS[:10])) == [p.label for p in want]
    gold = [list(estimator.classes_).index(label) for label in LABELS]
    raw = np.array([[p.logprobs[label] for label in estimator.task_.labels] for p in estimator._classify(TEXTS)])
    raw = raw - np.log(np.exp(raw).sum(axis=1, keepdims=True))  # log-softmax of the uncalibrated label scores
    fitted_ll = np.log(proba[np.arange(len(gold)), gold]).mean()
    assert fitted_ll > raw[np.arange(len(gold)), gold].mean()
    assert not hasattr(clone(estimator), "offsets_")


def test_truncate_tokens_reaches_the_task_and_the_reference_agrees(estimator):
    estimator.set_params(truncate_tokens=6).fit(TEXTS, LABELS)
    assert estimator.head_.task.truncate_tokens == 6
    loaded = estimator._loaded()
    want = ReferenceClassifier(loaded.model, loaded.tokenizer, estimator.head_.task, head=estimator.head_)
    assert list(estimator.predict(TEXTS[:10])) == [p.label for p in want.classify(TEXTS[:10])]
    assert all(p.truncated for p in want.classify(TEXTS[:10]))  # every BANKING77 text here is over 6 tokens


def test_integer_labels_come_back_as_given(estimator):
    codes = np.array([INTENTS.index(label) * 10 for label in LABELS])  # 0, 10, 20, 30: str order != int order
    estimator.fit(TEXTS, codes)
    assert list(estimator.classes_) == [0, 10, 20, 30]
    predicted = estimator.predict(TEXTS)
    assert predicted.dtype == codes.dtype and set(predicted) <= {0, 10, 20, 30}
    assert estimator.head_.labels == ("0", "10", "20", "30")


def test_clone_and_cross_validation(estimator):
    twin = clone(estimator)
    assert twin is not estimator and twin.get_params() == estimator.get_params()
    assert not hasattr(twin, "head_")
    scores = cross_val_score(clone(estimator).set_params(folds=2), TEXTS, LABELS, cv=3)
    assert scores.shape == (3,) and all(0 <= s <= 1 for s in scores)


def test_fit_keeps_the_parameters_and_is_idempotent(estimator):
    before = estimator.get_params()
    first = estimator.fit(TEXTS, LABELS).predict_proba(TEXTS[:6])
    assert estimator.get_params() == before
    assert np.array_equal(estimator.fit(TEXTS, LABELS).predict_proba(TEXTS[:6]), first)


def test_pickles_without_the_model(estimator):
    estimator.fit(TEXTS, LABELS)
    estimator.predict(TEXTS[:2])  # builds the engine
    state = pickle.dumps(estimator)
    assert len(state) < 200_000  # the head and the parameters, not the model
    again = pickle.loads(state)
    assert list(again.predict(TEXTS[:6])) == list(estimator.predict(TEXTS[:6]))


def test_bad_use_names_the_problem(estimator):
    with pytest.raises(NotFittedError):
        estimator.predict(TEXTS[:2])
    with pytest.raises(ValueError, match="mode must be one of head, calibration"):
        clone(estimator).set_params(mode="prompt").fit(TEXTS, LABELS)
    with pytest.raises(ValueError, match="1-D sequence of texts"):
        estimator.fit("one string", LABELS[:1])
    with pytest.raises(ValueError, match=r"X\[1\] must be a non-empty string"):
        estimator.fit(["fine", ""], ["a", "b"])
    with pytest.raises(ValueError, match="one label per text"):
        estimator.fit(TEXTS, LABELS[:-1])
    with pytest.raises(ValueError, match="mode must be one of head"):
        clone(estimator).set_params(mode="magic").fit(TEXTS, LABELS)
    with pytest.raises(ValueError, match="tuning needs at least 7 per label"):
        clone(estimator).set_params(folds=7).fit(TEXTS, LABELS)


def test_exported_from_the_package():
    assert slimroute.SlimRouteClassifier is SlimRouteClassifier
