"""`slimroute serve`: an HTTP classification service with micro-batching (see docs/server.md).

    tasks.py       the task file (one task or several named ones)
    microbatch.py  queue -> engine in one worker thread
    app.py         FastAPI factory, schemas, limits, metrics
"""

from __future__ import annotations

import logging
from dataclasses import replace

from slimroute.config import EngineConfig
from slimroute.head import HeadMismatchError
from slimroute.server.app import ServerSettings, create_app
from slimroute.server.microbatch import BatchSettings
from slimroute.server.tasks import TaskSet, load_task_set

__all__ = ["BatchSettings", "ServerSettings", "TaskSet", "create_app", "load_task_set", "serve"]
log = logging.getLogger(__name__)


def serve(
    task_set: TaskSet, model: str, dtype: str = "auto", threads: int | None = None, device: str = "cpu",
    config: EngineConfig | None = None, settings: ServerSettings | None = None,
    host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", access_log: bool = False, head=None,
) -> int:
    """Load the model in the background (GET /ready turns 200 when done), serve until SIGTERM/SIGINT,
    finish what was accepted, and return the exit code (1 if the model failed to load, 2 if it is not the
    model, tokenizer or prompt the head was tuned with). head: a tuned Head deciding every task.
    A dtype this CPU cannot run raises cpu.UnsupportedDtypeError before anything starts."""
    import uvicorn

    from slimroute.cpu import choose_dtype

    choice = choose_dtype(dtype, device=device)

    def build_engines() -> dict:
        from slimroute.engine import Engine
        from slimroute.models import load_model

        loaded = load_model(model, choice.name, threads, device)
        engines = {name: Engine.from_loaded(loaded, task, config, head) for name, task in task_set.tasks.items()}
        log.warning("model %s loaded (%s, %d threads); serving tasks %s", model, choice, loaded.threads,
                    ", ".join(engines))
        return engines

    def load_failed(message: str) -> None:
        log.error("could not load the model: %s", message)
        server.should_exit = True

    settings = replace(settings or ServerSettings(), default_task=task_set.default, model_name=model,
                       dtype=choice.name, dtype_reason=choice.reason)
    app = create_app(build_engines, settings, on_load_error=load_failed)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                           access_log=access_log))
    server.run()
    error = app.state.service.load_error
    return (2 if error.startswith(HeadMismatchError.__name__) else 1) if error else 0
