"""Hidden states -> label log-probs at the scored positions only.

The exact log-probability needs the normaliser over the whole vocabulary, so the output head runs at each
scored position (one per item and label step, never at every position: about 0.3 GFLOP per item for
Qwen2.5-0.5B, under 1% of the item's forward pass) and the label columns are read from its log-softmax, the same
arithmetic as the reference's, so a batch-invariant head (output_head.RowBlockedLinear) gives the reference's bits.
"""

from __future__ import annotations

import torch


class LabelScorer:
    """softcap: the model's final logit soft-capping (Gemma 2's final_logit_softcapping), applied as its forward
    applies it, in the head's dtype, before the log-softmax."""

    def __init__(self, lm_head: torch.nn.Module, token_ids: list[int], softcap: float | None = None):
        self.head = lm_head
        self.softcap = softcap
        self.token_ids = sorted(set(token_ids))
        self.column = {tok: j for j, tok in enumerate(self.token_ids)}
        weight = getattr(lm_head, "weight", None)  # None: output_head.RowBlockedLinear holding a compact weight
        self.dtype, device = (weight.dtype, weight.device) if weight is not None else (lm_head.dtype, lm_head.device)
        self.index = torch.tensor(self.token_ids, device=device)  # (K,)

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) hidden states -> (N, K) log-probs of the label tokens, columns as in `column`."""
        logits = self.head(hidden.to(self.dtype))  # (N, V)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits.float(), dim=-1).index_select(1, self.index)  # (N, K)
