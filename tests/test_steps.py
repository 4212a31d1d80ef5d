"""Engine.steps: classify one forward pass at a time, long items in chunks (config.chunk_tokens)."""

import random

import pytest
import torch
from test_head import random_head
from tiny import make_text, tiny_model

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.task import Task

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

TASK = Task(("Technical Support", "Technical Sales", "billing", "account"))


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen2")


def _texts(seed=3):
    rng = random.Random(seed)
    return [make_text(rng, n) for n in (3, 150, 8, 5, 90, 12)]


def test_steps_hand_out_every_item_once_and_run_a_long_item_a_chunk_a_step(qwen):
    model, tok = qwen
    texts = _texts()
    engine = Engine(model, tok, TASK, EngineConfig(batch_size=2, chunk_tokens=32))
    lengths = [len(ids) for ids in engine.encode(texts)[0]]
    chunks = sum(-(-n // 32) for n in lengths if n > 32)
    short = [n for n in lengths if n <= 32]
    steps = list(engine.steps(texts))
    assert len(steps) == chunks + -(-len(short) // 2) + 1  # a step per chunk and per batch, then the last hand-out
    handed = [i for done in steps for i, _ in done]
    assert sorted(handed) == list(range(len(texts)))
    assert engine.last_stats.num_items == len(texts)
    by_index = dict(pair for done in steps for pair in done)
    assert [by_index[i].logprobs for i in range(len(texts))] == [p.logprobs for p in engine.classify(texts)]


def test_chunked_prefill_in_float32_is_within_the_kernels_rounding_of_one_pass(qwen):
    model, tok = qwen
    texts = _texts(4)
    whole = Engine(model, tok, TASK, EngineConfig(batch_size=4)).classify(texts)
    chunked = Engine(model, tok, TASK, EngineConfig(batch_size=4, chunk_tokens=32)).classify(texts)
    assert [p.label for p in chunked] == [p.label for p in whole]
    diffs = [abs(a - b) for p, q in zip(chunked, whole, strict=True)
             for la, lb in zip(p.logprobs.values(), q.logprobs.values(), strict=True) for a, b in [(la, lb)]]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize(("features", "layers"), [("mean", ()), ("hidden+mean", (1,))])
def test_a_head_that_reads_every_token_is_chunked_too_within_rounding_of_one_pass(qwen, features, layers):
    model, tok = qwen
    head = random_head(model, tok, TASK, features=features, layers=layers, seed=5)
    texts = _texts(5)
    chunked = Engine(model, tok, TASK, EngineConfig(batch_size=4, chunk_tokens=32), head=head)
    lengths = [len(ids) for ids in chunked.encode(texts)[0]]
    chunks = sum(-(-n // 32) for n in lengths if n > 32)
    assert chunks > sum(n > 32 for n in lengths)  # several chunks per long item
    steps = list(chunked.steps(texts))
    assert len(steps) == chunks + -(-sum(n <= 32 for n in lengths) // 4) + 1  # a step per chunk, as without a head
    got = dict(pair for done in steps for pair in done)
    whole = Engine(model, tok, TASK, EngineConfig(batch_size=4), head=head).classify(texts)
    assert [got[i].label for i in range(len(texts))] == [p.label for p in whole]
    assert max(abs(got[i].logprobs[k] - p.logprobs[k]) for i, p in enumerate(whole) for k in p.logprobs) < 1e-4


def test_a_failing_batch_hands_out_the_batches_before_it_first(qwen, monkeypatch):
    model, tok = qwen
    engine = Engine(model, tok, TASK, EngineConfig(batch_size=1, chunk_tokens=32))
    texts = _texts()
    real, calls = engine._run_batch, []

    def failing(seqs):
        calls.append(seqs)
        if len(calls) == 3:
            raise RuntimeError("simulated")
        return real(seqs)

    monkeypatch.setattr(engine, "_run_batch", failing)
    handed = []
    with pytest.raises(RuntimeError, match="simulated"):
        engine.classify(texts, on_results=handed.extend)
    assert len(handed) == 2  # the two batches before the failing one


@pytest.mark.parametrize("chunk", [0, 16, 40, 33.0])
def test_chunk_tokens_must_be_whole_attention_tiles(chunk):
    with pytest.raises(ValueError, match="chunk_tokens must be a multiple of 32"):
        EngineConfig(chunk_tokens=chunk)


def test_chunked_prefill_needs_the_prefix_cache_else_items_run_in_one_pass(qwen):
    model, tok = qwen
    texts = _texts()
    engine = Engine(model, tok, TASK, EngineConfig(batch_size=8, max_batch_tokens=None, sort=False, chunk_tokens=32,
                                                   prefix_cache=False))
    assert len(list(engine.steps(texts))) == 2  # one batch of all six, then the last hand-out
    assert not torch.is_inference_mode_enabled()  # the steps' inference mode does not leak out of the generator
