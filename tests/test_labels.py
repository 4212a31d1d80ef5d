import math

import pytest

from slimroute.config import EngineConfig
from slimroute.labels import (
    Fallback,
    Prediction,
    continuation_runs,
    decide,
    greedy_choice,
    label_token_ids,
    make_prediction,
    redecide,
    trie_paths,
)


def test_greedy_and_max_prob_differ_on_shared_first_tokens():
    # "Technical Support" / "Technical Sales" share the first token; "billing" has one token.
    ids = [(5,), (7, 8), (7, 9)]
    lps = [[-1.0], [-0.9, -3.0], [-0.9, -0.05]]
    assert greedy_choice(ids, lps) == 2  # 7 beats 5 at the first step, then 9 beats 8
    assert decide("max-prob", ids, lps) == 2
    lps = [[-1.0], [-0.9, -0.8], [-0.9, -0.7]]
    assert decide("greedy", ids, lps) == 2  # first step picks the shared token
    assert decide("max-prob", ids, lps) == 0  # -1.0 > -1.6


def test_greedy_stops_at_a_complete_label():
    ids = [(3,), (3, 4)]
    assert greedy_choice(ids, [[-0.1], [-0.1, -0.01]]) == 0


def test_decide_rejects_unknown_rule():
    with pytest.raises(ValueError, match="decision"):
        decide("sample", [(1,)], [[0.0]])


def test_trie_paths():
    assert trie_paths([(1,), (2, 3), (2, 4, 5)]) == [(2,), (2, 4)]


def test_continuation_runs_feed_each_context_once():
    labels = [(1,), (2, 3), (2, 4, 5), (6, 7, 8), (6, 7, 9, 1), (6, 3)]
    runs, where = continuation_runs(labels)
    assert runs == [(2, 4), (6, 7, 9)]  # (2,), (6,) and (6, 7) lie inside them
    assert set(where) == set(trie_paths(labels))
    assert all(runs[r][:k + 1] == context for context, (r, k) in where.items())
    assert continuation_runs([(1,), (2,)]) == ([], {})


def test_label_ids_follow_the_assistant_start(tiny):
    _, tok = tiny
    start = "<|im_end|>\n<|im_start|>assistant\n" if "<|im_start|>" in tok.get_vocab() else "<|eot_id|>"
    ids = label_token_ids(tok, start, "billing")
    assert tok.decode(list(ids)) == "billing"


def test_prediction_probs_sum_to_one():
    pred = Prediction("a", {"a": -0.2, "b": -2.0, "c": -5.0})
    assert abs(sum(pred.probs.values()) - 1) < 1e-12 and max(pred.probs, key=pred.probs.get) == "a"
    assert Prediction.failed("bad").probs == {}


LABELS = ["billing", "technical", "account"]
IDS = [(1,), (2,), (3,)]


def single(probs):
    """token_logprobs of three single-token labels with these probabilities."""
    return [[math.log(p)] for p in probs]


def test_fallback_floor_routes_answers_below_it_and_keeps_the_models_choice():
    lps = single([0.5, 0.3, 0.2])
    plain = make_prediction(LABELS, IDS, lps, "greedy")
    assert plain.label == plain.model_label == "billing"
    routed = make_prediction(LABELS, IDS, lps, "greedy", fallback=Fallback(0.6, "human"))
    assert (routed.label, routed.model_label) == ("human", "billing")
    assert routed.probs == plain.probs and routed.logprobs == plain.logprobs  # only the answer changes
    assert "model_label='billing'" in repr(routed)
    at_floor = make_prediction(LABELS, IDS, lps, "greedy", fallback=Fallback(plain.probs["billing"]))
    assert at_floor.label == "billing"  # p >= floor is answered
    # with offsets the floor reads the probabilities the decision used (calibrated), not the model's
    offsets = [[0.0], [math.log(0.3) - math.log(0.5)], [0.0]]  # technical's score lifted to billing's
    calibrated = make_prediction(LABELS, IDS, lps, "max-prob", offsets=offsets, fallback=Fallback(0.45))
    assert calibrated.model_label == "billing" and calibrated.probs["billing"] == pytest.approx(0.5 / 1.2)
    assert calibrated.label == "unsure"  # 0.417 < 0.45, although the model's own p is 0.5
    again = redecide(calibrated, LABELS, IDS, "max-prob", None, Fallback(0.45))
    assert (again.label, again.model_label) == ("billing", "billing")  # redecided without offsets: p 0.5


@pytest.mark.parametrize("kw, message", [
    ({"min_prob": 0}, "min_prob must be a probability in (0, 1]"),
    ({"min_prob": 1.01}, "min_prob must be a probability in (0, 1]"),
    ({"min_prob": True}, "min_prob must be a probability"),
    ({"min_prob": 0.5, "fallback_label": ""}, "fallback_label must be a non-empty string"),
    ({"min_prob": 0.5, "fallback_label": " human"}, "fallback_label must be a non-empty string"),
    ({"fallback_label": "human"}, "fallback_label 'human' needs min_prob"),
])
def test_bad_floor_settings_name_the_field(kw, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(**kw)
    assert message in str(err.value)


def test_floor_defaults_and_a_fallback_label_that_is_an_answer():
    assert EngineConfig().fallback is None
    assert EngineConfig(min_prob=0.7).fallback == Fallback(0.7, "unsure")
    assert EngineConfig(min_prob=1, fallback_label="human").fallback == Fallback(1, "human")
    with pytest.raises(ValueError, match="fallback_label 'billing' is one of the labels"):
        Fallback(0.5, "billing").check(LABELS)
