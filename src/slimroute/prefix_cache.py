"""Prefill the task's shared prefix once; give each batch its own expanded copy of the keys/values."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class PrefixCache:
    def __init__(self, model, prefix_ids: list[int]):
        self.model = model
        self.length = len(prefix_ids)
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if prefix_ids:
            device = next(model.parameters()).device
            cache = DynamicCache(config=model.config)
            with torch.inference_mode():
                model.base_model(input_ids=torch.tensor([prefix_ids], device=device), cache=cache, use_cache=True)
            self._layers = [(layer.keys, layer.values) for layer in cache.layers]  # (1, H, P, D)

    def expand(self, batch_size: int) -> DynamicCache:
        """A fresh cache for a batch; filling it copies, so the shared prefix is never modified."""
        if not self._layers:
            return DynamicCache(config=self.model.config)
        data = [(k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1)) for k, v in self._layers]
        return DynamicCache(ddp_cache_data=data, config=self.model.config)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._layers


def continue_cache(cache: DynamicCache, config) -> DynamicCache:
    """A cache that extends `cache` without modifying it (used for label continuation steps)."""
    data = [(layer.keys, layer.values) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=data, config=config)
