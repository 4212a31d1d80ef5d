"""Fairness (#33): the micro-batcher splits a large request into token-budget engine calls and requests take turns, so a
short request is never left behind a long request's next text; a call that still has much to run lets newcomers take
steps in between; answers stay exact and in each request's order.

The step path is driven here by a stand-in engine whose `steps` runs a long text in several steps and answers with
`classify`; the engine's own steps (chunked prefill) are tested with the engine.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
from types import SimpleNamespace

import pytest
from test_server import LABELS, Probe
from tiny import make_text, tiny_model

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.server import BatchSettings
from slimroute.server.microbatch import MicroBatcher
from slimroute.server.scheduler import Batch, Rotation, Work
from slimroute.task import Task


@pytest.fixture(scope="module")
def engine():
    return Engine(*tiny_model("qwen2"), Task.from_labels(LABELS))


def work(name: str, *num_tokens: int) -> Work:
    return Work(SimpleNamespace(texts=[f"{name}{k}" for k in range(len(num_tokens))], dropped=False), list(num_tokens))


def picked(batch: Batch) -> list[str]:
    return [s.work.pending.texts[s.row] for s in batch.slices]


# -------------------------------------------------------------------------------- the rotation alone


def test_a_request_that_arrives_during_a_batch_goes_before_the_long_requests_next_text():
    rotation = Rotation()
    long = work("L", *[100] * 8)
    rotation.add(long)
    first = Batch("t")
    assert rotation.fill(first, 32, 100) and picked(first) == ["L0"]
    rotation.add(work("S", 5))  # arrives while the first batch runs
    rotation.put_back(first)
    second = Batch("t")
    rotation.fill(second, 32, 100)
    assert picked(second) == ["S0"]  # L1 does not fit beside it: the short one does not wait for it
    rotation.put_back(second)
    rest = []
    while rotation:
        batch = Batch("t")
        rotation.fill(batch, 32, 100)
        rest.append(picked(batch))
        rotation.put_back(batch)
    assert rest == [[f"L{k}"] for k in range(1, 8)]  # in order, one budget each


def test_requests_take_one_text_each_in_turn_and_a_batch_keeps_its_budget():
    rotation = Rotation()
    for name, tokens in (("A", [10, 10, 10, 10]), ("B", [10, 10]), ("C", [10])):
        rotation.add(work(name, *tokens))
    batch = Batch("t")
    assert rotation.fill(batch, 32, 60)
    assert picked(batch) == ["A0", "B0", "C0", "A1", "B1", "A2"] and batch.num_tokens == 60
    rotation.put_back(batch)
    nxt = Batch("t")
    assert not rotation.fill(nxt, 32, 60) and picked(nxt) == ["A3"]  # ran dry: room for newcomers


def test_a_text_over_the_budget_goes_alone():
    rotation = Rotation()
    rotation.add(work("L", 500, 5))
    rotation.add(work("S", 5))
    alone = Batch("t")
    assert rotation.fill(alone, 32, 100) and picked(alone) == ["L0"]


def test_max_items_closes_a_batch():
    rotation = Rotation()
    rotation.add(work("A", *[1] * 10))
    batch = Batch("t")
    assert rotation.fill(batch, 4, None) and picked(batch) == ["A0", "A1", "A2", "A3"]


# -------------------------------------------------------------------------------- the micro-batcher on an engine


def run_scenario(batcher: MicroBatcher, gate_entered: threading.Event, gate: threading.Event, first: list[str],
                 then: list[list[str]]):
    """Submit `first`, wait until the worker is inside its first engine call, submit `then`, open the gate; return
    each request's BatchResult and the order in which the futures resolved."""

    async def scenario():
        batcher.start()
        order = []
        held = batcher.submit("default", first)
        held.future.add_done_callback(lambda _: order.append(0))
        await asyncio.to_thread(gate_entered.wait, 20)
        others = [batcher.submit("default", texts) for texts in then]
        for k, pending in enumerate(others, 1):
            pending.future.add_done_callback(lambda _, k=k: order.append(k))
        gate.set()
        return [await p.future for p in [held, *others]], order

    try:
        return asyncio.run(scenario())
    finally:
        batcher.close()


