"""The fast engine equals the one-at-a-time reference: same labels, log-probs within 1e-4 (fp32)."""

import random

import pytest
import torch
from conftest import _cached
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import make_text

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.task import Example, Task

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

LABEL_SETS = {
    "single": ("billing", "technical", "account"),
    "multi": ("Technical Support", "Technical Sales", "billing", "account"),
    "shared": ("plan", "plan upgrade", "plan cancel", "login"),
}


def assert_equal(ref_preds, fast_preds, tol=1e-4):
    for ref, fast in zip(ref_preds, fast_preds, strict=True):
        assert fast.label == ref.label
        for label, lp in ref.logprobs.items():
            assert abs(fast.logprobs[label] - lp) <= tol, (label, lp, fast.logprobs[label])
        assert fast.num_tokens == ref.num_tokens and fast.truncated == ref.truncated


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(["qwen2", "llama"]),
    labels=st.sampled_from(sorted(LABEL_SETS)),
    lengths=st.lists(st.one_of(st.integers(1, 12), st.integers(40, 160)), min_size=1, max_size=20),
    batch_size=st.integers(1, 64),
    budget=st.one_of(st.none(), st.integers(16, 600)),
    overhead=st.sampled_from([0, 40, 10**6]),  # singletons, the default split, batches as full as the limits allow
    prefix_cache=st.booleans(),
    sort=st.booleans(),
    decision=st.sampled_from(["greedy", "max-prob"]),
    few_shot=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_fast_path_equals_reference(arch, labels, lengths, batch_size, budget, overhead, prefix_cache, sort, decision,
                                    few_shot, seed):
    model, tok = _cached(arch)
    rng = random.Random(seed)
    texts = [make_text(rng, n) for n in lengths]
    examples = (Example("refund my card", LABEL_SETS[labels][0]),) if few_shot else ()
    task = Task(LABEL_SETS[labels], examples=examples)
    config = EngineConfig(batch_size=batch_size, max_batch_tokens=budget, batch_overhead_tokens=overhead,
                          prefix_cache=prefix_cache, sort=sort, decision=decision)
    fast = Engine(model, tok, task, config).classify(texts)
    ref = ReferenceClassifier(model, tok, task, decision).classify(texts)
    assert_equal(ref, fast)


def test_one_token_item_and_very_long_item(tiny):
    model, tok = tiny
    task = Task(LABEL_SETS["multi"])
    texts = ["x", make_text(random.Random(1), 400), "refund"]
    one_batch = EngineConfig(batch_size=3, max_batch_tokens=None, batch_overhead_tokens=10**6)  # forces one batch
    engine = Engine(model, tok, task, one_batch)
    assert_equal(ReferenceClassifier(model, tok, task).classify(texts), engine.classify(texts))
    assert engine.last_stats.padding.overhead > 0.5  # one batch, padded to the long item


