"""The HTTP service: a `Service` holds the engines and the micro-batcher, and its FastAPI app's routes call its methods.

`engines` maps task name -> Engine (or is a zero-argument callable that builds that mapping, run in a thread at
startup so /health answers while the model loads). Routes: POST /v1/classify, POST /v1/tasks/{name}/classify,
GET /v1/info, /health, /ready, /metrics. Every error answers `{"error": {"type", "message", "field"}}` (schemas.py);
compute never runs on the event loop. With API keys (`settings.api_keys`), every path but /health, /ready (and
/metrics unless `metrics_need_key`) needs `Authorization: Bearer KEY` (auth.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from slimroute.server.auth import REASONS, ApiKeys, RequireApiKey
from slimroute.server.microbatch import BatchSettings, EngineFailed, MicroBatcher, QueueFull, ShuttingDown, TextTooLong
from slimroute.server.prometheus import Prometheus
from slimroute.server.schemas import (
    ApiError,
    ClassifyRequest,
    ClassifyResponse,
    ItemResult,
    Timing,
    describe,
    error_response,
)

CLASSIFY_PATH = re.compile(r"^/v1/(?:tasks/([^/]+)/)?classify$")


@dataclass(frozen=True)
class ServerSettings:
    batch: BatchSettings = field(default_factory=BatchSettings)
    max_texts: int = 256  # texts per request
    max_text_chars: int = 20_000  # characters per text (the token limit is batch.max_text_tokens)
    max_body_bytes: int = 1 << 20
    default_task: str | None = None  # None: the first task
    model_name: str | None = None  # shown in /v1/info
    dtype: str | None = None  # what --dtype resolved to, and why (shown in /health and /v1/info)
    dtype_reason: str | None = None
    api_keys: ApiKeys | None = None  # None: no key needed
    metrics_need_key: bool = False  # /metrics behind the key too

    def __post_init__(self):
        for name in ("max_texts", "max_text_chars", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.api_keys is not None and not isinstance(self.api_keys, ApiKeys):
            raise ValueError(f"api_keys must be a slimroute.server.auth.ApiKeys or None, "
                             f"got {type(self.api_keys).__name__}")
        if self.metrics_need_key and self.api_keys is None:
            raise ValueError("metrics_need_key is set but no API key is given")


class BodyLimit:
    """Answer 413 to a body over `max_bytes`, from Content-Length or while a chunked body streams in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than the limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, "body_too_large", message, "body")(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, message)
            return event

        await self.app(scope, limited_receive, send)


