"""slimroute: a small language model as a fast, exact classifier and router."""

from slimroute.config import EngineConfig
from slimroute.labels import Prediction
from slimroute.task import Example, Task

__all__ = ["EngineConfig", "Example", "Prediction", "Task"]
__version__ = "0.1.0"
