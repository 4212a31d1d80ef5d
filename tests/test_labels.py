import pytest

from slimroute.labels import Prediction, decide, greedy_choice, label_token_ids, trie_paths


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


def test_label_ids_follow_the_assistant_start(tiny):
    _, tok = tiny
    start = "<|im_end|>\n<|im_start|>assistant\n" if "<|im_start|>" in tok.get_vocab() else "<|eot_id|>"
    ids = label_token_ids(tok, start, "billing")
    assert tok.decode(list(ids)) == "billing"


def test_prediction_probs_sum_to_one():
    pred = Prediction("a", {"a": -0.2, "b": -2.0, "c": -5.0})
    assert abs(sum(pred.probs.values()) - 1) < 1e-12 and max(pred.probs, key=pred.probs.get) == "a"
    assert Prediction.failed("bad").probs == {}
