"""Label texts -> token ids, and the two decision rules over per-token label log-probs.

Decision rules (both paths use these; the log-probs themselves are computed separately):
- `greedy`: what generation with a logit mask allowing only tokens that continue some label
  outputs: at each step take the highest-scoring allowed token, stop when a label is complete.
  A label whose tokens are a strict prefix of another label's wins as soon as it is complete.
- `max-prob`: the label with the highest total log-probability (sum over its tokens).
They differ when labels have different lengths or share first tokens.

Calibration (calibration.py) subtracts an offset from each label token's log-prob before either
rule decides; the model's own log-probs are kept next to the calibrated ones.

A fallback floor (`Fallback`) comes last: when the chosen label's probability (`Prediction.probs`, the ones the
decision used) is below `min_prob`, the answer is the fallback label (a route such as a human queue) and the
model's own choice stays in `model_label`. Both paths apply it to the same numbers, so it cannot split them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECISIONS = ("greedy", "max-prob")
DEFAULT_FALLBACK = "unsure"


@dataclass(frozen=True)
class Fallback:
    """Answer `label` instead of the model's choice when that choice's probability is below `min_prob`."""

    min_prob: float
    label: str = DEFAULT_FALLBACK

    def __post_init__(self):
        if isinstance(self.min_prob, bool) or not isinstance(self.min_prob, (int, float)) \
                or not 0 < self.min_prob <= 1:
            raise ValueError(f"min_prob must be a probability in (0, 1], got {self.min_prob!r}")
        if not isinstance(self.label, str) or not self.label.strip() or self.label != self.label.strip():
            raise ValueError(f"fallback_label must be a non-empty string without outer spaces, got {self.label!r}")

    def check(self, labels) -> Fallback:
        """This floor, if its label is not one of the answers (else a row could not tell the two apart)."""
        if self.label in labels:
            raise ValueError(f"fallback_label {self.label!r} is one of the labels {list(labels)}; "
                             "pick a name no label has (e.g. --fallback-label unsure)")
        return self


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
    walk = _GreedyWalk(label_ids, token_logprobs)
    for _ in walk:
        pass
    return walk.chosen


class _GreedyWalk:
    """The greedy path through the label trie: iterating yields each step's allowed next tokens and their log-probs
    (labels sharing the path share the context); `chosen` is then the label it completes (a label whose tokens are a
    prefix of another's wins as soon as it is complete). The one walk behind greedy_choice and decision_margin."""

    def __init__(self, label_ids: list[tuple[int, ...]], token_logprobs: list[list[float]]):
        self.label_ids, self.token_logprobs = label_ids, token_logprobs
        self.chosen: int | None = None

    def __iter__(self):
        ids, alive, depth = self.label_ids, list(range(len(self.label_ids))), 0
        while not (complete := [i for i in alive if len(ids[i]) == depth]):
            options: dict[int, float] = {}
            for i in alive:
                options.setdefault(ids[i][depth], self.token_logprobs[i][depth])
            yield options
            best = max(options, key=lambda tok: (options[tok], -tok))
            alive = [i for i in alive if ids[i][depth] == best]
            depth += 1
        self.chosen = complete[0]


def trie_paths(label_ids: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Distinct non-empty proper prefixes of the labels: the contexts that need an extra step."""
    paths = {ids[:k] for ids in label_ids for k in range(1, len(ids))}
    return sorted(paths, key=lambda p: (len(p), p))


def continuation_runs(label_ids: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...],
                                                                                          tuple[int, int]]]:
    """What to feed behind an item so that every context of trie_paths gets its hidden state once: the contexts
    no other one extends (shortest first), and for each context the run and the position in it whose state
    follows the context's last token. ("Technical Support" and "Technical Sales" share the run's first state.)"""
    contexts = trie_paths(label_ids)
    extended = {context[:k] for context in contexts for k in range(1, len(context))}
    runs = [context for context in contexts if context not in extended]
    where: dict[tuple[int, ...], tuple[int, int]] = {}
    for i, run in enumerate(runs):
        for k in range(1, len(run) + 1):
            where.setdefault(run[:k], (i, k - 1))
    return runs, where


class Prediction:
    """One item's answer: the chosen label and each label's exact log-probability.

    `logprobs` are the model's (the sum over each label's tokens; `token_logprobs` per token). With
    calibration, `calibrated_logprobs` are the scores the decision used (log-prob minus offsets) and
    `probs` come from them; `raw_probs` always come from the model's log-probs. `model_label` is the
    decision's choice; `label` is the same unless a Fallback floor routed the item to its label."""

    __slots__ = ("label", "logprobs", "num_tokens", "truncated", "error", "token_logprobs", "calibrated_logprobs",
                 "model_label")

    def __init__(self, label=None, logprobs=None, num_tokens=0, truncated=False, error=None, token_logprobs=None,
                 calibrated_logprobs=None, model_label=None):
        self.label: str | None = label  # the answer: the fallback label when a floor routed it there
        self.model_label: str | None = model_label if model_label is not None else label  # the decision's choice
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
        routed = f", model_label={self.model_label!r}" if self.model_label != self.label else ""
        return f"Prediction(label={self.label!r}{routed}, error={self.error!r})"


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
                    offsets=None, fallback: Fallback | None = None) -> Prediction:
    """The decision over the label tokens' log-probs, after subtracting `offsets` when given; then, with a
    fallback, its label when the chosen label's probability is below the floor."""
    scores = apply_offsets(token_logprobs, offsets) if offsets is not None else token_logprobs
    choice = decide(rule, label_ids, scores)
    logprobs = {label: float(sum(lps)) for label, lps in zip(labels, token_logprobs, strict=True)}
    calibrated = None
    if offsets is not None:
        calibrated = {label: float(sum(s)) for label, s in zip(labels, scores, strict=True)}
    pred = Prediction(labels[choice], logprobs, num_tokens, truncated, None, token_logprobs, calibrated)
    if fallback is not None and pred.probs[pred.model_label] < fallback.min_prob:
        pred.label = fallback.label
    return pred


def redecide(pred: Prediction, labels, label_ids, rule: str, offsets=None, fallback: Fallback | None = None
             ) -> Prediction:
    """The same prediction decided again from its per-token log-probs with `offsets` (error rows pass)."""
    if pred.error is not None or pred.token_logprobs is None:
        return pred
    return make_prediction(labels, label_ids, pred.token_logprobs, rule, pred.num_tokens, pred.truncated, offsets,
                           fallback)


def decision_margin(rule: str, label_ids: list[tuple[int, ...]], token_logprobs: list[list[float]]) -> float:
    """How far the decision is from flipping: the smallest log-prob gap between the chosen option and the
    runner-up (at each greedy step, or between the top two label totals for max-prob)."""
    if len(label_ids) < 2:
        return float("inf")
    if rule == "max-prob":
        totals = sorted((sum(lps) for lps in token_logprobs), reverse=True)
        return totals[0] - totals[1]
    margin = float("inf")
    for options in _GreedyWalk(label_ids, token_logprobs):
        ranked = sorted(options.values(), reverse=True)
        if len(ranked) > 1:
            margin = min(margin, ranked[0] - ranked[1])
    return margin
