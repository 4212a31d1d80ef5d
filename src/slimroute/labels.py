"""Label texts -> token ids, and the two decision rules over per-token label log-probs.

Decision rules (both paths use these; the log-probs themselves are computed separately):
- `greedy`: what generation with a logit mask allowing only tokens that continue some label
  outputs: at each step take the highest-scoring allowed token, stop when a label is complete.
  A label whose tokens are a strict prefix of another label's wins as soon as it is complete.
- `max-prob`: the label with the highest total log-probability (sum over its tokens).
They differ when labels have different lengths or share first tokens.
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
    """One item's answer: the chosen label and each label's exact log-probability."""

    __slots__ = ("label", "logprobs", "num_tokens", "truncated", "error")

    def __init__(self, label=None, logprobs=None, num_tokens=0, truncated=False, error=None):
        self.label: str | None = label
        self.logprobs: dict[str, float] = logprobs or {}
        self.num_tokens: int = num_tokens
        self.truncated: bool = truncated
        self.error: str | None = error

    @classmethod
    def failed(cls, error: str) -> Prediction:
        return cls(error=error)

    @property
    def probs(self) -> dict[str, float]:
        """Probabilities renormalised over the labels (they sum to 1)."""
        if not self.logprobs:
            return {}
        top = max(self.logprobs.values())
        exp = {k: math.exp(v - top) for k, v in self.logprobs.items()}
        total = sum(exp.values())
        return {k: v / total for k, v in exp.items()}

    def __repr__(self):
        return f"Prediction(label={self.label!r}, error={self.error!r})"


def make_prediction(labels, label_ids, token_logprobs, rule, num_tokens=0, truncated=False) -> Prediction:
    choice = decide(rule, label_ids, token_logprobs)
    logprobs = {label: float(sum(lps)) for label, lps in zip(labels, token_logprobs, strict=True)}
    return Prediction(labels[choice], logprobs, num_tokens, truncated)


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
