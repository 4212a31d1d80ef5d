"""Hidden states -> label log-probs at the scored positions only.

The exact log-probability needs the normaliser over the whole vocabulary, so the output head runs at each
scored position (one per item and label step, never at every position: 0.14 G multiply-adds per item for
Qwen2.5-0.5B, about 1.5% of an int8 item's time) and the label columns are read from its log-softmax, the same
arithmetic as the reference's, so a batch-invariant head (runtime/output_head.py) gives the reference's bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LabelScorer:
    """config: the model's, for what its forward does to the output head's logits before anyone reads them
    (logit_transform); the scorer does the same, in the head's dtype, before the log-softmax."""

    def __init__(self, lm_head: torch.nn.Module, token_ids: list[int], config=None):
        self.head = lm_head
        self.transform = logit_transform(config) if config is not None else None
        self.token_ids = sorted(set(token_ids))
        self.column = {tok: j for j, tok in enumerate(self.token_ids)}
        weight = getattr(lm_head, "weight", None)  # None: an output_head module holding a compact weight
        self.dtype, device = (weight.dtype, weight.device) if weight is not None else (lm_head.dtype, lm_head.device)
        self.index = torch.tensor(self.token_ids, device=device)  # (K,)

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) hidden states -> (N, K) log-probs of the label tokens, columns as in `column`."""
        logits = self.head(hidden.to(self.dtype))  # (N, V)
        if self.transform is not None:
            logits = self.transform(logits)
        return torch.log_softmax(logits.float(), dim=-1).index_select(1, self.index)  # (N, K)


def logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model's forward does to the output head's logits, as its code does it: Gemma 2's soft cap
    (final_logit_softcapping), Granite's division by logits_scaling, Cohere's product with logit_scale; None for
    most (Qwen, Llama, Mistral, Gemma 3...). check_scorer catches a model that does something else."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", "")
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is not None:
        return lambda logits: torch.tanh(logits / cap) * cap
    if kind.startswith("granite") and getattr(text, "logits_scaling", 1.0) != 1.0:
        return lambda logits: logits / text.logits_scaling
    if kind.startswith("cohere") and getattr(text, "logit_scale", 1.0) != 1.0:
        return lambda logits: logits * text.logit_scale
    return None


@torch.inference_mode()
def check_scorer(model, scorer: LabelScorer, ids: list[int], tolerance: float = 1e-2) -> None:
    """Raise ValueError when the scorer's log-probs after `ids` are not the model's own (its forward changes the
    logits in a way logit_transform does not know), instead of answering with the wrong numbers."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    out = model(input_ids=input_ids, logits_to_keep=1, output_hidden_states=True)  # one pass for both
    own = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    ours = scorer.logprobs(out.hidden_states[-1][0, -1:])[0]  # the last entry is after the final norm: (1, H)
    gap = float((ours - own.index_select(0, scorer.index)).abs().max())
    if not gap <= tolerance:
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise ValueError(f"slimroute's label scorer does not reproduce this model's log-probabilities ({kind}: they "
                         f"differ by {gap:.3g}; its forward changes the output head's logits in a way slimroute does "
                         "not know yet); use another model, or report the model")
