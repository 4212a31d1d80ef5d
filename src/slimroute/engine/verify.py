"""Compare a fast path with the reference on the same items: label agreement and max |Δ log-prob|."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from slimroute.labels import Prediction


@dataclass
class Agreement:
    num_items: int
    num_agree: int
    max_abs_logprob_diff: float
    disagreeing_ids: list[str] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.num_agree / self.num_items if self.num_items else 1.0

    @property
    def ok(self) -> bool:
        return self.num_agree == self.num_items

    def to_dict(self) -> dict:
        return {**asdict(self), "agreement": self.agreement}


def compare(ids: list[str], reference: list[Prediction], fast: list[Prediction]) -> Agreement:
    """Rows where either side has an error are compared on the error only."""
    agree, worst, bad = 0, 0.0, []
    for item_id, ref, got in zip(ids, reference, fast, strict=True):
        same = ref.label == got.label and bool(ref.error) == bool(got.error)
        for label, lp in ref.logprobs.items():
            worst = max(worst, abs(lp - got.logprobs.get(label, float("inf"))))
        agree += same
        if not same:
            bad.append(item_id)
    return Agreement(len(ids), agree, worst, bad)
