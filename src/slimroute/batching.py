"""Pure functions: sort by length, bucket by count or token budget, pad, and measure padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_batches(
    lengths: list[int],
    batch_size: int = 32,
    max_batch_tokens: int | None = None,
    sort: bool = True,
    max_padding: float | None = None,
) -> list[list[int]]:
    """Group item indices into batches; each batch is padded to its longest item.

    With `max_batch_tokens`, a batch grows while (items x longest item) stays within the budget;
    an item longer than the budget forms a batch of its own. With `max_padding`, a batch is closed
    before an item that would make its padded share exceed that fraction (this keeps the sparse
    long tail from padding whole batches).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if sort else list(range(len(lengths)))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = real = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        padded = new_longest * (len(current) + 1)
        too_many = len(current) >= batch_size
        too_big = max_batch_tokens is not None and padded > max_batch_tokens
        too_padded = max_padding is not None and (padded - real - lengths[i]) > max_padding * padded
        if current and (too_many or too_big or too_padded):
            batches.append(current)
            current, new_longest, real = [], lengths[i], 0
        current.append(i)
        longest, real = new_longest, real + lengths[i]
    if current:
        batches.append(current)
    return batches


@dataclass
class PaddingStats:
    real_tokens: int = 0  # item tokens that carry text
    processed_tokens: int = 0  # item tokens run through the model, padding included

    @property
    def padded_tokens(self) -> int:
        return self.processed_tokens - self.real_tokens

    @property
    def overhead(self) -> float:
        """Padded tokens / processed tokens."""
        return self.padded_tokens / self.processed_tokens if self.processed_tokens else 0.0

    def add(self, lengths: list[int]) -> None:
        self.real_tokens += sum(lengths)
        self.processed_tokens += max(lengths) * len(lengths)

    def merge(self, other: PaddingStats) -> None:
        self.real_tokens += other.real_tokens
        self.processed_tokens += other.processed_tokens


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, L), attention_mask (B, L), lengths (B,)) with padding after each sequence."""
    lengths = torch.tensor([len(s) for s in seqs])
    width = int(lengths.max())
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return input_ids, mask, lengths
