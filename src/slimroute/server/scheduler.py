"""Which texts go into the next engine call: requests take turns, and a call holds at most a token budget.

A task's `Rotation` holds the requests with texts still to start, in turn order. A batch (one engine call) takes one
text from each request in turn, passing over the rotation again while there is room, until it holds `max_items` texts
or the next text would take it over `max_tokens` item tokens (a text over the budget goes alone). A request that had
a turn goes back to the end of the rotation only when its call is done, behind every request that arrived meanwhile,
so a short request is never left behind a long request's next text. A request's texts start in their order, its
answers keep it, and no text is answered from another request's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Work:
    """A request as the scheduler sees it: `pending` (the microbatch.Pending) and its progress."""

    pending: Any
    num_tokens: list[int] | None = None  # item tokens per text (set by the worker before the request's first turn)
    next_row: int = 0  # the first text not started
    since: float = field(default_factory=time.perf_counter)  # waiting in the rotation since

    @property
    def has_more(self) -> bool:
        return self.next_row < len(self.pending.texts)

    @property
    def num_unstarted(self) -> int:
        return len(self.pending.texts) - self.next_row


@dataclass(frozen=True)
class Slice:
    work: Work
    row: int  # the text's index in its request


@dataclass
class Batch:
    task: str
    slices: list[Slice] = field(default_factory=list)
    num_tokens: int = 0
    served: list[Work] = field(default_factory=list)  # works that had a turn here, in order (back to the rotation)

    @property
    def works(self) -> list[Work]:
        return list(dict.fromkeys(s.work for s in self.slices))

    def tokens(self, s: Slice) -> int:
        return s.work.num_tokens[s.row]


class Rotation:
    """One task's requests with texts to start, in turn order (see the module docstring)."""

    def __init__(self):
        self.waiting: deque[Work] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, work: Work) -> None:
        work.since = time.perf_counter()
        self.waiting.append(work)

    def remove(self, work: Work) -> bool:
        try:
            self.waiting.remove(work)
        except ValueError:
            return False
        return True

    def put_back(self, batch: Batch) -> None:
        """After the batch ran: its works with texts left go to the end, in the order they had their turns."""
        for work in batch.served:
            if work.has_more and not work.pending.dropped:
                self.add(work)

    def fill(self, batch: Batch, max_items: int, max_tokens: int | None) -> bool:
        """Add texts to the batch in turn order; True when it is closed (full, or the next text does not fit), False
        when the rotation ran out first."""
        order = deque(self.waiting)
        while order and len(batch.slices) < max_items:
            work = order.popleft()
            cost = work.num_tokens[work.next_row]
            if batch.slices and max_tokens is not None and batch.num_tokens + cost > max_tokens:
                return True  # it keeps its place at the front for the next batch
            batch.slices.append(Slice(work, work.next_row))
            batch.num_tokens += cost
            work.next_row += 1
            if work in self.waiting:
                self.waiting.remove(work)
                batch.served.append(work)
            if work.has_more:
                order.append(work)  # another pass may give it another text
        return len(batch.slices) >= max_items or bool(order)
