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
    batch_overhead_tokens: int = 40,
) -> list[list[int]]:
    """Group item indices into batches; each batch is padded to its longest item.

    Limits on every batch: at most `batch_size` items; with `max_batch_tokens`, (items x longest item)
    within the budget (an item longer than the budget goes alone); with `max_padding`, padded tokens at
    most that share of the batch's tokens.

    Sorted (the default): the cheapest split of the length-sorted items within the limits, where a batch
    costs `batch_overhead_tokens` (the fixed cost of a forward pass: the weights stream through memory
    once per batch) plus its padded tokens. So a long-tail item goes alone when padding its neighbours
    would cost more than a pass of its own, and a handful of mixed lengths (a server's micro-batch) is
    split only where it pays. Unsorted: batches fill in input order until a limit is hit.
    """
    if not sort:
        return _fill_in_order(lengths, batch_size, max_batch_tokens, max_padding)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    # cost[i]: the cheapest plan of the i shortest items; first[i]: where that plan's last batch starts
    cost, first = [0] * (len(sizes) + 1), [0] * (len(sizes) + 1)
    for i in range(1, len(sizes) + 1):
        longest, real, best = sizes[i - 1], 0, None
        for j in range(i - 1, max(i - batch_size, 0) - 1, -1):  # last batch = sizes[j:i]
            count, real = i - j, real + sizes[j]
            padded = count * longest
            if count > 1 and max_batch_tokens is not None and padded > max_batch_tokens:
                break
            if count > 1 and max_padding is not None and padded - real > max_padding * padded:
                break  # a shorter item only adds padding
            total = cost[j] + batch_overhead_tokens + padded
            if best is None or total < best:
                best, first[i] = total, j
        cost[i] = best
    batches, i = [], len(sizes)
    while i:
        batches.append(order[first[i]:i])
        i = first[i]
    return batches[::-1]


def _fill_in_order(lengths, batch_size, max_batch_tokens, max_padding) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    longest = real = 0
    for i in range(len(lengths)):
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
