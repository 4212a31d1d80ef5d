"""Calibration: offsets, their estimates and fit, and fast == reference under every mode."""

import math
import random

import numpy as np
import pytest
from conftest import _cached
from test_equivalence import LABEL_SETS, assert_equal
from tiny import make_text

from slimroute.accuracy.calibration import (
    CONTENT_FREE_TEXTS,
    Offsets,
    content_free_offsets,
    estimate_offsets,
    fit_offsets,
    prepare_offsets,
)
from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.labels import Prediction, make_prediction, redecide
from slimroute.task import Task

LABEL_SETS = {**LABEL_SETS, "one-token": ("a", "b", "c")}  # the tiny tokenizer's "billing" is 3 tokens


def raw_prediction(token_logprobs, labels=("a", "b", "c")):
    return make_prediction(labels, [(i,) for i in range(len(labels))], token_logprobs, "max-prob")


def test_offsets_are_subtracted_per_token_before_the_decision():
    labels, ids = ("billing", "technical"), [(1,), (2,)]
    offsets = Offsets("batch", labels, ((-0.5,), (-2.0,)), 10)
    pred = make_prediction(labels, ids, [[-0.7], [-1.0]], "greedy", offsets=offsets.values)
    assert pred.label == "technical"  # -0.7 + 0.5 = -0.2 against -1.0 + 2.0 = 1.0
    pred = make_prediction(labels, ids, [[-0.7], [-1.0]], "greedy", offsets=((-0.5,), (0.5,)))
    assert pred.label == "billing" and pred.calibrated_logprobs == pytest.approx({"billing": -0.2, "technical": -1.5})
    assert pred.logprobs == {"billing": -0.7, "technical": -1.0}  # the model's, kept
    assert max(pred.probs, key=pred.probs.get) == "billing" and max(pred.raw_probs, key=pred.raw_probs.get) == "billing"
    flipped = make_prediction(labels, ids, [[-0.7], [-1.0]], "greedy", offsets=((0.0,), (-1.0,)))
    assert flipped.label == "technical" and flipped.probs["technical"] > 0.5 > flipped.raw_probs["technical"]


def test_greedy_uses_calibrated_scores_at_each_step():
    # "Technical Support" / "Technical Sales" share their first token; "billing" has one.
    labels, ids = ("billing", "Technical Support", "Technical Sales"), [(5,), (7, 8), (7, 9)]
    lps = [[-1.0], [-0.9, -0.1], [-0.9, -3.0]]
    assert make_prediction(labels, ids, lps, "greedy").label == "Technical Support"
    # the shared step gets one offset; only the second step's offsets flip Support / Sales
    second = ((0.0,), (0.0, 0.0), (0.0, -3.5))
    assert make_prediction(labels, ids, lps, "greedy", offsets=second).label == "Technical Sales"
    first = ((-0.5,), (0.0, 0.0), (0.0, 0.0))
    assert make_prediction(labels, ids, lps, "greedy", offsets=first).label == "billing"
    assert make_prediction(labels, ids, lps, "max-prob", offsets=first).label == "billing"  # -0.5 vs -1.0


def test_mean_offsets_are_each_tokens_mean_log_prob():
    preds = [raw_prediction([[-1.0], [-2.0], [-3.0]]), raw_prediction([[-3.0], [-2.0], [-1.0]]),
             Prediction.failed("bad row")]
    offsets = estimate_offsets("batch", preds, ("a", "b", "c"), "test")
    assert offsets.values == ((-2.0,), (-2.0,), (-2.0,)) and offsets.num_inputs == 2
    with pytest.raises(ValueError, match="at least one scored text"):
        estimate_offsets("batch", [Prediction.failed("x")], ("a", "b", "c"))


def test_fitted_offsets_recover_a_known_bias():
    """Log-probs = a class signal plus a per-label bias; the fit finds the bias (up to a constant)."""
    rng = np.random.default_rng(0)
    labels, bias = ("a", "b", "c"), np.array([2.0, -1.0, 0.0])
    golds, preds = [], []
    for _ in range(4000):
        y = int(rng.integers(3))
        scores = rng.normal(0, 1, 3) + bias
        scores[y] += 1.5
        logprobs = scores - np.log(np.exp(scores).sum())
        golds.append(labels[y])
        preds.append(raw_prediction([[float(v)] for v in logprobs]))
    offsets = fit_offsets(preds, golds, labels)
    got = np.array([vs[-1] for vs in offsets.values])
    assert np.abs((got - got.mean()) - (bias - bias.mean())).max() < 0.1, got
    calibrated = [redecide(p, labels, [(0,), (1,), (2,)], "max-prob", offsets.values) for p in preds]
    raw_acc = np.mean([p.label == g for p, g in zip(preds, golds, strict=True)])
    assert np.mean([p.label == g for p, g in zip(calibrated, golds, strict=True)]) > raw_acc + 0.1


def test_fit_refuses_unknown_or_missing_labels():
    preds = [raw_prediction([[-1.0], [-2.0], [-3.0]])] * 3
    with pytest.raises(ValueError, match="'d' is not one of the labels"):
        fit_offsets(preds, ["a", "b", "d"], ("a", "b", "c"))
    with pytest.raises(ValueError, match="'c' has none"):
        fit_offsets(preds, ["a", "b", "b"], ("a", "b", "c"))


def test_offsets_check_round_trip_and_errors(tmp_path):
    offsets = Offsets("content-free", ("a", "b"), ((-1.5,), (-0.25, -3.0)), 3, "cf")
    path = tmp_path / "offsets.json"
    offsets.save(path)
    assert Offsets.load(path) == offsets and offsets.totals() == {"a": -1.5, "b": -3.25}
    assert offsets.check(("a", "b"), [(1,), (2, 3)]) is offsets
    with pytest.raises(ValueError, match="not \\['b', 'a'\\]"):
        offsets.check(("b", "a"), [(1,), (2, 3)])
    with pytest.raises(ValueError, match="have 2 token"):
        offsets.check(("a", "b"), [(1,), (2,)])
    with pytest.raises(ValueError, match="mode"):
        Offsets("none", ("a",), ((0.0,),), 1)
    with pytest.raises(ValueError, match="finite"):
        Offsets("batch", ("a",), ((math.nan,),), 1)


def close(a, b, tol=1e-4) -> bool:
    return [len(x) for x in a] == [len(y) for y in b] and all(
        abs(u - v) <= tol for x, y in zip(a, b, strict=True) for u, v in zip(x, y, strict=True))


def tiny_texts(seed, n=12):
    rng = random.Random(seed)
    return [make_text(rng, rng.choice([2, 9, 40, 120])) for _ in range(n)]


@pytest.mark.parametrize("labels", sorted(LABEL_SETS))
@pytest.mark.parametrize("decision", ["greedy", "max-prob"])
@pytest.mark.parametrize("mode", ["content-free", "batch", "fitted"])
def test_fast_path_equals_reference_under_calibration(labels, decision, mode):
    model, tok = _cached("qwen2" if labels != "multi" else "llama")
    task = Task(LABEL_SETS[labels])
    texts = tiny_texts(hash((labels, decision, mode)) % 1000)
    engine = Engine(model, tok, task, EngineConfig(batch_size=5, decision=decision))
    reference = ReferenceClassifier(model, tok, task, decision)
    golds = [task.labels[i % len(task.labels)] for i in range(len(texts))]
    offsets = prepare_offsets(engine, mode, task.labels, texts, golds, "test data")
    from_reference = prepare_offsets(reference, mode, task.labels, texts, golds, "test data")
    assert close(offsets.values, from_reference.values)  # either path can estimate them
    more = tiny_texts(7)
    fast = engine.with_calibration(offsets).classify(more)
    ref = ReferenceClassifier(model, tok, task, decision, calibration=offsets).classify(more)
    assert_equal(ref, fast)
    for r, f in zip(ref, fast, strict=True):
        for label in task.labels:
            assert abs(r.calibrated_logprobs[label] - f.calibrated_logprobs[label]) <= 1e-4
    raw = engine.classify(more)  # the uncalibrated engine is untouched by with_calibration
    assert all(p.calibrated_logprobs is None for p in raw)
    assert [p.label for p in engine.with_calibration(offsets).redecide(more, raw)] == [p.label for p in fast]


def test_content_free_inputs_include_the_empty_text(tiny):
    model, tok = tiny
    task = Task(LABEL_SETS["single"])
    assert "" in CONTENT_FREE_TEXTS
    fast = content_free_offsets(Engine(model, tok, task), task.labels)
    ref = content_free_offsets(ReferenceClassifier(model, tok, task), task.labels)
    assert fast.num_inputs == len(CONTENT_FREE_TEXTS) == ref.num_inputs
    assert close(fast.values, ref.values)


def test_calibration_changes_answers_only_through_the_offsets(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["one-token"])
    texts = tiny_texts(3, 30)
    engine = Engine(model, tok, task)
    raw = engine.classify(texts)
    zero = Offsets("batch", task.labels, ((0.0,),) * 3, 1)
    assert [p.label for p in engine.with_calibration(zero).classify(texts)] == [p.label for p in raw]
    favour = Offsets("fitted", task.labels, ((0.0,), (0.0,), (-50.0,)), 1)
    assert {p.label for p in engine.with_calibration(favour).classify(texts)} == {"c"}


def test_prepare_offsets_modes(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    engine = Engine(model, tok, task)
    assert prepare_offsets(engine, "none", task.labels) is None
    assert prepare_offsets(engine, "batch", task.labels) is None  # estimated later, from the first window
    with pytest.raises(ValueError, match="--calibration-data"):
        prepare_offsets(engine, "fitted", task.labels)
    with pytest.raises(ValueError, match="calibrate must be one of"):
        prepare_offsets(engine, "platt", task.labels)


def test_near_tie_recheck_uses_calibrated_margins(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["multi"])
    texts = tiny_texts(4, 6)
    offsets = estimate_offsets("batch", Engine(model, tok, task).classify(texts), task.labels)
    always = Engine(model, tok, task, EngineConfig(recheck_margin=float("inf")), calibration=offsets)
    ref = ReferenceClassifier(model, tok, task, calibration=offsets).classify(texts)
    preds = always.classify(texts)
    assert always.last_stats.num_rechecked == len(texts)
    assert [p.calibrated_logprobs for p in preds] == [p.calibrated_logprobs for p in ref]
