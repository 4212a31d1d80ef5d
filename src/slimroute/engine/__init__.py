"""The hot path: `Engine` (fast.py, batched with a prefix cache) beside `ReferenceClassifier` (reference.py, one item
at a time, naive on purpose), both deciding through one `TaskSetup` (setup.py); scoring, the prefix cache, batching,
and the comparison that verifies one against the other."""

from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier

__all__ = ["Engine", "ReferenceClassifier"]
