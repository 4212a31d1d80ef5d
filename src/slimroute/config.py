"""Settings as frozen dataclasses; a bad value raises ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from slimroute.labels import DECISIONS, DEFAULT_FALLBACK, Fallback


@dataclass(frozen=True)
class EngineConfig:
    batch_size: int = 32  # items per batch (upper bound when max_batch_tokens is set)
    # Padded item tokens per batch (items x longest item); None: batches by count only. A budget keeps each batch's
    # activations in the CPU's caches (docs/design.md).
    max_batch_tokens: int | None = 512
    max_padding: float | None = None  # optional hard cap on a batch's padded share of tokens
    # The fixed cost of one forward pass in item tokens (streaming the weights once); sorted batches are the
    # cheapest split under (this + padded tokens): about 40 tokens' time for the 0.5B model on 2 cores.
    batch_overhead_tokens: int = 40
    prefix_cache: bool = True  # compute the shared prompt prefix once and reuse its keys/values
    sort: bool = True  # sort items by token length before batching
    decision: str = "greedy"  # "greedy" or "max-prob" (see labels.py)
    # Near-ties whose decision margin (log-prob gap to the runner-up) is below this are re-decided by the
    # exact one-at-a-time path, so bf16 batching noise cannot flip them. None: off (fp32 needs none).
    recheck_margin: float | None = None
    # A floor under the answers: an item whose chosen label has probability below min_prob (the probabilities
    # the decision used, renormalised over the labels) gets fallback_label ("unsure" when None) instead.
    # None: off. Applied after the decision, identically in the reference.
    min_prob: float | None = None
    fallback_label: str | None = None
    # Chunked prefill: an item longer than this many tokens runs alone, in forward passes of this many of its tokens,
    # its keys and values carried over from pass to pass, so no pass takes longer than about one batch's time and a
    # caller stepping the engine (Engine.steps: the server) runs other requests in between. A multiple of the
    # batch-invariant attention's tile (32); None: every item in one pass. The same bits as one pass where the
    # attention is batch-invariant (int8); within the kernels' rounding elsewhere.
    chunk_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {self.max_batch_tokens!r}")
        if self.max_padding is not None and not 0 <= self.max_padding < 1:
            raise ValueError(f"max_padding must be in [0, 1) or None, got {self.max_padding!r}")
        if not isinstance(self.batch_overhead_tokens, int) or self.batch_overhead_tokens < 0:
            raise ValueError(f"batch_overhead_tokens must be an integer >= 0, got {self.batch_overhead_tokens!r}")
        if self.recheck_margin is not None and self.recheck_margin < 0:
            raise ValueError(f"recheck_margin must be >= 0 or None, got {self.recheck_margin!r}")
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {', '.join(DECISIONS)}, got {self.decision!r}")
        if self.chunk_tokens is not None and (not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 32
                                              or self.chunk_tokens % 32):
            raise ValueError(f"chunk_tokens must be a multiple of 32 (the attention's tile), or None, got "
                             f"{self.chunk_tokens!r}")
        if self.fallback_label is not None and self.min_prob is None:
            raise ValueError(f"fallback_label {self.fallback_label!r} needs min_prob (the floor it applies under)")
        _ = self.fallback  # builds the Fallback, which raises naming a bad min_prob or fallback_label

    @property
    def fallback(self) -> Fallback | None:
        if self.min_prob is None:
            return None
        return Fallback(self.min_prob, DEFAULT_FALLBACK if self.fallback_label is None else self.fallback_label)
