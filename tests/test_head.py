"""A tuned head: the fast path equals the reference with it, it round-trips its folder, and it refuses
any model, tokenizer or prompt it was not tuned with."""

from __future__ import annotations

import random

import pytest
import torch
from test_equivalence import LABEL_SETS, assert_equal
from tiny import make_text, tiny_model

from slimroute.accuracy.head import FEATURE_SETS, Head, HeadMismatchError, check_out, feature_states, task_spec
from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.runtime.fingerprint import identity
from slimroute.task import Task

HEAD_LABELS = tuple(f"intent_{i}" for i in range(12))  # more labels than the task: the head decides alone


def random_head(model, tok, task: Task, labels=HEAD_LABELS, with_label_logprobs=False, seed=0,
                features="hidden", normalize=False, layers=()) -> Head:
    """A head with random weights on features standardised as tuning would (mean/std of real features),
    valid for this model, tokenizer and task. features: a head.FEATURE_SETS name without "+label-logprobs";
    layers: decoder layers whose means join the features."""
    gen = torch.Generator().manual_seed(seed)
    feature_set = features + ("+label-logprobs" if with_label_logprobs else "")
    features = Engine(model, tok, task).features(texts_for(seed + 100, 24), with_label_logprobs,
                                                 states=feature_states(feature_set), layers=layers)  # (N, F)
    num_features = features.shape[1]
    return Head(
        labels,
        weight=torch.randn(len(labels), num_features, generator=gen, dtype=torch.float64) * 3 / num_features**0.5,
        bias=torch.randn(len(labels), generator=gen, dtype=torch.float64) * 0.1,
        mean=features.mean(dim=0),
        std=features.std(dim=0) + 1e-3,
        features=feature_set,
        meta={"identity": identity(model, tok, task), "task": task_spec(task), "model": "tiny"},
        normalize=normalize,
        layers=layers,
    )


