"""The HTTP service: a `Service` holds the engines and the micro-batcher, and its FastAPI app's routes call its methods.

`engines` maps task name -> Engine (or is a zero-argument callable that builds that mapping, run in a thread at
startup so /health answers while the model loads). Routes: POST /v1/classify, POST /v1/tasks/{name}/classify,
GET /v1/info, /health, /ready, /metrics; a path with a trailing slash is a 404, never a redirect. Every error answers
`{"error": {"type", "message", "field", "request_id"}}` (schemas.py) with the status the OpenAPI schema declares
for it (openapi.py); compute never runs on the event loop. With API keys (`settings.api_keys`), every path but
/health, /ready (and /metrics unless `metrics_need_key`) needs `Authorization: Bearer KEY` (auth.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from slimroute.server import openapi
from slimroute.server.auth import REASONS, ApiKeys, RequireApiKey
from slimroute.server.body import check_media_type, parse_json
from slimroute.server.limits import BodyDeadline, BodyLimit
from slimroute.server.microbatch import BatchSettings, EngineFailed, MicroBatcher, QueueFull, ShuttingDown, TextTooLong
from slimroute.server.prometheus import Prometheus
from slimroute.server.requestlog import RequestLog, refuse
from slimroute.server.schemas import (
    ApiError,
    ClassifyResponse,
    Health,
    Info,
    ItemResult,
    OneText,
    Readiness,
    RequestInvalid,
    Timing,
    parse_request,
    request_models,
)

CLASSIFY_PATH = re.compile(r"^/v1/(?:tasks/([^/]+)/)?classify$")


@dataclass(frozen=True)
class ServerSettings:
    batch: BatchSettings = field(default_factory=BatchSettings)
    max_texts: int = 256  # texts per request
    max_text_chars: int = 20_000  # characters per text (the token limit is batch.max_text_tokens)
    max_body_bytes: int = 1 << 20
    read_timeout_s: float = 30.0  # a request's headers, and then its body, must arrive within this (408)
    default_task: str | None = None  # None: the first task
    task_names: tuple[str, ...] | None = None  # the tasks, for the schema (None: the engines' names, when known)
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
        if not isinstance(self.read_timeout_s, int | float) or not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be a number of seconds > 0, got {self.read_timeout_s!r}")
        if self.api_keys is not None and not isinstance(self.api_keys, ApiKeys):
            raise ValueError(f"api_keys must be a slimroute.server.auth.ApiKeys or None, "
                             f"got {type(self.api_keys).__name__}")
        if self.metrics_need_key and self.api_keys is None:
            raise ValueError("metrics_need_key is set but no API key is given")


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
        self.request_models = request_models(self.settings.max_texts, self.settings.max_text_chars)
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
        s = self.settings
        app = FastAPI(title="slimroute", summary="A small LM as an exact classifier, over HTTP.",
                      lifespan=self.lifespan, redirect_slashes=False)
        app.state.service, app.state.metrics = self, self.metrics
        app.add_middleware(BodyLimit, max_bytes=s.max_body_bytes)
        app.add_middleware(BodyDeadline, seconds=s.read_timeout_s)
        keyed = s.api_keys is not None
        if keyed:  # added after the body's guards, so it runs before them: before the body is read
            open_paths = {"/health", "/ready"} | (set() if s.metrics_need_key else {"/metrics"})
            app.add_middleware(RequireApiKey, keys=s.api_keys, open_paths=open_paths, refuse=self.unauthorized)
        app.add_middleware(RequestLog, task_of=self.task_label, count=self.count)  # outermost: sees every answer
        app.add_exception_handler(ApiError, self.on_api_error)
        app.add_exception_handler(HTTPException, self.on_http_error)

        def guarded(responses: dict, extra: dict | None = None, behind_key: bool = True) -> dict:
            if keyed and behind_key:
                responses, extra = openapi.keyed(responses, extra)
            return {"responses": responses, "openapi_extra": extra}

        names = s.task_names or (tuple(self._source) if isinstance(self._source, dict) else None)
        errors = openapi.error_responses(*openapi.CLASSIFY_STATUSES)
        app.get("/health", summary="Liveness: the process answers", response_model=Health)(self.health)
        app.get("/ready", summary="Readiness: the model is loaded and the worker runs", response_model=None,
                responses={200: {"model": Readiness}, **openapi.readiness_responses()})(self.readiness)
        app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
                **guarded({200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
                          behind_key=s.metrics_need_key))(self.prometheus)
        app.get("/v1/info", summary="Served tasks, their labels, and the request limits", response_model=Info,
                **guarded({}))(self.info)
        app.post("/v1/classify", summary="Classify with the default task", response_model=None,
                 **guarded({200: {"model": ClassifyResponse}, **errors},
                           openapi.classify_extra(names, named=False)))(self.classify_default)
        app.post("/v1/tasks/{name}/classify", summary="Classify with a task", response_model=None,
                 **guarded({200: {"model": ClassifyResponse}, **errors, **openapi.error_responses(404)},
                           openapi.classify_extra(names, named=True)))(self.classify_named)

        def schema() -> dict:
            if app.openapi_schema is None:
                app.openapi_schema = openapi.build(app, s.max_texts, s.max_text_chars, keyed)
            return app.openapi_schema

        app.openapi = schema
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
                  "max_queue_items": s.batch.max_queue_items, "read_timeout_s": s.read_timeout_s}
        return {"model": s.model_name, "dtype": s.dtype, "dtype_reason": s.dtype_reason, "ready": self.ready,
                "default_task": self.default_task, "tasks": tasks, "limits": limits}

    async def classify_default(self, request: Request):
        return await self.classify(self.default_task, request)

    async def classify_named(self, request: Request):
        return await self.classify(request.path_params["name"], request)

    async def classify(self, name: str | None, request: Request) -> Response:
        """The request read as the schema says (415, 413, 408, 422), answered, and rendered here, so that an answer
        JSON cannot carry is a 500, never a 200."""
        start = time.perf_counter()
        check_media_type(request.headers.get("content-type"))
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)  # the client left mid-body; nobody reads this
        try:
            parsed = parse_request(parse_json(body), self.request_models)
        except RequestInvalid as exc:
            details = [{"field": f, "message": m} for f, m in exc.problems]
            field_, message = exc.problems[0]
            raise ApiError(422, "invalid_request", f"{field_}: {message}", field_, details=details) from None
        texts, ids = parsed.items()
        response = await self.answer(name, texts, ids, request, start, single=isinstance(parsed, OneText))
        if isinstance(response, Response):
            return response
        return JSONResponse(response.model_dump(mode="json"))

    async def answer(self, name: str | None, texts: list[str], ids: list, request: Request, start: float,
                     single: bool = False):
        """The task's answers to the texts: checked, queued, awaited (or dropped if the client goes)."""
        self.check(name)
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
            where = "text" if single else f"texts[{exc.index}]"
            raise ApiError(413, "text_too_long", f"{where} has {exc.num_tokens} tokens; the limit is {exc.limit} "
                           f"tokens per text", where) from exc
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

    def check(self, name: str | None) -> None:
        """Refuse, as an ApiError, what the service cannot take: before it is ready, an unknown task."""
        if not self.ready:
            raise ApiError(503, "not_ready", "the model is not loaded yet" if not self.batcher
                           else "the server is shutting down", headers={"Retry-After": "1"})
        if name not in self.engines:
            raise ApiError(404, "unknown_task", f"task {name!r} does not exist; served: {sorted(self.engines)}")

    # ---------------------------------------------------------------- accounting and errors

    def task_label(self, scope: dict) -> str | None:
        """The task label a classify request is counted under ('unknown': not served), None for other requests."""
        match = CLASSIFY_PATH.match(scope["path"]) if scope["method"] == "POST" else None
        if match is None:
            return None
        name = match.group(1) or self.default_task
        return name if name in self.engines else "unknown"

    def count(self, task: str, status: int, seconds: float) -> None:
        self.metrics.requests.labels(task=task, status=str(status)).inc()
        self.metrics.latency.labels(task=task).observe(seconds)

    def unauthorized(self, scope: dict, reason: str):
        self.metrics.unauthorized.labels(reason=reason).inc()
        return refuse(scope, 401, "unauthorized", REASONS[reason], headers={"WWW-Authenticate": "Bearer"})

    async def on_api_error(self, request: Request, exc: ApiError):
        return refuse(request.scope, exc.status, exc.kind, exc.message, exc.field, exc.headers, exc.details)

    async def on_http_error(self, request: Request, exc: HTTPException):
        headers = getattr(exc, "headers", None)
        if exc.status_code == 404:
            return refuse(request.scope, 404, "not_found", "there is nothing at this path (the API is described at "
                          "/openapi.json and /docs)", None, headers)
        if exc.status_code == 405:
            allowed = (headers or {}).get("Allow", "")
            return refuse(request.scope, 405, "method_not_allowed", f"this path takes {allowed}", None, headers)
        return refuse(request.scope, exc.status_code, "http_error", str(exc.detail), None, headers)


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
