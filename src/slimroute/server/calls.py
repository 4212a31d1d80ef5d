"""An engine call in progress: a batch's texts, run a step at a time so the worker can run other calls in between.

With `engine.steps(texts)` (an iterator: each step one forward pass, or one chunk of a long text, yielding the
[(index, prediction)] it finished), a step takes about one engine batch's time however long the texts are. An engine
without it (a stand-in, an older engine) runs the whole call as one step, still handing out answers per engine batch
through `classify(on_results=...)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from slimroute.labels import Prediction
from slimroute.server.scheduler import Batch, Slice


class Call:
    """`step()` runs the next step and hands its answers to `answer(slice, prediction)`; False once there are none."""

    def __init__(self, engine, batch: Batch, answer: Callable[[Slice, Prediction], None]):
        self.batch, self._answer = batch, answer
        self.live = [s for s in batch.slices if not s.work.pending.dropped]
        self.tokens_left = sum(batch.tokens(s) for s in self.live)  # item tokens of the texts not answered yet
        self.num_requests = len({id(s.work) for s in self.live})
        self.num_answered, self.busy_seconds, self.done = 0, 0.0, False
        self._steps = steps_of(engine, [s.work.pending.texts[s.row] for s in self.live], self._hand_out)

    def step(self) -> bool:
        """One step; False when the call is over (its last step taken, or every request still waiting has gone).
        Raises what the engine raises (the call is then over too)."""
        start = time.perf_counter()
        try:
            done = next(self._steps, None)
        except BaseException:
            self.done = True
            raise
        finally:
            self.busy_seconds += time.perf_counter() - start
        if done is None:
            self.done = True
            return False
        self._hand_out(done)
        if self.nobody_waits():
            self.close()
            return False
        return True

    def nobody_waits(self) -> bool:
        waiting = [s.work.pending for s in self.unanswered()]
        return bool(waiting) and all(p.dropped for p in waiting)

    def unanswered(self) -> list[Slice]:
        return [s for s in self.live if s.work.pending.answers[s.row] is None]

    def close(self) -> None:
        self.done = True
        self._steps.close()

    def _hand_out(self, done: list[tuple[int, Prediction]]) -> None:
        for i, prediction in done:
            s = self.live[i]
            self.tokens_left -= self.batch.tokens(s)
            self.num_answered += 1
            self._answer(s, prediction)


def steps_of(engine, texts: list[str], hand_out: Callable) -> Iterator[list[tuple[int, Prediction]]]:
    steps = getattr(engine, "steps", None)
    if steps is not None:
        return steps(texts)
    return _one_step(engine, texts, hand_out)


def _one_step(engine, texts: list[str], hand_out: Callable) -> Iterator[list[tuple[int, Prediction]]]:
    engine.classify(texts, on_results=hand_out)
    yield []