def check_exact(engine: Engine, texts: list[str], predictions) -> None:
    want = engine.classify(texts)
    assert [p.label for p in predictions] == [w.label for w in want]
    for got, expected in zip(predictions, want, strict=True):
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert got.num_tokens == expected.num_tokens and got.truncated == expected.truncated


def test_a_short_request_is_answered_one_batch_after_a_long_one_started_and_answers_are_exact(engine):
    rng = random.Random(1)
    long_texts = [make_text(rng, 120 + 5 * k) for k in range(6)]
    short = [make_text(rng, 4)]
    lengths = [len(ids) for ids in engine.prompt.item_ids_batch(long_texts + short)]
    budget = max(lengths) + lengths[-1]  # a long text and the short one fit; two long ones do not
    gate = threading.Event()
    probe = Probe(engine, gate=gate)
    batcher = MicroBatcher({"default": probe}, BatchSettings(max_gather_tokens=budget, max_wait_ms=0))
    (long_result, short_result), order = run_scenario(batcher, probe.entered, gate, long_texts, [short])
    assert order == [1, 0]  # the short request was answered first
    assert probe.calls[0] == long_texts[:1] and short[0] in probe.calls[1]  # it waited for one batch, no more
    assert [len(call) for call in probe.calls] == [1, 2, 1, 1, 1, 1]
    for call in probe.calls:
        assert sum(len(ids) for ids in engine.prompt.item_ids_batch(call)) <= budget
    check_exact(engine, long_texts, long_result.predictions)  # in input order, as one classify call answers
    check_exact(engine, short, short_result.predictions)
    assert short_result.batch_requests == 2 and long_result.batch_requests == 1


def test_many_requests_split_and_interleaved_are_each_exact_and_in_order(engine):
    rng = random.Random(2)
    requests = [[make_text(rng, rng.randint(3, 60)) for _ in range(rng.randint(1, 7))] for _ in range(8)]
    gate = threading.Event()
    probe = Probe(engine, gate=gate)
    batcher = MicroBatcher({"default": probe}, BatchSettings(max_batch_items=5, max_gather_tokens=150,
                                                              max_wait_ms=0))
    results, _ = run_scenario(batcher, probe.entered, gate, ["hold the worker"], requests)
    for texts, result in zip(requests, results[1:], strict=True):
        check_exact(engine, texts, result.predictions)
    assert all(len(call) <= 5 for call in probe.calls)
    assert batcher.num_queued == 0


class Stepper(Probe):
    """A stand-in for an engine that runs a call a step at a time (Engine.steps): each text in turn, a long one over
    ceil(tokens / 32) steps, every step logged and held at the gate; the answers are classify's."""

    def __init__(self, engine, log: list, gate: threading.Event):
        super().__init__(engine)
        self.log, self.step_gate, self.closed = log, gate, []

    def steps(self, texts, progress=None):
        self.calls.append(list(texts))
        for i, text in enumerate(texts):
            num_steps = math.ceil(len(self.engine.prompt.item_ids_batch([text])[0]) / 32)
            try:
                for k in range(num_steps - 1):
                    self.log.append(("step", text, k))
                    self.entered.set()
                    if not self.step_gate.wait(20):
                        raise TimeoutError("gate never opened")
                    yield []
            except GeneratorExit:
                self.closed.append(text)
                raise
            self.log.append(("step", text, num_steps - 1))
            yield [(i, self.engine.classify([text])[0])]


