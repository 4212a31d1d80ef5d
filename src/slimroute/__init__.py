"""slimroute: a small language model as a fast, exact classifier and router.

    import slimroute
    router = slimroute.load("qwen2.5-coder-0.5b", ["billing", "technical", "account"])
    router.classify(["I was charged twice"])
"""

import os

# oneDNN, and torch's ideep layer above it, each cache a primitive (with its buffers) per GEMM shape; varied batch
# shapes then grow memory without bound. Only both caches bounded together keep it flat (docs/design.md). Both must be
# set before torch initialises oneDNN, so they live here, before anything imports torch.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
os.environ.setdefault("LRU_CACHE_CAPACITY", "32")

# ruff: noqa: E402

from slimroute.config import EngineConfig
from slimroute.labels import Prediction
from slimroute.task import Example, Task

__all__ = ["EngineConfig", "Example", "Prediction", "Recipe", "Router", "SlimRouteClassifier", "Task", "load"]
__version__ = "0.1.0"



def __getattr__(name: str):
    """The model-running names, imported on first use: `import slimroute` stays light (no torch) for the CLI's
    --version and for code that only reads a Task or a Prediction."""
    if name in ("load", "Router", "Recipe"):
        from slimroute import router  # lazy: torch and transformers load only when a model is asked for

        return getattr(router, name)
    if name == "SlimRouteClassifier":
        from slimroute.estimator import SlimRouteClassifier  # lazy: scikit-learn and torch

        return SlimRouteClassifier
    raise AttributeError(f"module 'slimroute' has no attribute {name!r}")