def texts_for(seed: int, n: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [make_text(rng, rng.choice([1, 3, 8, 20, 60])) for _ in range(n)]


@pytest.mark.parametrize("batch_size", [1, 7, 32])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("features", [*FEATURE_SETS, "mean, normalized", "hidden+mean, layer 1",
                                      "hidden+label-logprobs, layer 1"])
def test_fast_path_equals_reference_with_a_head(tiny, batch_size, prefix_cache, features):
    model, tok = tiny
    task = Task(LABEL_SETS["multi"])  # multi-token labels: their log-probs need the continuation steps
    feature_set = features.split(",")[0]
    with_label_logprobs = feature_set.endswith("+label-logprobs")
    layers = (1,) if features.endswith("layer 1") else ()
    head = random_head(model, tok, task, with_label_logprobs=with_label_logprobs, seed=len(features),
                       features=feature_set.removesuffix("+label-logprobs"),
                       normalize=features.endswith("normalized"), layers=layers)
    states = {"last": 1, "mean": 1, "last+mean": 2}[head.states] + len(layers)
    assert head.weight.shape[1] == model.config.hidden_size * states + (len(task.labels) if with_label_logprobs
                                                                        else 0)
    texts = texts_for(batch_size)
    config = EngineConfig(batch_size=batch_size, prefix_cache=prefix_cache)
    fast = Engine(model, tok, task, config, head=head).classify(texts)
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    for f, r in zip(fast, ref, strict=True):
        assert f.label == r.label and f.label in HEAD_LABELS
        assert set(f.logprobs) == set(HEAD_LABELS)
        assert max(abs(f.logprobs[k] - r.logprobs[k]) for k in HEAD_LABELS) <= 1e-4
        assert f.num_tokens == r.num_tokens and f.truncated == r.truncated
    assert len({p.label for p in fast}) > 1  # the head really decides (not one constant answer)


def test_head_decision_is_the_argmax_of_its_log_probs(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    head = random_head(model, tok, task, seed=3)
    for decision in ("greedy", "max-prob"):
        preds = Engine(model, tok, task, EngineConfig(decision=decision), head=head).classify(texts_for(3))
        for p in preds:
            assert p.label == max(HEAD_LABELS, key=lambda k: (p.logprobs[k], -HEAD_LABELS.index(k)))
            assert abs(sum(p.probs.values()) - 1) < 1e-9


def test_a_head_is_never_calibrated(tiny_qwen):
    """Calibration offsets are for label tokens; with a head both paths refuse them (ValueError)."""
    from slimroute.accuracy.calibration import Offsets

    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    head = random_head(model, tok, task, seed=4)
    offsets = Offsets("batch", HEAD_LABELS, tuple((0.1,) for _ in HEAD_LABELS), 5)
    for make in (lambda: Engine(model, tok, task, head=head, calibration=offsets),
                 lambda: ReferenceClassifier(model, tok, task, head=head, calibration=offsets),
                 lambda: Engine(model, tok, task, head=head).with_calibration(offsets),
                 lambda: ReferenceClassifier(model, tok, task, head=head).with_calibration(offsets)):
        with pytest.raises(ValueError, match="--calibrate batch does not apply to a tuned head"):
            make()
    assert Engine(model, tok, task, head=head).with_calibration(None).calibration is None


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_features_are_the_reference_hidden_states(tiny, prefix_cache):
    """[last state, mean state over the item's tokens, label log-probs]: the mean from first principles (the
    whole prompt's final-norm states after the prefix), with or without the prefix cache."""
    model, tok = tiny
    task = Task(LABEL_SETS["shared"])
    texts = texts_for(5, 12)
    engine = Engine(model, tok, task, EngineConfig(batch_size=5, prefix_cache=prefix_cache))
    features = engine.features(texts, with_label_logprobs=True, states="last+mean", layers=(1,))  # (N, 3H + L)
    ref = ReferenceClassifier(model, tok, task)
    hidden = model.config.hidden_size
    assert features.shape == (len(texts), 3 * hidden + len(task.labels)) and features.dtype == torch.float64
    for row, text in zip(features, texts, strict=True):
        prompt_ids = ref.prompt.prefix_ids + ref.prompt.item_ids(text)
        with torch.inference_mode():
            every = model(input_ids=torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states
        item = every[-1][0][len(ref.prompt.prefix_ids):].double()  # (n, H): the item's tokens, not the prefix
        layer_1 = every[1][0][len(ref.prompt.prefix_ids):].double()  # the first decoder layer's output there
        assert torch.allclose(row[:hidden], item[-1], atol=1e-5)
        assert torch.allclose(row[hidden:2 * hidden], item.mean(dim=0), atol=1e-5)
        assert torch.allclose(row[2 * hidden:3 * hidden], layer_1.mean(dim=0), atol=1e-5)
        totals = [sum(lps) for lps in ref._label_logprobs(prompt_ids)]
        assert torch.allclose(row[3 * hidden:], torch.tensor(totals, dtype=torch.float64), atol=1e-4)
    # the last state alone: the last layer's MLP then runs on the last rows only (engine.rows_only), and an fp32
    # GEMM's rounding may follow its row count
    assert torch.allclose(engine.features(texts, with_label_logprobs=True)[:, :hidden], features[:, :hidden],
                          atol=1e-5)
    assert torch.equal(engine.features(texts, states="last+mean"), features[:, :2 * hidden])
    assert torch.equal(engine.features(texts, states="mean"), features[:, hidden:2 * hidden])
    assert engine.features([]).shape[0] == 0


def test_head_round_trips_through_its_folder(tiny_qwen, tmp_path):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"], "Route the ticket.")
    head = random_head(model, tok, task, with_label_logprobs=True)
    head.save(tmp_path / "head")
    loaded = Head.load(tmp_path / "head")
    assert loaded.labels == head.labels and loaded.features == head.features and loaded.meta == head.meta
    assert not loaded.normalize
    normalized = random_head(model, tok, task, features="mean", normalize=True)
    normalized.save(tmp_path / "normalized")
    assert Head.load(tmp_path / "normalized").normalize and normalized.digest != random_head(
        model, tok, task, features="mean").digest
    for name in ("weight", "bias", "mean", "std"):
        assert torch.equal(getattr(loaded, name), getattr(head, name))
    layered = random_head(model, tok, task, features="hidden+mean", layers=(1,))
    layered.save(tmp_path / "layered")
    assert Head.load(tmp_path / "layered").layers == (1,) and Head.load(tmp_path / "layered").digest == layered.digest
    assert loaded.layers == () and layered.digest != random_head(model, tok, task, features="hidden+mean").digest
    assert loaded.task == task and loaded.digest == head.digest
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["head.json", "head.safetensors"]
    cut = Task(LABEL_SETS["single"], "Route the ticket.", truncate_tokens=64)  # read as it was tuned
    random_head(model, tok, cut).save(tmp_path / "cut")
    assert Head.load(tmp_path / "cut").task == cut and "truncate_tokens" not in head.meta["task"]
    templated = Task(LABEL_SETS["single"], template=TEMPLATE, descriptions={"billing": "charges and refunds"})
    random_head(model, tok, templated).save(tmp_path / "templated")
    assert Head.load(tmp_path / "templated").task == templated and "template" not in head.meta["task"]


TEMPLATE = 'Customer message: "{text}"\nTopic (a few words): "'


@pytest.mark.parametrize("config", [dict(batch_size=1), dict(batch_size=7), dict(batch_size=7, prefix_cache=False),
                                    dict(batch_size=7, chunk_tokens=32)], ids=["1", "7", "7-no-prefix", "7-chunked"])
@pytest.mark.parametrize("features", ["hidden", "hidden+mean+label-logprobs"])
def test_fast_path_equals_reference_with_a_template_head(tiny, config, features):
    """A template renders no chat turn and leaves an empty prefix: the engine (prefix cache on or off, long items
    in chunks) still gives the reference's answers, and the labels are scored after the template's end."""
    model, tok = tiny
    task = Task(LABEL_SETS["multi"], template=TEMPLATE)
    head = random_head(model, tok, task, seed=9, features=features.removesuffix("+label-logprobs"),
                       with_label_logprobs=features.endswith("+label-logprobs"))
    texts = texts_for(9)
    engine = Engine(model, tok, task, EngineConfig(**config), head=head)
    assert engine.prompt.prefix_ids == [] and (engine._chunk_tokens == 32) == ("chunk_tokens" in config)
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    fast = engine.classify(texts)
    assert [p.label for p in fast] == [p.label for p in ref] and len({p.label for p in fast}) > 1
    assert max(abs(f.logprobs[k] - r.logprobs[k]) for f, r in zip(fast, ref, strict=True) for k in HEAD_LABELS) <= 1e-4
    plain = Engine(model, tok, task, EngineConfig(**config))  # zero-shot over the labels, after the template
    assert_equal(ReferenceClassifier(model, tok, task).classify(texts), plain.classify(texts))


def test_head_refuses_another_model_tokenizer_or_prompt(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    head = random_head(model, tok, task)
    other_model, _ = tiny_model("qwen2", seed=1)
    with pytest.raises(HeadMismatchError, match="tuned for another model"):
        Engine(other_model, tok, task, head=head)
    other_tok = tiny_model("qwen2")[1]
    other_tok.add_tokens(["refundable"])
    with pytest.raises(HeadMismatchError, match="tuned for another tokenizer"):
        ReferenceClassifier(model, other_tok, task, head=head)
    with pytest.raises(HeadMismatchError, match="tuned for another prompt"):
        Engine(model, tok, Task(LABEL_SETS["single"], "Another instruction."), head=head)
    with pytest.raises(HeadMismatchError, match="tuned for another prompt"):
        Engine(model, tok, Task(("billing", "account", "technical")), head=head)  # the labels' order is prompt
    too_deep = Head(head.labels, head.weight, head.bias, head.mean, head.std, head.features, head.meta, layers=(2,))
    with pytest.raises(HeadMismatchError, match=r"reads decoder layers \[2\]; this model has 2"):
        Engine(model, tok, task, head=too_deep)  # hidden_states[2] of a 2-layer model is the final state


def test_identity_survives_dtype_but_not_fine_tuning(tiny_qwen):
    model, tok = tiny_qwen
    task = Task(LABEL_SETS["single"])
    base = identity(model, tok, task)
    bf16, _ = tiny_model("qwen2", dtype=torch.bfloat16)
    assert identity(bf16, tok, task) == base
    tuned, _ = tiny_model("qwen2")
    with torch.no_grad():
        tuned.model.norm.weight.mul_(1.01)
    assert identity(tuned, tok, task)["model_fingerprint"] != base["model_fingerprint"]


@pytest.mark.parametrize("change, message", [
    (dict(labels=("a",)), "expected 2 distinct labels"),
    (dict(features="logits"), "features must be one of"),
    (dict(bias=torch.zeros(3, dtype=torch.float64)), "do not fit together"),
    (dict(layers=(0,)), "hidden_states indices >= 1"),
])
def test_bad_heads_are_refused(change, message):
    fields = dict(labels=("a", "b"), weight=torch.zeros(2, 4, dtype=torch.float64),
                  bias=torch.zeros(2, dtype=torch.float64), mean=torch.zeros(4, dtype=torch.float64),
                  std=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=message):
        Head(**{**fields, **change})


def test_load_names_what_is_wrong(tmp_path, tiny_qwen):
    with pytest.raises(ValueError, match="is not a head folder"):
        Head.load(tmp_path)
    model, tok = tiny_qwen
    random_head(model, tok, Task(LABEL_SETS["single"])).save(tmp_path / "h")
    meta = tmp_path / "h" / "head.json"
    meta.write_text(meta.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="version 99"):
        Head.load(tmp_path / "h")
    (tmp_path / "h" / "head.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="unreadable"):
        Head.load(tmp_path / "h")


def test_out_folder_rules(tmp_path, tiny_qwen):
    check_out(tmp_path / "new")
    check_out(tmp_path)  # empty
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        check_out(tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="is a file"):
        check_out(tmp_path / "notes.txt")
    model, tok = tiny_qwen
    head = random_head(model, tok, Task(LABEL_SETS["single"]))
    head.save(tmp_path / "h")
    with pytest.raises(ValueError, match="already holds a head; pass --overwrite"):
        head.save(tmp_path / "h")
    head.save(tmp_path / "h", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