def test_a_long_call_lets_a_newcomer_run_between_its_steps(engine):
    rng = random.Random(3)
    long_texts = [make_text(rng, 90), make_text(rng, 70)]
    short = [make_text(rng, 3)]
    log, gate = [], threading.Event()
    stepper = Stepper(engine, log, gate)
    batcher = MicroBatcher({"default": stepper}, BatchSettings(max_gather_tokens=64, preempt_tokens=32,
                                                                max_wait_ms=0))
    (long_result, short_result), order = run_scenario(batcher, stepper.entered, gate, long_texts, [short])
    assert order == [1, 0]
    assert log[:2] == [("step", long_texts[0], 0), ("step", short[0], 0)]  # one step of the long call, then its turn
    steps = [e[1] for e in log if e[1] != short[0]]
    assert steps == sorted(steps, key=long_texts.index)  # the long request's texts in order
    assert stepper.calls == [long_texts[:1], short, long_texts[1:]]  # each long text over the budget: a call alone
    check_exact(engine, long_texts, long_result.predictions)
    check_exact(engine, short, short_result.predictions)


def test_without_preemption_a_newcomer_waits_for_the_running_call(engine):
    rng = random.Random(3)
    long_texts, short = [make_text(rng, 90)], [make_text(rng, 3)]
    log, gate = [], threading.Event()
    stepper = Stepper(engine, log, gate)
    batcher = MicroBatcher({"default": stepper}, BatchSettings(preempt_tokens=None, max_wait_ms=0))
    run_scenario(batcher, stepper.entered, gate, long_texts, [short])
    assert log[-1] == ("step", short[0], 0)


def test_a_call_whose_requests_all_left_stops_between_steps(engine):
    rng = random.Random(4)
    long_text = make_text(rng, 120)
    log, gate = [], threading.Event()
    stepper = Stepper(engine, log, gate)
    batcher = MicroBatcher({"default": stepper}, BatchSettings(max_wait_ms=0))

    async def scenario():
        batcher.start()
        gone = batcher.submit("default", [long_text])
        await asyncio.to_thread(stepper.entered.wait, 20)
        batcher.drop(gone)
        gate.set()
        after = await batcher.submit("default", ["still serving"]).future
        return gone, after

    try:
        gone, after = asyncio.run(scenario())
    finally:
        batcher.close()
    assert not gone.future.done() and stepper.closed == [long_text]
    assert [e for e in log if e[1] == long_text] == [("step", long_text, 0)]
    check_exact(engine, ["still serving"], after.predictions)


class StepLog:
    """The real engine's steps (chunked prefill), each step logged with the texts of its call and held at the gate."""

    def __init__(self, engine, gate: threading.Event):
        self.engine, self.gate, self.log = engine, gate, []
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def steps(self, texts, progress=None):
        for done in self.engine.steps(texts, progress):
            self.log.append((tuple(texts), [i for i, _ in done]))
            self.entered.set()
            if not self.gate.wait(20):
                raise TimeoutError("gate never opened")
            yield done


def test_the_engines_chunked_prefill_lets_a_short_request_in_after_one_chunk_with_the_same_bits():
    """One text of ~200 tokens runs in chunks of 32 (Engine.steps): a request that arrives meanwhile is answered
    after one of its chunks, not after the whole text, and both answers are one classify call's (within fp32 rounding:
    the chunks' attention adds in another order; int8's same bits: tests/test_int8.py)."""
    model, tokenizer = tiny_model("qwen2")
    plain = Engine(model, tokenizer, Task.from_labels(LABELS))
    chunked = Engine(model, tokenizer, Task.from_labels(LABELS), EngineConfig(chunk_tokens=32))
    rng = random.Random(5)
    long_texts, short = [make_text(rng, 200)], [make_text(rng, 3)]
    assert len(chunked.prompt.item_ids_batch(long_texts)[0]) > 4 * 32
    gate = threading.Event()
    stepper = StepLog(chunked, gate)
    batcher = MicroBatcher({"default": stepper}, BatchSettings(preempt_tokens=32, max_wait_ms=0))
    (long_result, short_result), order = run_scenario(batcher, stepper.entered, gate, long_texts, [short])
    assert order == [1, 0]
    calls = [texts for texts, _ in stepper.log]
    assert calls[0] == tuple(long_texts) and calls[1] == tuple(short)  # one chunk of the long text, then the short
    assert calls.count(tuple(long_texts)) >= 5  # the long text's chunks: the rest ran after the short request
    check_exact(plain, long_texts, long_result.predictions)
    check_exact(plain, short, short_result.predictions)