def test_truncated_items_agree_with_reference(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    texts = [make_text(random.Random(2), 900), "short one"]
    engine = Engine(model, tok, task, EngineConfig(), max_positions=256)
    fast = engine.classify(texts)
    ref = ReferenceClassifier(model, tok, task, max_positions=256).classify(texts)
    assert [p.truncated for p in fast] == [True, False] and engine.last_stats.num_truncated == 1
    assert_equal(ref, fast)


def test_results_come_back_in_input_order(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    rng = random.Random(3)
    texts = [make_text(rng, rng.choice([2, 50, 150])) for _ in range(40)]
    engine = Engine(model, tok, task, EngineConfig(batch_size=4))
    batched = engine.classify(texts)
    singles = [engine.classify([t])[0] for t in texts]
    assert_equal(singles, batched)


def test_near_tie_recheck_uses_the_exact_path(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["multi"])
    texts = [make_text(random.Random(4), n) for n in (3, 30, 90)]
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    always = Engine(model, tok, task, EngineConfig(recheck_margin=float("inf")))
    preds = always.classify(texts)
    assert always.last_stats.num_rechecked == 3
    assert [p.logprobs for p in preds] == [p.logprobs for p in ref]  # bit-identical: it is the reference
    never = Engine(model, tok, task, EngineConfig(recheck_margin=0.0))
    assert_equal(ref, never.classify(texts))
    assert never.last_stats.num_rechecked == 0


def test_decision_margin():
    from slimroute.labels import decision_margin

    ids = [(5,), (7, 8), (7, 9)]
    lps = [[-1.0], [-0.5, -2.0], [-0.5, -0.1]]
    assert abs(decision_margin("greedy", ids, lps) - 0.5) < 1e-9  # step 1: 0.5 vs 1.0; step 2: 1.9
    assert abs(decision_margin("max-prob", ids, lps) - 0.4) < 1e-9  # -0.6 vs -1.0


def test_small_batches_share_a_scorer_call_and_report_every_item_once(tiny_qwen, monkeypatch):
    """classify gathers the label scorer's rows over small batches (engine.SCORER_ROWS) before one head call:
    the same predictions as a call per batch, and progress / on_results still see each batch, every item once."""
    import slimroute.engine.fast as engine_module

    model, tok = tiny_qwen
    task = Task(LABEL_SETS["multi"])
    rng = random.Random(11)
    texts = [make_text(rng, rng.choice([2, 30, 90])) for _ in range(23)]
    engine = Engine(model, tok, task, EngineConfig(batch_size=3))
    calls = []
    real = engine.scorer.logprobs
    monkeypatch.setattr(engine.scorer, "logprobs", lambda rows: calls.append(rows.shape[0]) or real(rows))
    done, counted = [], []
    shared = engine.classify(texts, progress=counted.append, on_results=done.extend)
    assert len(calls) < engine.last_stats.num_batches  # several batches per call
    assert sorted(i for i, _ in done) == list(range(len(texts))) and sum(counted) == len(texts)
    assert all(shared[i] == p for i, p in done)
    monkeypatch.setattr(engine_module, "SCORER_ROWS", 2)  # a batch's rows alone exceed it: several calls of <= 2
    calls.clear()
    small = engine.classify(texts)
    assert max(calls) <= 2 and len(calls) > engine.last_stats.num_batches
    assert_equal(small, shared)


def test_a_failing_batch_still_hands_out_the_answers_of_the_batches_before_it(tiny_qwen, monkeypatch):
    """Batches wait for a shared scorer call; when a later batch raises, the waiting ones are scored and handed
    out (on_results) before the error goes up, as when each batch was scored at once."""
    model, tok = tiny_qwen
    engine = Engine(model, tok, Task(LABEL_SETS["single"]), EngineConfig(batch_size=2, sort=False))
    real, calls = engine._run_batch, []

    def third_fails(seqs):
        calls.append(len(seqs))
        if len(calls) == 3:
            raise RuntimeError("simulated failure in the third batch")
        return real(seqs)

    monkeypatch.setattr(engine, "_run_batch", third_fails)
    done = []
    with pytest.raises(RuntimeError, match="third batch"):
        engine.classify([f"ticket number {i}" for i in range(8)], on_results=done.extend)
    assert sorted(i for i, _ in done) == [0, 1, 2, 3] and all(p.label for _, p in done)


def test_the_last_layers_mlp_runs_only_on_the_rows_read(tiny_qwen):
    """Only the items' last tokens leave the last decoder layer's MLP (passes.rows_only): it sees B rows, not
    B x L, the answers are those of the whole pass, and the hooks are gone afterwards."""
    from slimroute.engine.passes import rows_only

    model, tok = tiny_qwen
    engine = Engine(model, tok, Task(LABEL_SETS["multi"]), EngineConfig(batch_size=8))
    mlp = engine.passes.last_mlp
    assert mlp is model.base_model.layers[-1].mlp
    seen = []
    handle = mlp.register_forward_hook(lambda _, args, out: seen.append(args[0].shape))
    rng = random.Random(5)
    texts = [make_text(rng, rng.choice([3, 20, 60])) for _ in range(8)]
    try:
        pruned = engine.classify(texts)
    finally:
        handle.remove()
    pruned_calls = [shape for shape in seen if shape[0] == 1]  # a batch's forward: (1, B, H), one row per item
    assert sum(shape[1] for shape in pruned_calls) == len(texts) and len(pruned_calls) == engine.last_stats.num_batches
    assert all(shape[0] > 1 for shape in seen if shape[0] != 1)  # a continuation: every row (B x copies, n-1, H)
    assert not mlp._forward_hooks and not mlp._forward_pre_hooks
    engine.passes.last_mlp = None
    assert_equal(pruned, engine.classify(texts), tol=1e-5)

    x = torch.randn(2, 3, 4)
    index = torch.tensor([1, 5])
    layer = torch.nn.Linear(4, 4)
    with rows_only(layer, index):
        out = layer(x)
    expected = torch.zeros(2, 3, 4)
    expected.view(-1, 4)[index] = layer(x.view(-1, 4)[index])
    assert torch.equal(out, expected)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))  # hooks removed
    with rows_only(layer, index):
        assert torch.equal(layer(input=x), layer.forward(x))  # called with a keyword: the whole input, untouched


def test_a_fallback_floor_is_applied_alike_in_both_paths(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["multi"])
    rng = random.Random(5)
    texts = [make_text(rng, n) for n in (3, 9, 17, 30, 44, 61, 90, 120)]
    plain = Engine(model, tok, task).classify(texts)
    chosen = sorted(p.probs[p.label] for p in plain)
    floor = (chosen[3] + chosen[4]) / 2  # half the items fall below it
    config = EngineConfig(batch_size=3, min_prob=floor, fallback_label="human")
    fast = Engine(model, tok, task, config).classify(texts)
    ref = ReferenceClassifier(model, tok, task, fallback=config.fallback).classify(texts)
    assert_equal(ref, fast)
    assert [p.model_label for p in fast] == [p.model_label for p in ref] == [p.label for p in plain]
    assert [p.label for p in fast] == [p.label if p.probs[p.label] >= floor else "human" for p in plain]
    assert sum(p.label == "human" for p in fast) == 4
    # a near-tie rechecked on the exact path gets the floor too
    rechecked = Engine(model, tok, task, EngineConfig(recheck_margin=float("inf"), min_prob=floor,
                                                      fallback_label="human")).classify(texts)
    assert [p.label for p in rechecked] == [p.label for p in ref]


@pytest.mark.parametrize("labels", ["single", "multi"])
def test_truncate_tokens_agrees_with_reference(tiny_qwen, labels):
    """A task's truncate_tokens cuts the same texts at the same token in both paths (Prompt.fit_text)."""
    model, tok = tiny_qwen
    task = Task(LABEL_SETS[labels], truncate_tokens=12)
    rng = random.Random(4)
    texts = [make_text(rng, rng.choice([3, 11, 12, 13, 40, 200])) for _ in range(24)]
    engine = Engine(model, tok, task, EngineConfig(batch_size=5))
    fast = engine.classify(texts)
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    assert_equal(ref, fast)
    cut = [p.truncated for p in fast]
    assert any(cut) and not all(cut) and engine.last_stats.num_truncated == sum(cut)
    assert max(p.num_tokens for p in fast) < max(p.num_tokens for p in Engine(model, tok, Task(
        LABEL_SETS[labels]), EngineConfig(batch_size=5)).classify(texts))
