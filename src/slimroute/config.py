"""Settings as frozen dataclasses; a bad value raises ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from slimroute.labels import DECISIONS


@dataclass(frozen=True)
class EngineConfig:
    batch_size: int = 32  # items per batch (upper bound when max_batch_tokens is set)
    max_batch_tokens: int | None = None  # padded item tokens per batch (batch size x longest item)
    prefix_cache: bool = True  # compute the shared prompt prefix once and reuse its keys/values
    sort: bool = True  # sort items by token length before batching
    decision: str = "greedy"  # "greedy" or "max-prob" (see labels.py)

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {self.max_batch_tokens!r}")
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {', '.join(DECISIONS)}, got {self.decision!r}")
