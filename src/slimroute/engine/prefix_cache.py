"""Prefill the task's shared prefix once; give each batch its own expanded copy of the keys/values."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from slimroute.runtime import attention
from slimroute.runtime.attention import extended


class PrefixCache:
    def __init__(self, model, prefix_ids: list[int]):
        self.model = model
        self.length = len(prefix_ids)
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if prefix_ids:
            device = next(model.parameters()).device
            cache = new_cache(model.config)
            with torch.inference_mode():
                model.base_model(input_ids=torch.tensor([prefix_ids], device=device), cache=cache, use_cache=True)
            self._layers = [(layer.keys, layer.values) for layer in cache.layers]  # (1, H, P, D)

    def expand(self, batch_size: int) -> DynamicCache:
        """A fresh cache for a batch; filling it copies, so the shared prefix is never modified."""
        data = [(k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1)) for k, v in self._layers]
        return new_cache(self.model.config, data)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._layers


def new_cache(config, data=None) -> DynamicCache:
    """A cache (empty, or holding data: [(keys, values)] per layer) whose every layer keeps all its keys. A
    sliding-window layer's own cache (Gemma 2 and 3, Mistral's) drops the keys before its window by position, for the
    whole batch at once, where right-padded rows of other lengths and the labels' continuation passes still need
    them; the window is kept by the attention mask, which the model makes from the config either way."""
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    for layer, (keys, values) in zip(cache.layers, data or (), strict=False):
        layer.update(keys, values)
    return cache


def smallest_window(config) -> int | None:
    """The smallest sliding window among the model's attention layers, as transformers reads the config (None: every
    layer attends to all keys)."""
    windows = [layer.sliding_window for layer in DynamicCache(config=config).layers if getattr(layer, "is_sliding", 0)]
    return min(windows) if windows else None


def continue_cache(cache: DynamicCache, config, repeats: int = 1, shared: list | None = None) -> DynamicCache:
    """A cache that extends `cache` without modifying it, for one pass over label continuation steps: its batch is
    `repeats` copies of cache's rows, one after another (a pass feeding several labels, one label to each copy).
    Its layers hand attention the cached keys/values followed by the pass's new ones and keep nothing: the
    continuation's keys are never read again.

    shared: a list the caller keeps across the passes over one batch cache, for a model whose attention is the
    batch-invariant one (attention.py): its layers then hand attention the new keys alone, marked with the cached
    ones (attention.CachedKeys, tiled once per batch and kept in the list), instead of a copy of both."""
    layers = list(cache.layers)
    if not all(type(layer) is DynamicLayer for layer in layers):  # another kind of cache layer: its own update
        data = [(layer.keys.repeat(repeats, 1, 1, 1), layer.values.repeat(repeats, 1, 1, 1)) for layer in layers]
        return new_cache(config, data)
    if shared is not None and getattr(config, "_attn_implementation", None) == attention.NAME:
        if not shared:
            shared.extend(attention.CachedKeys(layer.keys, layer.values) for layer in layers)
    else:
        shared = [None] * len(layers)
    continued = DynamicCache(config=config)
    continued.layers = [_ExtendingLayer(layer.keys, layer.values, repeats, marked)
                        for layer, marked in zip(layers, shared, strict=True)]
    return continued


class _ExtendingLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, repeats: int, shared=None):
        super().__init__()
        self.keys, self.values, self.repeats, self.shared = keys, values, repeats, shared
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.shared is not None:
            return self.shared.mark(key_states), value_states
        return extended(self.keys, key_states, self.repeats), extended(self.values, value_states, self.repeats)
