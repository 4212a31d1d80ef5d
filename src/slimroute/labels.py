"""Label texts -> token ids, and the two decision rules over per-token label log-probs.

Decision rules (both paths use these; the log-probs themselves are computed separately):
- `greedy`: what generation with a logit mask allowing only tokens that continue some label
  outputs: at each step take the highest-scoring allowed token, stop when a label is complete.
  A label whose tokens are a strict prefix of another label's wins as soon as it is complete.
- `max-prob`: the label with the highest total log-probability (sum over its tokens).
They differ when labels have different lengths or share first tokens.

Calibration (calibration.py) subtracts an offset from each label token's log-prob before either
rule decides; the model's own log-probs are kept next to the calibrated ones.
"""

from __future__ import annotations

import math

DECISIONS = ("greedy", "max-prob")


def label_token_ids(tokenizer, assistant_start: str, label: str) -> tuple[int, ...]:
    """Tokens of `label` as they follow the rendered assistant-turn start (not space-prefixed)."""
    base = tokenizer(assistant_start, add_special_tokens=False)["input_ids"]
    full = tokenizer(assistant_start + label, add_special_tokens=False)["input_ids"]
    if full[: len(base)] != base or len(full) == len(base):
        raise ValueError(
            f"label {label!r} does not tokenise cleanly after the assistant-turn start {assistant_start!r}"
        )
    return tuple(full[len(base) :])


def check_decision(rule: str) -> str:
    if rule not in DECISIONS:
        raise ValueError(f"decision {rule!r} is not one of {', '.join(DECISIONS)}")
    return rule


def decide(rule: str, label_ids: list[tuple[int, ...]], token_logprobs: list[list[float]]) -> int:
    """Index of the chosen label. token_logprobs[i][k] = log p(label i's k-th token | context)."""
    check_decision(rule)
    if rule == "max-prob":
        totals = [sum(lps) for lps in token_logprobs]
        return max(range(len(totals)), key=lambda i: (totals[i], -i))
    return greedy_choice(label_ids, token_logprobs)


def greedy_choice(label_ids: list[tuple[int, ...]], token_logprobs: list[list[float]]) -> int:
    alive = list(range(len(label_ids)))
    depth = 0
    while True:
        complete = [i for i in alive if len(label_ids[i]) == depth]
        if complete:
            return complete[0]
        # Allowed next tokens and their log-probs (labels sharing the path share the context).
        options: dict[int, float] = {}
        for i in alive:
            options.setdefault(label_ids[i][depth], token_logprobs[i][depth])
        best = max(options, key=lambda tok: (options[tok], -tok))
        alive = [i for i in alive if label_ids[i][depth] == best]
        depth += 1


def trie_paths(label_ids: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Distinct non-empty proper prefixes of the labels: the contexts that need an extra step."""
    paths = {ids[:k] for ids in label_ids for k in range(1, len(ids))}
    return sorted(paths, key=lambda p: (len(p), p))


class Prediction:
    """One item's answer: the chosen label and each label's exact log-probability.

    `logprobs` are the model's (the sum over each label's tokens; `token_logprobs` per token). With
    calibration, `calibrated_logprobs` are the scores the decision used (log-prob minus offsets) and
    `probs` come from them; `raw_probs` always come from the model's log-probs."""

    __slots__ = ("label", "logprobs", "num_tokens", "truncated", "error", "token_logprobs", "calibrated_logprobs")

    def __init__(self, label=None, logprobs=None, num_tokens=0, truncated=False, error=None, token_logprobs=None,
                 calibrated_logprobs=None):
        self.label: str | None = label
        self.logprobs: dict[str, float] = logprobs or {}
        self.num_tokens: int = num_tokens
        self.truncated: bool = truncated
        self.error: str | None = error
        self.token_logprobs: list[list[float]] | None = token_logprobs  # [label][token], the model's
        self.calibrated_logprobs: dict[str, float] | None = calibrated_logprobs

    @classmethod
    def failed(cls, error: str) -> Prediction:
        return cls(error=error)

    @property
    def probs(self) -> dict[str, float]:
        """The decision's probabilities, renormalised over the labels (they sum to 1): calibrated when
        calibration is on, else the model's."""
        return _renormalised(self.calibrated_logprobs if self.calibrated_logprobs is not None else self.logprobs)

    @property
    def raw_probs(self) -> dict[str, float]:
        """The model's probabilities renormalised over the labels, whatever the calibration."""
        return _renormalised(self.logprobs)

    def __repr__(self):
        return f"Prediction(label={self.label!r}, error={self.error!r})"


def _renormalised(logprobs: dict[str, float]) -> dict[str, float]:
    if not logprobs:
        return {}
    top = max(logprobs.values())
    exp = {k: math.exp(v - top) for k, v in logprobs.items()}
    total = sum(exp.values())
    return {k: v / total for k, v in exp.items()}


def apply_offsets(token_logprobs: list[list[float]], offsets) -> list[list[float]]:
    """Calibrated per-token scores: each label token's log-prob minus its offset (offsets[label][token])."""
    return [[lp - b for lp, b in zip(lps, bs, strict=True)] for lps, bs in zip(token_logprobs, offsets, strict=True)]


def make_prediction(labels, label_ids, token_logprobs, rule, num_tokens=0, truncated=False,
                    offsets=None) -> Prediction:
    """The decision over the label tokens' log-probs, after subtracting `offsets` when given."""
    scores = apply_offsets(token_logprobs, offsets) if offsets is not None else token_logprobs
    choice = decide(rule, label_ids, scores)
    logprobs = {label: float(sum(lps)) for label, lps in zip(labels, token_logprobs, strict=True)}
    calibrated = None
    if offsets is not None:
        calibrated = {label: float(sum(s)) for label, s in zip(labels, scores, strict=True)}
    return Prediction(labels[choice], logprobs, num_tokens, truncated, None, token_logprobs, calibrated)


def redecide(pred: Prediction, labels, label_ids, rule: str, offsets=None) -> Prediction:
    """The same prediction decided again from its per-token log-probs with `offsets` (error rows pass)."""
    if pred.error is not None or pred.token_logprobs is None:
        return pred
    return make_prediction(labels, label_ids, pred.token_logprobs, rule, pred.num_tokens, pred.truncated, offsets)


def decision_margin(rule: str, label_ids: list[tuple[int, ...]], token_logprobs: list[list[float]]) -> float:
    """How far the decision is from flipping: the smallest log-prob gap between the chosen option and the
    runner-up (at each greedy step, or between the top two label totals for max-prob)."""
    if len(label_ids) < 2:
        return float("inf")
    if rule == "max-prob":
        totals = sorted((sum(lps) for lps in token_logprobs), reverse=True)
        return totals[0] - totals[1]
    alive, depth, margin = list(range(len(label_ids))), 0, float("inf")
    while not any(len(label_ids[i]) == depth for i in alive):
        options: dict[int, float] = {}
        for i in alive:
            options.setdefault(label_ids[i][depth], token_logprobs[i][depth])
        ranked = sorted(options.values(), reverse=True)
        if len(ranked) > 1:
            margin = min(margin, ranked[0] - ranked[1])
        best = max(options, key=lambda tok: (options[tok], -tok))
        alive = [i for i in alive if label_ids[i][depth] == best]
        depth += 1
    return margin
