"""The obviously-correct slow path: one item at a time, full prompt, no cache, no padding.

For every context the decision needs (the prompt, then the prompt plus each proper prefix of
a multi-token label) it runs the whole model over the whole sequence and takes the full-vocabulary
log-softmax at the last position. With a tuned head it runs the whole prompt once more for the
final-norm hidden state at the last position (and, for a +mean head, their mean over the item's tokens; for a
head with `layers`, those decoder layers' means too) and applies the head to it. Calibration offsets, when
set, are subtracted from the label log-probs before the decision (never with a head). Every fast path is tested
against this. (It tells the batch-invariant attention kernel where the fast path's passes start, so that kernel
tiles the sequence's queries as the fast path does: attention.segments. Other kernels ignore it.)
"""

from __future__ import annotations

import torch

from slimroute.accuracy.head import item_states
from slimroute.engine.setup import Classifier, TaskSetup
from slimroute.labels import Fallback, Prediction
from slimroute.runtime.attention import segments
from slimroute.task import Task, encode, render_prompt


class ReferenceClassifier(Classifier):
    def __init__(self, model, tokenizer, task: Task, decision: str = "greedy", max_positions: int = 32768,
                 head=None, calibration=None, fallback: Fallback | None = None):
        """head: a tuned Head deciding instead of the label tokens; calibration: accuracy.calibration.Offsets
        subtracted from the label log-probs before the decision (not with a head: ValueError); fallback: the floor
        under the answers (labels.Fallback), as the engine's config has it."""
        super().__init__(model, tokenizer, TaskSetup.build(model, tokenizer, task, decision, max_positions, head,
                                                           calibration, fallback))

    @classmethod
    def from_setup(cls, model, tokenizer, setup: TaskSetup) -> ReferenceClassifier:
        """A reference deciding exactly as an engine with this setup does (the engine's near-tie recheck)."""
        reference = cls.__new__(cls)
        Classifier.__init__(reference, model, tokenizer, setup)
        return reference

    @torch.inference_mode()
    def _next_token_logprobs(self, ids: list[int], item_end: int) -> torch.Tensor:
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        with segments(len(self.prompt.prefix_ids), continuation=item_end):  # where the fast path's passes start
            logits = self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits  # (1, 1, V)
        return torch.log_softmax(logits[0, -1].float(), dim=-1)

    @torch.inference_mode()
    def _item_states(self, ids: list[int]) -> torch.Tensor:
        """The head's states of one item (head.item_states): the final-norm hidden state at the last position
        and/or the mean over the item's tokens, everything after the task's prefix."""
        device = next(self.model.parameters()).device
        with segments(len(self.prompt.prefix_ids)):
            out = self.model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1,
                             output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (1, T, H): the last layer's entry is after the final norm
        return item_states(hidden, [len(ids) - 1], [len(ids) - len(self.prompt.prefix_ids)], self.head.states,
                           tuple(out.hidden_states[k] for k in self.head.layers))

    def classify_one(self, text: str) -> Prediction:
        text, truncated = self.prompt.fit_text(text)
        prompt_ids = encode(self.tokenizer, render_prompt(self.tokenizer, self.task, text))
        if self.head is not None:
            label_lps = [self._label_logprobs(prompt_ids)] if self.head.uses_label_logprobs else None
            lps = self.head.token_logprobs(self._item_states(prompt_ids), label_lps)[0]
        else:
            lps = self._label_logprobs(prompt_ids)
        return self.setup.decide(lps, len(prompt_ids), truncated)

    def _label_logprobs(self, prompt_ids: list[int]) -> list[list[float]]:
        """token_logprobs[label][k] = log p(label's k-th token | prompt + its first k tokens)."""
        memo: dict[tuple[int, ...], torch.Tensor] = {}
        token_logprobs = []
        for ids in self.label_ids:
            lps = []
            for k, token in enumerate(ids):
                context = ids[:k]
                if context not in memo:
                    memo[context] = self._next_token_logprobs(prompt_ids + list(context), len(prompt_ids))
                lps.append(float(memo[context][token]))
            token_logprobs.append(lps)
        return token_logprobs

    def classify(self, texts: list[str], progress=None) -> list[Prediction]:
        preds = []
        for text in texts:
            preds.append(self.classify_one(text))
            if progress:
                progress(1)
        return preds
