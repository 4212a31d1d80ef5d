"""`slimroute serve`: an HTTP classification service with micro-batching (see docs/server.md).

    tasks.py       the task file (one task or several named ones)
    scheduler.py   which texts go into the next engine call: token-budget turns, requests taking turns
    microbatch.py  queue -> engine in one worker thread
    auth.py        API keys (Bearer), checked before a request's body is read
    prometheus.py  Prometheus metrics
    schemas.py     request and response bodies, the error shape
    body.py        a request body read as the schema says (media type, UTF-8 JSON, the request shapes)
    limits.py      a body's size and time limits (413, 408); protocol.py: the headers' time limit
    requestlog.py  request ids, the request metrics, one log line per refusal
    openapi.py     the OpenAPI schema: every status, the request shapes, the security scheme
    app.py         the Service: its routes, limits and errors
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

import uvicorn

from slimroute.accuracy.calibration import check_head
from slimroute.accuracy.head import HeadMismatchError
from slimroute.config import EngineConfig
from slimroute.router import Recipe
from slimroute.runtime.dtypes import DtypeChoice, choose_dtype
from slimroute.server.app import ServerSettings, Service, create_app
from slimroute.server.auth import ApiKeys, gather_keys, is_loopback
from slimroute.server.microbatch import BatchSettings
from slimroute.server.protocol import read_timeout_protocol
from slimroute.server.tasks import TaskSet, load_task_set
from slimroute.task import Task

__all__ = ["ApiKeys", "BatchSettings", "ServerSettings", "Service", "TaskSet", "create_app", "load_task_set",
           "prepare", "read_timeout_protocol", "serve"]
log = logging.getLogger(__name__)


def prepare(
    *, task_file: str | Path | None = None, labels: str | None = None, instructions: str | None = None,
    batch_size: int = 32, max_gather_tokens: int = 2048, preempt_tokens: int = 1024, max_wait_ms: float = 50.0,
    max_queue: int = 1024, max_texts: int = 256, max_text_chars: int = 20_000, max_text_tokens: int = 2048,
    max_body_bytes: int = 1 << 20, read_timeout_s: float = 30.0,
    api_keys: Iterable[str] | None = None, api_key_file: str | Path | None = None, metrics_need_key: bool = False,
    environ: Mapping[str, str] | None = None, tasks: TaskSet | None = None,
) -> tuple[TaskSet, ServerSettings]:
    """`slimroute serve`'s flags -> (tasks, settings); 0 means no cap for the gather and token limits.
    Keys: `api_keys` and the file's, else $SLIMROUTE_API_KEY (auth.gather_keys). Raises ValueError."""
    if task_file and labels:
        raise ValueError("give either --task or --labels, not both")
    if tasks is not None:  # already built (a tuned head's task)
        task_set = tasks
    elif task_file:
        task_set = load_task_set(task_file)
    elif labels is None:
        raise ValueError("no labels: pass --labels a,b,c or --task task.yaml")
    else:
        single = Task.from_labels(labels, instructions)
        task_set = TaskSet({single.name: single}, single.name)
    keys = gather_keys(api_keys, api_key_file, environ)
    if metrics_need_key and not keys:
        raise ValueError("--metrics-need-key needs an API key (--api-key, --api-key-file or SLIMROUTE_API_KEY)")
    batch = BatchSettings(max_batch_items=batch_size, max_gather_tokens=max_gather_tokens or None,
                          preempt_tokens=preempt_tokens or None, max_wait_ms=max_wait_ms, max_queue_items=max_queue,
                          max_text_tokens=max_text_tokens or None)
    settings = ServerSettings(batch=batch, max_texts=max_texts, max_text_chars=max_text_chars,
                              max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s,
                              api_keys=ApiKeys(keys) if keys else None,
                              metrics_need_key=metrics_need_key)
    return task_set, settings


def serve(
    task_set: TaskSet, model: str, dtype: str | DtypeChoice = "auto", threads: int | None = None, device: str = "cpu",
    config: EngineConfig | None = None, settings: ServerSettings | None = None,
    host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", access_log: bool = False, head=None,
    calibration=None,
) -> int:
    """Load the model in the background (GET /ready turns 200 when done), serve until SIGTERM/SIGINT,
    finish what was accepted, and return the exit code (1 if the model failed to load, 2 if it is not the
    model, tokenizer or prompt the head was tuned with). head: a tuned Head deciding every task.
    calibration: an accuracy.calibration.CalibrationSettings; each task's offsets are estimated or fitted once,
    while loading (not with a head: ValueError). A dtype this CPU cannot run raises UnsupportedDtypeError before
    anything starts."""
    check_head(head, calibration)
    choice = dtype if isinstance(dtype, DtypeChoice) else choose_dtype(dtype, device=device)

    def build_engines() -> dict:
        tasks = list(task_set.tasks.items())
        first = Recipe(tasks[0][1], choice, model, config or EngineConfig(), head, None, threads, device).build()
        routers = {name: first if k == 0 else first.with_task(task, head) for k, (name, task) in enumerate(tasks)}
        if calibration is not None and calibration.on:
            routers = {name: router.calibrated(calibration) for name, router in routers.items()}
        log.warning("model %s loaded (%s, %d threads); serving tasks %s", model, choice, first.loaded.threads,
                    ", ".join(routers))
        return {name: router.engine for name, router in routers.items()}

    def load_failed(message: str) -> None:
        log.error("could not load the model: %s", message)
        server.should_exit = True

    settings = replace(settings or ServerSettings(), default_task=task_set.default, task_names=tuple(task_set.tasks),
                       model_name=model, dtype=choice.name, dtype_reason=choice.reason)
    if settings.api_keys is None and not is_loopback(host):
        log.warning("listening on %s without an API key: anyone who reaches it can use the service "
                    "(set --api-key, --api-key-file or SLIMROUTE_API_KEY)", host)
    service = Service(build_engines, settings, on_load_error=load_failed)
    server = uvicorn.Server(uvicorn.Config(service.app, host=host, port=port, log_level=log_level, lifespan="on",
                                           access_log=access_log, http=read_timeout_protocol(settings.read_timeout_s)))
    server.run()
    error = service.load_error
    return (2 if error.startswith(HeadMismatchError.__name__) else 1) if error else 0
