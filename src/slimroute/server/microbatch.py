"""Requests from many callers -> engine batches, in one worker thread that owns the engines.

`submit()` runs on the event loop and only appends to a bounded queue. The worker takes the
oldest waiting request, keeps the batch open for up to `max_wait_ms` while more requests of the
same task arrive (up to `max_batch_items` texts and `max_gather_tokens` item tokens), calls
`engine.classify` once on all their texts (the engine sorts and buckets them by length), and
hands each request its own answers through its asyncio future as soon as the engine's batch that
finishes its last text is done, so its client can send the next request while the engine still
works on longer texts (those requests then fill the next call). A request is never split across
engine calls, so one caller's texts cannot be mixed into another's answers.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from slimroute.engine.fast import decoder_layers
from slimroute.labels import Prediction
from slimroute.runtime.memory import share_the_main_malloc_arena


@dataclass(frozen=True)
class BatchSettings:
    max_batch_items: int = 32  # texts gathered into one engine call (a larger request goes alone)
    max_gather_tokens: int | None = None  # item tokens gathered into one engine call
    max_wait_ms: float = 50.0  # how long a batch stays open for more requests after its first one
    max_queue_items: int = 1024  # texts waiting; beyond this submit() raises QueueFull
    max_text_tokens: int | None = 2048  # longer texts are refused (TextTooLong)

    def __post_init__(self):
        for name in ("max_batch_items", "max_queue_items"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_gather_tokens", "max_text_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not 0 <= self.max_wait_ms <= 10_000:
            raise ValueError(f"max_wait_ms must be between 0 and 10000, got {self.max_wait_ms!r}")


class QueueFull(Exception):
    def __init__(self, queued: int, limit: int, retry_after_s: int):
        super().__init__(f"the queue holds {queued} texts (limit {limit}); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


class TextTooLong(ValueError):
    def __init__(self, index: int, num_tokens: int, limit: int):
        super().__init__(f"texts[{index}] has {num_tokens} tokens; the limit is {limit} tokens per text")
        self.index = index


class EngineFailed(RuntimeError):
    pass


class NobodyWaits(Exception):
    """Raised in the worker, before a transformer layer runs, to stop an engine call whose waiting
    requests have all been dropped (their clients went away): the worker is free within one layer."""


@dataclass(frozen=True)
class BatchResult:
    predictions: list[Prediction]
    queue_seconds: float  # from submit() to the start of the engine call
    engine_seconds: float
    batch_items: int  # texts in the engine call that answered this request
    batch_requests: int


@dataclass(eq=False)
class Pending:
    task: str
    texts: list[str]
    future: asyncio.Future
    submitted_at: float = field(default_factory=time.perf_counter)
    num_tokens: list[int] | None = None  # item tokens per text, set by the worker
    dropped: bool = False


class MicroBatcher:
    def __init__(self, engines: dict, settings: BatchSettings | None = None, metrics=None):
        self.engines = engines
        self.settings = settings or BatchSettings()
        self.metrics = metrics  # a prometheus.Prometheus, or None
        self._queues: dict[str, deque[Pending]] = {name: deque() for name in engines}
        self._num_queued = 0
        self._cond = threading.Condition()
        self._closing = False
        self._items_per_s = 0.0  # recent throughput, for Retry-After
        self._thread = threading.Thread(target=self._run, name="slimroute-microbatch", daemon=True)
        self._nobody_waits = None  # during an engine call: () -> True once every request still waiting has gone
        self._hooks: list = []

    # ---------------------------------------------------------------- event-loop side

    def start(self) -> None:
        share_the_main_malloc_arena()
        self._hooks = [layer.register_forward_pre_hook(self._stop_if_nobody_waits)
                       for layer in transformer_layers(self.engines)]
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._closing

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def submit(self, task: str, texts: list[str]) -> Pending:
        """Queue one request; its future resolves to a BatchResult (or raises)."""
        if task not in self._queues:
            raise KeyError(task)
        pending = Pending(task, list(texts), asyncio.get_running_loop().create_future())
        with self._cond:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            limit = self.settings.max_queue_items
            if self._num_queued + len(texts) > limit and self._num_queued > 0:
                raise QueueFull(self._num_queued, limit, self.retry_after_s())
            self._queues[task].append(pending)
            self._num_queued += len(texts)
            self._cond.notify()
        self._report_depth()
        return pending

    def drop(self, pending: Pending) -> bool:
        """Forget a request whose caller went away; True if it was still waiting in the queue."""
        with self._cond:
            pending.dropped = True
            queue = self._queues[pending.task]
            if pending not in queue:
                return False
            queue.remove(pending)
            self._num_queued -= len(pending.texts)
        self._report_depth()
        return True

    def retry_after_s(self) -> int:
        if self._items_per_s <= 0:
            return 1
        return min(60, max(1, math.ceil(self._num_queued / self._items_per_s)))

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, answer every queued one, then stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for hook in self._hooks:
            hook.remove()

    # ---------------------------------------------------------------- worker side

    def _run(self) -> None:
        while (batch := self._gather()) is not None:
            try:
                if batch:
                    self._execute(batch[0].task, batch)
            except Exception as exc:  # noqa: BLE001 - a bug here must not stop the worker
                for pending in batch:
                    _settle(pending, error=EngineFailed(f"internal error: {type(exc).__name__}: {exc}"))

    def _gather(self) -> list[Pending] | None:
        """The next batch (possibly empty when its requests were refused), or None to stop."""
        with self._cond:
            while not self._num_queued:
                if self._closing:
                    return None
                self._cond.wait()
            task = min((q for q in self._queues.values() if q), key=lambda q: q[0].submitted_at)[0].task
            queue = self._queues[task]
            first = self._pop(queue)
        if not self._measure(first):
            return []
        batch, num_items, num_tokens = [first], len(first.texts), sum(first.num_tokens)
        deadline = time.perf_counter() + self.settings.max_wait_ms / 1000
        while num_items < self.settings.max_batch_items:
            with self._cond:
                while not queue and not self._closing and (left := deadline - time.perf_counter()) > 0:
                    self._cond.wait(left)
                if not queue or num_items + len(queue[0].texts) > self.settings.max_batch_items:
                    break
                nxt = self._pop(queue)
            if not self._measure(nxt):
                continue
            budget = self.settings.max_gather_tokens
            if budget is not None and num_tokens + sum(nxt.num_tokens) > budget:
                self._put_back(queue, nxt)
                break
            batch.append(nxt)
            num_items += len(nxt.texts)
            num_tokens += sum(nxt.num_tokens)
        self._report_depth()
        return batch

    def _pop(self, queue: deque[Pending]) -> Pending:
        pending = queue.popleft()
        self._num_queued -= len(pending.texts)
        return pending

    def _put_back(self, queue: deque[Pending], pending: Pending) -> None:
        with self._cond:
            if not pending.dropped:
                queue.appendleft(pending)
                self._num_queued += len(pending.texts)

    def _measure(self, pending: Pending) -> bool:
        """Token counts of the request's texts (as far as the engine reads them); refuse it (False) when one is over
        the limit, unless the task reads no text further than the limit (truncate_tokens)."""
        if pending.num_tokens is not None:
            return True
        engine = self.engines[pending.task]
        prompt = engine.prompt
        cut = prompt.task.truncate_tokens  # a task that reads each text's first tokens only
        try:  # item tokens as far as the engine reads them (a budget: a cut text counts as one at the cap)
            pending.num_tokens = [min(len(ids), prompt.max_item_tokens) for ids in prompt.item_ids_batch(pending.texts)]
            limit = self.settings.max_text_tokens
            if limit is not None and not (cut and cut <= limit):  # a text it reads no further than the limit: fine
                text_ids = engine.tokenizer([t.strip() for t in pending.texts], add_special_tokens=False)
                for i, ids in enumerate(text_ids["input_ids"]):
                    if len(ids) > limit:
                        raise TextTooLong(i, len(ids), limit)
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the worker goes on
            self._count_error(pending.task, "too_long" if isinstance(exc, TextTooLong) else "tokenizer")
            _settle(pending, error=exc)
            return False
        return True

    def _execute(self, task: str, batch: list[Pending]) -> None:
        live = [p for p in batch if not p.dropped]
        if not live:
            return
        engine = self.engines[task]
        texts = [t for p in live for t in p.texts]
        owner = [(p, k) for p in live for k in range(len(p.texts))]  # text index -> (request, its own index)
        answers = {id(p): [None] * len(p.texts) for p in live}
        left = {id(p): len(p.texts) for p in live}
        start = time.perf_counter()

        def on_results(done: list[tuple[int, Prediction]]) -> None:
            for i, prediction in done:
                pending, k = owner[i]
                answers[id(pending)][k] = prediction
                left[id(pending)] -= 1
                if not left[id(pending)]:  # its last text: answer it now
                    seconds = time.perf_counter() - start
                    result = BatchResult(answers[id(pending)], start - pending.submitted_at, seconds, len(texts),
                                         len(live))
                    _settle(pending, result)
            if nobody_waits():
                raise NobodyWaits

        def nobody_waits() -> bool:
            waiting = [p for p in live if left[id(p)]]
            return bool(waiting) and all(p.dropped for p in waiting)

        self._nobody_waits = nobody_waits  # checked before each layer (and after each engine batch)
        try:
            engine.classify(texts, on_results=on_results)
        except NobodyWaits:
            return
        except Exception as exc:  # noqa: BLE001
            self._count_error(task, "engine")
            unanswered = [p for p in live if left[id(p)]]
            if len(live) == 1:
                failure = EngineFailed(f"the model failed on this batch: {type(exc).__name__}: {exc}")
                _settle(live[0], error=failure)
            else:  # isolate the failing request(s); the others still get their answers
                for pending in unanswered:
                    self._execute(task, [pending])
            return
        finally:
            self._nobody_waits = None
        seconds = time.perf_counter() - start
        if seconds > 0:
            rate = len(texts) / seconds
            self._items_per_s = rate if self._items_per_s == 0 else 0.8 * self._items_per_s + 0.2 * rate
        if self.metrics is not None:
            stats = getattr(engine, "last_stats", None)
            self.metrics.observe_batch(task, len(texts), len(live), seconds, stats)

    def _stop_if_nobody_waits(self, module, args) -> None:
        """A forward pre-hook: only this batcher's worker, only in a call whose requests have all gone."""
        nobody_waits = self._nobody_waits
        if nobody_waits is not None and threading.get_ident() == self._thread.ident and nobody_waits():
            raise NobodyWaits

    def _count_error(self, task: str, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(task=task, kind=kind).inc()

    def _report_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._num_queued)


def transformer_layers(engines: dict) -> list:
    """The blocks of each distinct model the engines run (engine.fast.decoder_layers)."""
    layers, seen = [], set()
    for engine in engines.values():
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module) or id(model) in seen:
            continue
        seen.add(id(model))
        layers += decoder_layers(model)
    return layers


def _settle(pending: Pending, result: BatchResult | None = None, error: Exception | None = None) -> None:
    """Resolve the request's future from the worker thread (ignored if the caller has gone)."""

    def resolve():
        if pending.future.done():
            return
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(result)

    try:
        pending.future.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass
