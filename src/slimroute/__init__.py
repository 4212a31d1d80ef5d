"""slimroute: a small language model as a fast, exact classifier and router."""

import os

# oneDNN, and torch's ideep layer above it, each cache a primitive (with its buffers) per GEMM shape;
# varied batch shapes then grow memory without bound (measured: +400 MiB over 288 shapes). Only both
# caches bounded together keep it flat (+100 MiB); either alone does not. A small cache holds a few
# batches' shapes. Both must be set before torch initialises oneDNN, so they live here, before anything
# imports torch.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
os.environ.setdefault("LRU_CACHE_CAPACITY", "32")

# ruff: noqa: E402

from slimroute.config import EngineConfig
from slimroute.labels import Prediction
from slimroute.task import Example, Task

__all__ = ["EngineConfig", "Example", "Prediction", "SlimRouteClassifier", "Task"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "SlimRouteClassifier":  # imported on first use: it needs scikit-learn and torch
        from slimroute.estimator import SlimRouteClassifier

        return SlimRouteClassifier
    raise AttributeError(f"module 'slimroute' has no attribute {name!r}")
