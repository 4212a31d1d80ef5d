"""What the fast path and the reference both decide with, set up once for one model and task.

`TaskSetup` holds the prompt's token ids (task.Prompt), the label tokens, the answers (the task's labels, or a tuned
head's: accuracy/head.py), the calibration offsets subtracted before the decision (accuracy/calibration.py) and the
fallback floor applied after it (labels.Fallback). `Classifier` is what Engine (fast.py) and ReferenceClassifier
(reference.py) share on top of it, so the two differ only in how they run the model: one decision, one place.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from slimroute.accuracy.calibration import Offsets, check_head
from slimroute.accuracy.head import Head
from slimroute.labels import Fallback, Prediction, apply_offsets, check_decision, decision_margin, make_prediction
from slimroute.task import Prompt, Task


@dataclass(frozen=True)
class TaskSetup:
    prompt: Prompt
    decision: str  # labels.DECISIONS
    head: Head | None = None  # a tuned head decides instead of the label tokens (its labels are the answers)
    calibration: Offsets | None = None  # subtracted from the label log-probs before the decision (never with a head)
    fallback: Fallback | None = None  # the floor under the answers

    @classmethod
    def build(cls, model, tokenizer, task: Task, decision: str = "greedy", max_positions: int = 32768,
              head: Head | None = None, calibration: Offsets | None = None,
              fallback: Fallback | None = None) -> TaskSetup:
        """Checked: a head must have been tuned on this model, tokenizer and task (else HeadMismatchError);
        offsets must fit the answers; a fallback label may not be one of them (ValueError)."""
        prompt = Prompt(task, tokenizer, max_positions)
        if head is not None:
            head.check(model, tokenizer, task)
        setup = cls(prompt, check_decision(decision), head, None,
                    fallback.check(head.labels if head else task.labels) if fallback is not None else None)
        return setup.with_calibration(calibration)

    @property
    def task(self) -> Task:
        return self.prompt.task

    @property
    def label_ids(self) -> list[tuple[int, ...]]:
        """The task labels' tokens, as they follow the assistant-turn start."""
        return self.prompt.label_ids

    @property
    def labels(self) -> tuple[str, ...]:
        """The answers: the head's labels with a head, else the task's."""
        return self.head.labels if self.head is not None else self.task.labels

    @property
    def answer_ids(self) -> list[tuple[int, ...]]:
        """What the decision rule walks: the label tokens, or one pseudo-token per head label."""
        return self.head.answer_ids if self.head is not None else self.label_ids

    @property
    def offsets(self):
        return self.calibration.values if self.calibration is not None else None

    def with_calibration(self, offsets: Offsets | None) -> TaskSetup:
        check_head(self.head, offsets)
        checked = offsets.check(self.labels, self.answer_ids) if offsets is not None else None
        return replace(self, calibration=checked)

    def decide(self, token_logprobs, num_tokens: int = 0, truncated: bool = False) -> Prediction:
        """The prediction from token_logprobs[answer][k]: offsets subtracted, the rule, then the floor."""
        return make_prediction(self.labels, self.answer_ids, token_logprobs, self.decision, num_tokens, truncated,
                               self.offsets, self.fallback)

    def margin(self, token_logprobs) -> float:
        """How far the (calibrated) decision is from flipping (labels.decision_margin)."""
        scores = apply_offsets(token_logprobs, self.offsets) if self.offsets is not None else token_logprobs
        return decision_margin(self.decision, self.answer_ids, scores)


class Classifier:
    """A model and tokenizer deciding through a TaskSetup: Engine and ReferenceClassifier. Subclasses run the model
    (classify) and may re-decide a row their own way (_decide); the rest is here."""

    def __init__(self, model, tokenizer, setup: TaskSetup):
        self.model, self.tokenizer, self.setup = model, tokenizer, setup

    task = property(lambda self: self.setup.task)
    prompt = property(lambda self: self.setup.prompt)
    label_ids = property(lambda self: self.setup.label_ids)
    labels = property(lambda self: self.setup.labels)
    answer_ids = property(lambda self: self.setup.answer_ids)
    head = property(lambda self: self.setup.head)
    calibration = property(lambda self: self.setup.calibration)
    fallback = property(lambda self: self.setup.fallback)

    def with_calibration(self, offsets: Offsets | None):
        """This classifier (model, caches and running stats shared) deciding with `offsets`."""
        clone = copy.copy(self)
        clone.setup = self.setup.with_calibration(offsets)
        return clone

    def redecide(self, texts: list[str], preds: list[Prediction]) -> list[Prediction]:
        """Predictions made before the offsets were known (a stream's first window), decided again with them;
        error rows pass."""
        return [p if p.error is not None or p.token_logprobs is None
                else self._decide(text, p.token_logprobs, p.num_tokens, p.truncated)
                for text, p in zip(texts, preds, strict=True)]

    def _decide(self, text: str, token_logprobs, num_tokens: int, truncated: bool) -> Prediction:
        return self.setup.decide(token_logprobs, num_tokens, truncated)
