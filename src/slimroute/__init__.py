"""slimroute: a small language model as a fast, exact classifier and router."""

import os

# oneDNN caches a primitive (with its buffers) per GEMM shape; varied batch shapes then grow memory
# without bound (measured: +760 MiB over 300 shapes). A small cache holds one batch's shapes. It must be
# set before torch initialises oneDNN, so it lives here, before anything imports torch.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")

# ruff: noqa: E402

from slimroute.config import EngineConfig
from slimroute.labels import Prediction
from slimroute.task import Example, Task

__all__ = ["EngineConfig", "Example", "Prediction", "Task"]
__version__ = "0.1.0"
