import torch

from slimroute.config import EngineConfig
from slimroute.engine import Engine
from slimroute.prefix_cache import PrefixCache, continue_cache
from slimroute.task import Prompt, Task


def snapshot(cache: PrefixCache):
    return [(k.clone(), v.clone()) for k, v in cache.tensors()]


def test_batches_never_modify_the_shared_prefix(tiny):
    model, tok = tiny
    task = Task(("Technical Support", "Technical Sales", "billing"))
    engine = Engine(model, tok, task, EngineConfig(batch_size=4))
    before = snapshot(engine.prefix)
    engine.classify(["first ticket", "a much longer second ticket about billing " * 5, "x"])
    after = engine.prefix.tensors()
    assert all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(before, after, strict=True))
    assert after[0][0].shape[0] == 1 and after[0][0].shape[-2] == len(engine.prompt.prefix_ids)


def test_expand_gives_batch_sized_independent_caches(tiny_qwen):
    model, tok = tiny_qwen
    prefix = PrefixCache(model, Prompt(Task(("a", "b")), tok).prefix_ids)
    cache = prefix.expand(5)
    assert cache.get_seq_length() == prefix.length
    assert cache.layers[0].keys.shape[0] == 5
    cache.layers[0].keys.add_(1.0)  # writing into a batch's copy must not reach the shared prefix
    assert not torch.equal(cache.layers[0].keys[:1], prefix.tensors()[0][0])


def test_continue_cache_leaves_the_original_unchanged(tiny_qwen):
    model, tok = tiny_qwen
    prefix = PrefixCache(model, Prompt(Task(("a", "b")), tok).prefix_ids)
    cache = prefix.expand(2)
    extended = continue_cache(cache, model.config)
    with torch.inference_mode():
        model.base_model(input_ids=torch.tensor([[5], [6]]), cache=extended, use_cache=True,
                         position_ids=torch.full((2, 1), prefix.length))
    assert extended.get_seq_length() == prefix.length + 1 and cache.get_seq_length() == prefix.length


def test_prefix_cache_matches_full_prompt(tiny_llama):
    model, tok = tiny_llama
    task = Task(("billing", "account"))
    texts = ["refund my card please", "login error"]
    cached = Engine(model, tok, task, EngineConfig(prefix_cache=True)).classify(texts)
    full = Engine(model, tok, task, EngineConfig(prefix_cache=False)).classify(texts)
    for a, b in zip(cached, full, strict=True):
        assert a.label == b.label and max(abs(a.logprobs[k] - b.logprobs[k]) for k in a.logprobs) < 1e-4
