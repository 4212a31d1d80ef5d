"""Metrics against hand-computed values."""

from collections import Counter

import pytest

from slimroute.accuracy.metrics import Metrics, floor_for_accuracy, floor_points, plot_confusion

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


def test_rows_answered_under_a_fallback_label():
    m = Metrics.from_pairs(["a", "a", "b", "b", "c"], ["a", "?", "b", "?", "a"], ["a", "b", "c"])
    assert m.labels == ("a", "b", "c", "?") and m.accuracy == pytest.approx(2 / 5)
    answered = m.without_prediction("?")
    assert answered.labels == ("a", "b", "c") and answered.num_items == 3 and answered.accuracy == pytest.approx(2 / 3)
    assert answered.per_label["b"].support == 1  # the routed gold-b row is not among the answered
    # the fallback is a route, not a class: left out of macro-F1 (its rows still cost recall)
    f1 = {label: m.per_label[label].f1 for label in "abc"}
    assert m.macro_f1_except("?") == pytest.approx(sum(f1.values()) / 3)
    assert m.macro_f1 == pytest.approx(sum(f1.values()) / 4)


def test_floor_for_accuracy_answers_the_most_rows_at_the_target():
    conf = [0.99, 0.95, 0.9, 0.8, 0.8, 0.7, 0.6, 0.5, 0.4, 0.35]
    right = [True, True, True, True, False, True, True, False, False, False]
    point = floor_for_accuracy(conf, right, 1.0)  # 0.8 would take in a wrong row (4 of 5)
    assert (point.min_prob, point.answered, point.correct, point.total) == (0.9, 3, 3, 10)
    point = floor_for_accuracy(conf, right, 0.85)  # 0.7 keeps 5 of 6 (83%), the lower 0.6 6 of 7 (86%)
    assert (point.min_prob, point.answered, point.correct) == (0.6, 7, 6)
    assert floor_for_accuracy(conf, right, 0.6).answered == 10  # 6 of 10 is 60%: every row answered
    assert floor_for_accuracy([0.9, 0.8], [False, True], 0.9) is None
    assert floor_for_accuracy([0.66666, 0.5], [True, False], 1.0).min_prob == 0.666  # a --min-prob that keeps it
    for bad in (0, 1.5, 90):
        with pytest.raises(ValueError, match="a share in"):
            floor_for_accuracy(conf, right, bad)


def test_floor_points_hand_computed():
    conf = [0.99, 0.95, 0.9, 0.8, 0.8, 0.7, 0.6, 0.5, 0.4, 0.35]
    right = [True, True, True, True, False, True, True, False, False, False]
    points = {round(p.coverage, 2): p for p in floor_points(conf, right)}
    assert sorted(points) == [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]  # 95% of 10 rows is all 10: not listed twice
    assert (points[1.0].min_prob, points[1.0].answered, points[1.0].correct) == (0.35, 10, 6)
    assert (points[0.5].min_prob, points[0.5].answered, points[0.5].correct) == (0.8, 5, 4)  # ties at 0.8 both in
    assert points[0.7].accuracy == pytest.approx(6 / 7)
    # the floor is rounded down to 3 decimals, so passing it as --min-prob answers at least those rows
    odd = floor_points([0.66666, 0.5, 0.4], [True, False, False], coverages=(0.3,))
    assert (odd[0].min_prob, odd[0].answered, odd[0].to_dict()["accuracy"]) == (0.666, 1, 1.0)
    assert floor_points([], []) == []
