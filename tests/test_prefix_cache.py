import pytest
import torch
from tiny import tiny_model

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.prefix_cache import PrefixCache, continue_cache
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


def _continue(model, cache, length: int, tokens: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return model.base_model(input_ids=torch.tensor(tokens), cache=cache, use_cache=True,
                                position_ids=torch.full((len(tokens), 1), length)).last_hidden_state


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-window"])
def test_continue_cache_repeats_the_rows_and_leaves_the_original_unchanged(sliding):
    """A continuation pass over `repeats` copies of a batch's rows sees what a cache holding those copies shows
    (with a sliding-window model's own layers too) and leaves the batch's cache as it was."""
    from transformers import DynamicCache

    model, tok = tiny_model("qwen2")
    if sliding:  # the same model with sliding-window layers (a window longer than anything here)
        from transformers import Qwen2ForCausalLM

        config = model.config.to_dict() | {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": 0,
                                           "layer_types": None}
        model = Qwen2ForCausalLM(type(model.config)(**config)).eval()
        assert set(model.config.layer_types) == {"sliding_attention"}
    prefix = PrefixCache(model, Prompt(Task(("a", "b")), tok).prefix_ids)
    cache = prefix.expand(2)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    extended = continue_cache(cache, model.config, repeats=3)
    tokens = [[5], [6], [7], [8], [9], [10]]  # copy j of row r: row 2 * j + r
    got = _continue(model, extended, prefix.length, tokens)
    data = [(k.repeat(3, 1, 1, 1), v.repeat(3, 1, 1, 1)) for k, v in before]
    expected = _continue(model, DynamicCache(ddp_cache_data=data, config=model.config), prefix.length, tokens)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == prefix.length
    assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
               for layer, (k, v) in zip(cache.layers, before, strict=True))


@pytest.mark.parametrize("invariant", [False, True], ids=["sdpa", "invariant attention"])
def test_continue_cache_hands_the_invariant_attention_the_new_keys_marked_with_the_cached_ones(invariant):
    """With a list kept across a batch's passes, a model with the batch-invariant attention gets the pass's new keys
    alone, marked with the batch's cached keys (made once, for every pass); any other attention gets them in full."""
    from slimroute.runtime.attention import CachedKeys, register

    model, tok = tiny_model("qwen2")
    if invariant:
        model.set_attn_implementation(register())
    prefix = PrefixCache(model, Prompt(Task(("a", "b")), tok).prefix_ids)
    cache, shared = prefix.expand(2), []
    layer = continue_cache(cache, model.config, 3, shared).layers[0]
    new = torch.randn(6, *cache.layers[0].keys.shape[1:2], 1, cache.layers[0].keys.shape[3])
    keys, _ = layer.update(new, new)
    assert len(shared) == (len(cache.layers) if invariant else 0)
    if invariant:
        assert keys is new and getattr(keys, CachedKeys.MARK) is shared[0] and shared[0].keys is cache.layers[0].keys
        continue_cache(cache, model.config, 1, shared)
        assert len(shared) == len(cache.layers)  # made once per batch
    else:
        assert torch.equal(keys, torch.cat([cache.layers[0].keys.repeat(3, 1, 1, 1), new], dim=2))
    tokens = [[5], [6], [7], [8], [9], [10]]
    got = _continue(model, continue_cache(cache, model.config, 3, shared), prefix.length, tokens)
    assert torch.equal(got, _continue(model, continue_cache(cache, model.config, 3), prefix.length, tokens))


def test_prefix_cache_matches_full_prompt(tiny_llama):
    model, tok = tiny_llama
    task = Task(("billing", "account"))
    texts = ["refund my card please", "login error"]
    cached = Engine(model, tok, task, EngineConfig(prefix_cache=True)).classify(texts)
    full = Engine(model, tok, task, EngineConfig(prefix_cache=False)).classify(texts)
    for a, b in zip(cached, full, strict=True):
        assert a.label == b.label and max(abs(a.logprobs[k] - b.logprobs[k]) for k in a.logprobs) < 1e-4
