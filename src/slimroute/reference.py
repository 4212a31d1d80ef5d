"""The obviously-correct slow path: one item at a time, full prompt, no cache, no padding.

For every context the decision needs (the prompt, then the prompt plus each proper prefix of
a multi-token label) it runs the whole model over the whole sequence and takes the full-vocabulary
log-softmax at the last position. Every fast path is tested against this.
"""

from __future__ import annotations

import torch

from slimroute.labels import Prediction, check_decision, make_prediction
from slimroute.task import Prompt, Task, encode, render_prompt


class ReferenceClassifier:
    def __init__(self, model, tokenizer, task: Task, decision: str = "greedy", max_positions: int = 32768):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.decision = check_decision(decision)
        # Only label tokenisation and the context-length policy are shared with the fast path.
        self.prompt = Prompt(task, tokenizer, max_positions)
        self.label_ids = self.prompt.label_ids

    @torch.inference_mode()
    def _next_token_logprobs(self, ids: list[int]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        logits = self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits  # (1, 1, V)
        return torch.log_softmax(logits[0, -1].float(), dim=-1)

    def classify_one(self, text: str) -> Prediction:
        text, truncated = self.prompt.fit_text(text)
        prompt_ids = encode(self.tokenizer, render_prompt(self.tokenizer, self.task, text))
        memo: dict[tuple[int, ...], torch.Tensor] = {}
        token_logprobs = []
        for ids in self.label_ids:
            lps = []
            for k, token in enumerate(ids):
                context = ids[:k]
                if context not in memo:
                    memo[context] = self._next_token_logprobs(prompt_ids + list(context))
                lps.append(float(memo[context][token]))
            token_logprobs.append(lps)
        return make_prediction(
            self.task.labels, self.label_ids, token_logprobs, self.decision, len(prompt_ids), truncated
        )

    def classify(self, texts: list[str], progress=None) -> list[Prediction]:
        preds = []
        for text in texts:
            preds.append(self.classify_one(text))
            if progress:
                progress(1)
        return preds