class Service:
    """The engines, the micro-batcher and the app (`app`); `ready` once the engines exist and the worker runs.

    `on_load_error(message)` is called (from the event loop) when a loader callable fails."""

    def __init__(self, engines: dict | Callable[[], dict], settings: ServerSettings | None = None,
                 on_load_error: Callable[[str], None] | None = None):
        self.settings = settings or ServerSettings()
        self.metrics = Prometheus()
        self.engines: dict = {}
        self.default_task: str | None = None
        self.batcher: MicroBatcher | None = None
        self.load_error: str | None = None
        self._source, self._on_load_error = engines, on_load_error
        self.app = self._app()

    # ---------------------------------------------------------------- life cycle

    @property
    def ready(self) -> bool:
        return self.batcher is not None and self.batcher.running

    def start(self, engines: dict | Callable[[], dict]) -> None:
        try:
            engines = dict(engines() if callable(engines) else engines)
            default = self.settings.default_task or next(iter(engines), None)
            if default not in engines:
                raise ValueError(f"default task {default!r} is not one of the tasks {sorted(engines)}")
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self.engines, self.default_task = engines, default
        self.batcher = MicroBatcher(engines, self.settings.batch, self.metrics)
        self.batcher.start()

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.close()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        loading = None
        if callable(self._source):
            loading = asyncio.create_task(asyncio.to_thread(self.start, self._source))
            loading.add_done_callback(self._loaded)
        else:
            self.start(self._source)
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                await asyncio.wait({loading})
            await asyncio.to_thread(self.stop)

    def _loaded(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._on_load_error is not None:
            self._on_load_error(self.load_error or repr(task.exception()))

    # ---------------------------------------------------------------- the app

    def _app(self) -> FastAPI:
        app = FastAPI(title="slimroute", summary="A small LM as an exact classifier, over HTTP.",
                      lifespan=self.lifespan)
        app.state.service, app.state.metrics = self, self.metrics
        app.add_middleware(BodyLimit, max_bytes=self.settings.max_body_bytes)
        if self.settings.api_keys is not None:  # added last, so it runs first: before the body is read
            open_paths = {"/health", "/ready"} | (set() if self.settings.metrics_need_key else {"/metrics"})
            app.add_middleware(RequireApiKey, keys=self.settings.api_keys, open_paths=open_paths,
                               refuse=self.unauthorized)
        app.add_exception_handler(ApiError, self.on_api_error)
        app.add_exception_handler(RequestValidationError, self.on_validation_error)
        app.add_exception_handler(HTTPException, self.on_http_error)
        app.get("/health", summary="Liveness: the process answers")(self.health)
        app.get("/ready", summary="Readiness: the model is loaded and the worker runs")(self.readiness)
        app.get("/metrics", summary="Prometheus metrics")(self.prometheus)
        app.get("/v1/info", summary="Served tasks, their labels, and the request limits")(self.info)
        app.post("/v1/classify", response_model=ClassifyResponse,
                 summary="Classify with the default task")(self.classify_default)
        app.post("/v1/tasks/{name}/classify", response_model=ClassifyResponse,
                 summary="Classify with a task")(self.classify_named)
        return app

    async def health(self):
        return {"status": "ok", "dtype": self.settings.dtype, "dtype_reason": self.settings.dtype_reason}

    async def readiness(self):
        if self.ready:
            return {"status": "ready", "tasks": list(self.engines)}
        status = "failed" if self.load_error else ("stopping" if self.batcher else "loading")
        return JSONResponse({"status": status, "error": self.load_error}, status_code=503)

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def info(self) -> dict:
        tasks = [{"name": name, "labels": list(getattr(e, "labels", e.task.labels)),  # a head's labels, if any
                  "instructions": e.task.instructions, "descriptions": dict(e.task.descriptions),
                  "num_examples": len(e.task.examples), "truncate_tokens": e.task.truncate_tokens,
                  "prefix_tokens": len(e.prompt.prefix_ids) if hasattr(e, "prompt") else None,
                  "calibration": e.calibration.to_dict() if getattr(e, "calibration", None) else None,
                  "fallback": _fallback_info(getattr(e, "fallback", None)),
                  "default": name == self.default_task}
                 for name, e in self.engines.items()]
        s = self.settings
        limits = {"max_texts": s.max_texts, "max_text_chars": s.max_text_chars,
                  "max_body_bytes": s.max_body_bytes, "max_text_tokens": s.batch.max_text_tokens,
                  "max_queue_items": s.batch.max_queue_items}
        return {"model": s.model_name, "dtype": s.dtype, "dtype_reason": s.dtype_reason, "ready": self.ready,
                "default_task": self.default_task, "tasks": tasks, "limits": limits}

    async def classify_default(self, body: ClassifyRequest, request: Request):
        return await self.classify(self.default_task, body, request)

    async def classify_named(self, name: str, body: ClassifyRequest, request: Request):
        return await self.classify(name, body, request)

    async def classify(self, name: str | None, body: ClassifyRequest, request: Request):
        """answer() counted in the request metrics, with its status, and timed."""
        start = time.perf_counter()
        status = "500"
        try:
            response = await self.answer(name, body, request, start)
            status = str(getattr(response, "status_code", 200))
            return response
        except ApiError as exc:
            status = str(exc.status)
            raise
        finally:
            self.metrics.requests.labels(task=self.task_label(request), status=status).inc()
            self.metrics.latency.labels(task=self.task_label(request)).observe(time.perf_counter() - start)

    async def answer(self, name: str | None, body: ClassifyRequest, request: Request, start: float):
        """The task's answers to the request's texts: checked, queued, awaited (or dropped if the client goes)."""
        texts, ids = body.items()
        self.check(name, texts)
        batcher = self.batcher
        try:
            pending = batcher.submit(name, texts)
        except QueueFull as exc:
            self.metrics.errors.labels(task=name, kind="queue_full").inc()
            raise ApiError(503, "overloaded", str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except ShuttingDown as exc:
            raise ApiError(503, "shutting_down", str(exc), headers={"Retry-After": "1"}) from exc
        try:
            result = await wait_unless_disconnected(pending.future, request)
        except TextTooLong as exc:
            raise ApiError(413, "text_too_long", str(exc), f"texts[{exc.index}]") from exc
        except EngineFailed as exc:
            raise ApiError(500, "engine_error", str(exc)) from exc
        finally:
            if not pending.future.done():  # the caller went away (disconnected or cancelled)
                pending.future.cancel()
                if batcher.drop(pending):
                    self.metrics.dropped.labels(task=name).inc()
        if result is None:
            return Response(status_code=499)  # nobody reads this; it ends the request cleanly
        results = [ItemResult(id=i, label=p.label, model_label=p.model_label, probs=p.probs, logprobs=p.logprobs,
                              calibrated_logprobs=p.calibrated_logprobs, num_tokens=p.num_tokens,
                              truncated=p.truncated)
                   for i, p in zip(ids, result.predictions, strict=True)]
        timing = Timing(queue_ms=1000 * result.queue_seconds, engine_ms=1000 * result.engine_seconds,
                        total_ms=1000 * (time.perf_counter() - start), batch_items=result.batch_items,
                        batch_requests=result.batch_requests)
        return ClassifyResponse(task=name, results=results, timing=timing)

    def check(self, name: str | None, texts: list[str]) -> None:
        """Refuse, as an ApiError, what the service cannot take: before it is ready, an unknown task, the limits."""
        settings = self.settings
        if not self.ready:
            raise ApiError(503, "not_ready", "the model is not loaded yet" if not self.batcher
                           else "the server is shutting down", headers={"Retry-After": "1"})
        if name not in self.engines:
            raise ApiError(404, "unknown_task", f"task {name!r} does not exist; served: {sorted(self.engines)}")
        if len(texts) > settings.max_texts:
            raise ApiError(413, "too_many_texts", f"the request has {len(texts)} texts; the limit is "
                           f"{settings.max_texts} per request", "texts")
        for i, text in enumerate(texts):
            if len(text) > settings.max_text_chars:
                raise ApiError(413, "text_too_long", f"texts[{i}] has {len(text)} characters; the limit is "
                               f"{settings.max_text_chars} characters per text", f"texts[{i}]")

    # ---------------------------------------------------------------- errors

    def task_label(self, request: Request) -> str:
        name = request.path_params.get("name", self.default_task)
        return name if name in self.engines else "unknown"

    def unauthorized(self, scope: dict, reason: str) -> Response:
        self.metrics.unauthorized.labels(reason=reason).inc()
        if (match := CLASSIFY_PATH.match(scope["path"])) is not None:  # counted with the classify requests too
            name = match.group(1) or self.default_task
            self.metrics.requests.labels(task=name if name in self.engines else "unknown", status="401").inc()
        return error_response(401, "unauthorized", REASONS[reason], headers={"WWW-Authenticate": "Bearer"})

    async def on_api_error(self, request: Request, exc: ApiError):
        return error_response(exc.status, exc.kind, exc.message, exc.field, exc.headers)

    async def on_validation_error(self, request: Request, exc: RequestValidationError):
        details = [dict(zip(("field", "message"), describe(e), strict=True)) for e in exc.errors()]
        self.metrics.requests.labels(task=self.task_label(request), status="422").inc()
        first = details[0]
        return error_response(422, "invalid_request", f"{first['field']}: {first['message']}", first["field"],
                              details=details)

    async def on_http_error(self, request: Request, exc: HTTPException):
        too_large = exc.status_code == 413
        kind = "body_too_large" if too_large else "http_error"
        return error_response(exc.status_code, kind, str(exc.detail), "body" if too_large else None,
                              getattr(exc, "headers", None))


def _fallback_info(fallback) -> dict | None:
    return {"min_prob": fallback.min_prob, "label": fallback.label} if fallback is not None else None


def create_app(engines: dict | Callable[[], dict], settings: ServerSettings | None = None,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The app of a new Service (`app.state.service`)."""
    return Service(engines, settings, on_load_error).app


async def wait_unless_disconnected(future: asyncio.Future, request: Request):
    """The future's result, or None as soon as the client disconnects."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({future, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return future.result() if future in done else None
