"""Requests from many callers -> engine calls, in one worker thread that owns the engines.

`submit()` runs on the event loop and only appends the request to its task's rotation (scheduler.py). The worker
counts the tokens of requests it has not seen (refusing a text over `max_text_tokens`), fills a batch by turns within
`max_batch_items` texts and `max_gather_tokens` item tokens (holding it open up to `max_wait_ms` when idle), and runs
it as an engine call a step at a time (calls.py). While a call still has more than `preempt_tokens` item tokens to
run, requests that arrive get calls of their own, and the open calls take steps in turn (the newest first), so a
short request waits about one step behind a long one; otherwise they wait for it and fill the next call, which keeps
calls full under steady load. A request is answered, through its asyncio future, as soon as its last text is.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from slimroute.engine.passes import decoder_layers
from slimroute.labels import Prediction
from slimroute.runtime.memory import share_the_main_malloc_arena
from slimroute.server.calls import Call
from slimroute.server.scheduler import Batch, Rotation, Slice, Work

MAX_OPEN_CALLS = 4  # engine calls in progress at once (each holds its batch's activations and cached keys)


@dataclass(frozen=True)
class BatchSettings:
    max_batch_items: int = 32  # texts in one engine call
    max_gather_tokens: int | None = 2048  # item tokens in one engine call; a larger request runs over several, in turns
    max_wait_ms: float = 50.0  # how long an idle worker holds a batch with room open for more requests
    max_queue_items: int = 1024  # texts not started; beyond this submit() raises QueueFull
    max_text_tokens: int | None = 2048  # longer texts are refused (TextTooLong)
    preempt_tokens: int | None = 1024  # a call with more item tokens than this left lets newcomers run between its
    # steps; None: calls run one at a time

    def __post_init__(self):
        for name in ("max_batch_items", "max_queue_items"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_gather_tokens", "max_text_tokens", "preempt_tokens"):
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
        self.index, self.num_tokens, self.limit = index, num_tokens, limit


class EngineFailed(RuntimeError):
    pass


class NobodyWaits(Exception):
    """Raised in the worker, before a transformer layer runs, to stop an engine call whose waiting
    requests have all been dropped (their clients went away): the worker is free within one layer."""


@dataclass(frozen=True)
class BatchResult:
    predictions: list[Prediction]
    queue_seconds: float  # from submit() to the start of its first engine call
    engine_seconds: float  # from then to its answer (other requests' steps included)
    batch_items: int  # texts in the engine call that answered its last text
    batch_requests: int


@dataclass(eq=False)
class Pending:
    task: str
    texts: list[str]
    future: asyncio.Future
    submitted_at: float = field(default_factory=time.perf_counter)
    answers: list[Prediction | None] = field(default_factory=list)
    num_left: int = 0
    started_at: float | None = None  # its first engine call
    dropped: bool = False

    def __post_init__(self):
        self.answers, self.num_left = [None] * len(self.texts), len(self.texts)


class MicroBatcher:
    def __init__(self, engines: dict, settings: BatchSettings | None = None, metrics=None):
        self.engines = engines
        self.settings = settings or BatchSettings()
        self.metrics = metrics  # a prometheus.Prometheus, or None
        self._rotations: dict[str, Rotation] = {name: Rotation() for name in engines}
        self._works: dict[int, Work] = {}  # id(pending) -> its work, while it has texts to start
        self._num_queued = 0  # texts not started
        self._cond = threading.Condition()
        self._closing = False
        self._items_per_s = 0.0  # recent throughput, for Retry-After
        self._thread = threading.Thread(target=self._run, name="slimroute-microbatch", daemon=True)
        self._nobody_waits = None  # during a step: () -> True once every request still waiting on it has gone
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
        if task not in self._rotations:
            raise KeyError(task)
        pending = Pending(task, list(texts), asyncio.get_running_loop().create_future())
        with self._cond:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            limit = self.settings.max_queue_items
            if self._num_queued + len(texts) > limit and self._num_queued > 0:
                raise QueueFull(self._num_queued, limit, self.retry_after_s())
            work = Work(pending)
            self._works[id(pending)] = work
            self._rotations[task].add(work)
            self._num_queued += len(texts)
            self._cond.notify()
        self._report_depth()
        return pending

    def drop(self, pending: Pending) -> bool:
        """Forget a request whose caller went away; True if none of its texts had started."""
        with self._cond:
            pending.dropped = True
            work = self._works.pop(id(pending), None)
            if work is None:
                return False
            untouched = work.next_row == 0
            self._rotations[pending.task].remove(work)
            self._num_queued -= work.num_unstarted
        self._report_depth()
        return untouched

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
        calls: deque[Call] = deque()  # open calls, the next to step first
        while True:
            if not calls:
                batch = self._gather(idle=True)
                if batch is None:
                    return
            elif self._may_open(calls):
                batch = self._gather(idle=False)
            else:
                batch = None
            if batch is not None:
                if batch.slices:
                    calls.appendleft(self._open(batch))  # a newcomer's first step goes next
                else:
                    self._put_back(batch)
            if calls:
                call = calls.popleft()
                if self._step(call, calls):
                    calls.append(call)
                else:
                    self._finish(call)

    def _may_open(self, calls: deque[Call]) -> bool:
        limit = self.settings.preempt_tokens
        return (limit is not None and len(calls) < MAX_OPEN_CALLS and any(self._rotations.values())
                and all(c.tokens_left > limit for c in calls))

    def _gather(self, idle: bool) -> Batch | None:
        """The next batch (empty when its requests were refused), or None: when idle, only to stop; else when
        nothing waits. Idle, a batch with room stays open up to max_wait_ms for more requests."""
        with self._cond:
            while not any(self._rotations.values()):
                if self._closing or not idle:
                    return None
                self._cond.wait()
            waiting = {name: r.waiting[0].since for name, r in self._rotations.items() if r}
            task = min(waiting, key=waiting.__getitem__)  # the task whose next request has waited longest
        rotation, batch = self._rotations[task], Batch(task)
        deadline = time.perf_counter() + self.settings.max_wait_ms / 1000
        while True:
            with self._cond:
                unmeasured = [w for w in rotation.waiting if w.num_tokens is None]
            if unmeasured:
                for work in unmeasured:
                    self._measure(work)
                continue
            with self._cond:
                rows_before = {id(w): w.next_row for w in rotation.waiting}
                closed = rotation.fill(batch, self.settings.max_batch_items, self.settings.max_gather_tokens)
                self._num_queued -= sum(w.next_row - rows_before[id(w)] for w in batch.served if id(w) in rows_before)
                if closed or not idle or self._closing or not batch.slices or any(self._rotations.values()):
                    return batch
                if (left := deadline - time.perf_counter()) <= 0:
                    return batch
                self._cond.wait(left)
                if not rotation:
                    return batch

    def _measure(self, work: Work) -> None:
        """Token counts of the request's texts (as far as the engine reads them); refuse it when one is over the
        limit, unless the task reads no text further than the limit (truncate_tokens)."""
        pending = work.pending
        engine = self.engines[pending.task]
        prompt = engine.prompt
        cut = prompt.task.truncate_tokens  # a task that reads each text's first tokens only
        try:  # item tokens as far as the engine reads them (a budget: a cut text counts as one at the cap)
            num_tokens = [min(len(ids), prompt.max_item_tokens) for ids in prompt.item_ids_batch(pending.texts)]
            limit = self.settings.max_text_tokens
            if limit is not None and not (cut and cut <= limit):  # a text it reads no further than the limit: fine
                text_ids = engine.tokenizer([t.strip() for t in pending.texts], add_special_tokens=False)
                for i, ids in enumerate(text_ids["input_ids"]):
                    if len(ids) > limit:
                        raise TextTooLong(i, len(ids), limit)
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the worker goes on
            too_long = isinstance(exc, TextTooLong)
            self._count_error(pending.task, "too_long" if too_long else "tokenizer")
            error = exc if too_long else EngineFailed(f"the tokenizer failed: {type(exc).__name__}: {exc}")
            self._fail(work, error)
            return
        work.num_tokens = num_tokens

    def _open(self, batch: Batch) -> Call:
        start = time.perf_counter()
        for s in batch.slices:
            if s.work.pending.started_at is None:
                s.work.pending.started_at = start
        call = Call(self.engines[batch.task], batch, lambda s, prediction: self._answer(call, s, prediction))
        return call

    def _answer(self, call: Call, s: Slice, prediction: Prediction) -> None:
        pending = s.work.pending
        pending.answers[s.row] = prediction
        pending.num_left -= 1
        if not pending.num_left:  # its last text: answer it now
            now = time.perf_counter()
            _settle(pending, BatchResult(list(pending.answers), pending.started_at - pending.submitted_at,
                                         now - pending.started_at, len(call.live), call.num_requests))

    def _step(self, call: Call, calls: deque[Call]) -> bool:
        """One step of the call; False when it is over. If the engine fails on a call of several requests, each
        request's unanswered texts get a call of their own (in `calls`), so only the request that fails gets 500."""
        self._nobody_waits = call.nobody_waits  # checked before each transformer layer
        try:
            return call.step()
        except NobodyWaits:
            return False
        except Exception as exc:  # noqa: BLE001 - the requests get the error, the worker goes on
            self._count_error(call.batch.task, "engine")
            works = list(dict.fromkeys(s.work for s in call.unanswered()))
            if len(works) == 1:
                self._fail(works[0], EngineFailed(f"the model failed on this batch: {type(exc).__name__}: {exc}"))
            else:
                for work in works:
                    alone = Batch(call.batch.task, [s for s in call.unanswered() if s.work is work])
                    alone.num_tokens = sum(alone.tokens(s) for s in alone.slices)
                    calls.appendleft(self._open(alone))
            return False
        finally:
            self._nobody_waits = None

    def _finish(self, call: Call) -> None:
        """A call is over: its requests with texts left go back to their rotation; the metrics see it."""
        self._put_back(call.batch)
        if call.num_answered and call.busy_seconds > 0:
            rate = call.num_answered / call.busy_seconds
            self._items_per_s = rate if self._items_per_s == 0 else 0.8 * self._items_per_s + 0.2 * rate
        if self.metrics is not None and call.live:
            stats = getattr(self.engines[call.batch.task], "last_stats", None)
            self.metrics.observe_batch(call.batch.task, len(call.live), call.num_requests, call.busy_seconds, stats)

    def _put_back(self, batch: Batch) -> None:
        with self._cond:
            for work in batch.served:
                if not work.has_more or work.pending.dropped:
                    self._works.pop(id(work.pending), None)
            self._rotations[batch.task].put_back(batch)
        self._report_depth()

    def _fail(self, work: Work, error: Exception) -> None:
        """Answer the request with the error and start none of its other texts."""
        with self._cond:
            if self._works.pop(id(work.pending), None) is not None:  # not dropped (drop() counted it off)
                self._num_queued -= work.num_unstarted
            work.next_row = len(work.pending.texts)
            self._rotations[work.pending.task].remove(work)
        self._report_depth()
        _settle(work.pending, error=error)

    def _stop_if_nobody_waits(self, module, args) -> None:
        """A forward pre-hook: only this batcher's worker, only in a step whose requests have all gone."""
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
    """The blocks of each distinct model the engines run (engine.passes.decoder_layers)."""
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
