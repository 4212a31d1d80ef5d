"""Metrics against hand-computed values."""

from collections import Counter

import pytest

from slimroute.metrics import Metrics, plot_confusion

GOLD = ["a", "a", "a", "b", "b", "c", "c", "c", "c", "a"]
PRED = ["a", "a", "b", "b", "c", "c", "c", "a", "c", "a"]


def test_hand_computed_scores():
    m = Metrics.from_pairs(GOLD, PRED, ["a", "b", "c"])
    # gold a: 4 (3 right, 1 -> b); gold b: 2 (1 right, 1 -> c); gold c: 4 (3 right, 1 -> a)
    assert m.confusion == ((3, 1, 0), (0, 1, 1), (1, 0, 3))
    assert m.num_items == 10 and m.accuracy == pytest.approx(0.7)
    a, b, c = (m.per_label[x] for x in "abc")
    assert (a.precision, a.recall, a.support) == (pytest.approx(3 / 4), pytest.approx(3 / 4), 4)
    assert (b.precision, b.recall, b.support) == (pytest.approx(1 / 2), pytest.approx(1 / 2), 2)
    assert (c.precision, c.recall, c.support) == (pytest.approx(3 / 4), pytest.approx(3 / 4), 4)
    assert m.macro_f1 == pytest.approx((0.75 + 0.5 + 0.75) / 3)


def test_labels_never_predicted_or_never_gold():
    m = Metrics.from_counts(Counter({("a", "a"): 2, ("b", "a"): 2}), ["a", "b", "c"])
    assert m.labels == ("a", "b", "c")
    assert m.per_label["b"].precision == 0.0 and m.per_label["b"].f1 == 0.0  # never predicted: 0, not an error
    assert m.per_label["a"].f1 == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert m.macro_f1 == pytest.approx((2 / 3 + 0) / 2)  # 'c' neither gold nor predicted: left out
    extra = Metrics.from_pairs(["a", "z"], ["a", "a"], ["a", "b"])
    assert extra.labels == ("a", "b", "z") and extra.confusion[2] == (1, 0, 0)  # a gold label the task lacks
    assert Metrics.from_pairs([], [], ["a"]).accuracy is None


def test_to_dict_and_plot(tmp_path):
    m = Metrics.from_pairs(GOLD, PRED, ["a", "b", "c"])
    record = m.to_dict()
    assert record["accuracy"] == pytest.approx(0.7) and record["per_label"]["b"]["support"] == 2
    assert record["confusion"] == [[3, 1, 0], [0, 1, 1], [1, 0, 3]]
    path = plot_confusion(m, tmp_path / "cm.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="must end in .png"):
        plot_confusion(m, tmp_path / "cm.jpg")
