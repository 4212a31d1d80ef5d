"""The HTTP service: `create_app(engines, settings)` -> a FastAPI app.

`engines` maps task name -> Engine (or is a zero-argument callable that builds that mapping, run
in a thread at startup so /health answers while the model loads). Routes: POST /v1/classify,
POST /v1/tasks/{name}/classify, GET /v1/info, /health, /ready, /metrics. Every error answers
`{"error": {"type", "message", "field"}}`; compute never runs on the event loop. With API keys
(`settings.api_keys`), every path but /health, /ready (and /metrics unless `metrics_need_key`) needs
`Authorization: Bearer KEY` (auth.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from starlette.exceptions import HTTPException

from slimroute.server.auth import REASONS, ApiKeys, RequireApiKey
from slimroute.server.metrics import Metrics
from slimroute.server.microbatch import BatchSettings, EngineFailed, MicroBatcher, QueueFull, ShuttingDown, TextTooLong

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


# ------------------------------------------------------------------------------------- schemas


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("text is empty or only whitespace")
    return text


Text = Annotated[str, AfterValidator(_not_blank)]
ItemId = str | int


class ClassifyRequest(BaseModel):
    """Either `texts` (with optional `ids`, one per text) or a single `text` (with optional `id`)."""

    model_config = ConfigDict(extra="forbid")
    texts: list[Text] | None = Field(None, min_length=1, examples=[["I was charged twice", "App crashes"]])
    ids: list[ItemId] | None = None
    text: Text | None = Field(None, examples=["I was charged twice this month"])
    id: ItemId | None = None

    @field_validator("ids")
    @classmethod
    def _ids_match_texts(cls, ids, info: ValidationInfo):
        texts = info.data.get("texts")
        if ids is not None and texts is not None and len(ids) != len(texts):
            raise ValueError(f"got {len(ids)} ids for {len(texts)} texts; give one id per text")
        return ids

    @model_validator(mode="after")
    def _one_input(self):
        if (self.texts is None) == (self.text is None):
            raise ValueError("give exactly one of 'text' (one string) or 'texts' (a list of strings)")
        if self.texts is not None and self.id is not None:
            raise ValueError("'id' goes with 'text'; with 'texts' use 'ids'")
        if self.text is not None and self.ids is not None:
            raise ValueError("'ids' goes with 'texts'; with 'text' use 'id'")
        return self

    def items(self) -> tuple[list[str], list[ItemId | None]]:
        if self.text is not None:
            return [self.text], [self.id]
        return list(self.texts), list(self.ids) if self.ids is not None else [None] * len(self.texts)


class ItemResult(BaseModel):
    id: ItemId | None
    label: str  # the answer: the fallback label when the server's floor (--min-prob) routed the text there
    model_label: str  # the decision's own choice (equal to label unless routed)
    probs: dict[str, float]  # renormalised over the labels
    logprobs: dict[str, float]  # exact log-probability of each label's tokens
    calibrated_logprobs: dict[str, float] | None = None  # with calibration: logprobs minus offsets (probs use them)
    num_tokens: int
    truncated: bool


class Timing(BaseModel):
    queue_ms: float  # waiting for the worker and the batch to fill
    engine_ms: float  # the engine call that answered this request
    total_ms: float  # request received -> response built
    batch_items: int  # texts in that engine call, this request's included
    batch_requests: int


class ClassifyResponse(BaseModel):
    task: str
    results: list[ItemResult]
    timing: Timing


# ------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, field: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.kind, self.message, self.field, self.headers = status, kind, message, field, headers


def error_response(status: int, kind: str, message: str, field: str | None = None, headers=None, **extra):
    body = {"error": {"type": kind, "message": message, "field": field, **extra}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_name(loc) -> str:
    """('body', 'texts', 2) -> 'texts[2]'; ('body',) -> 'body'."""
    parts = [p for p in loc if p != "body"] if len(loc) > 1 else list(loc)
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def describe(error: dict) -> tuple[str, str]:
    if error.get("type") == "json_invalid":
        pos = error["loc"][1] if len(error["loc"]) > 1 else "?"
        return "body", f"malformed JSON at character {pos}: {error.get('ctx', {}).get('error', 'invalid')}"
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    return field_name(error.get("loc", ("body",))), message


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


# ------------------------------------------------------------------------------------- the app


class Service:
    """The app's engines and micro-batcher; `ready` once the engines exist and the worker runs."""

    def __init__(self, settings: ServerSettings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.engines: dict = {}
        self.default_task: str | None = None
        self.batcher: MicroBatcher | None = None
        self.load_error: str | None = None

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

    def info(self) -> dict:
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


def _fallback_info(fallback) -> dict | None:
    return {"min_prob": fallback.min_prob, "label": fallback.label} if fallback is not None else None


def create_app(
    engines: dict | Callable[[], dict], settings: ServerSettings | None = None,
    on_load_error: Callable[[str], None] | None = None,
) -> FastAPI:
    """`on_load_error(message)` is called (from the event loop) when a loader callable fails."""
    settings = settings or ServerSettings()
    metrics = Metrics()
    service = Service(settings, metrics)

    def loaded(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and on_load_error is not None:
            on_load_error(service.load_error or repr(task.exception()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = None
        if callable(engines):
            loading = asyncio.create_task(asyncio.to_thread(service.start, engines))
            loading.add_done_callback(loaded)
        else:
            service.start(engines)
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                await asyncio.wait({loading})
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="slimroute", summary="A small LM as an exact classifier, over HTTP.",
                  lifespan=lifespan)
    app.state.service, app.state.metrics = service, metrics
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    def task_label(request: Request) -> str:
        name = request.path_params.get("name", service.default_task)
        return name if name in service.engines else "unknown"

    def unauthorized(scope: dict, reason: str) -> Response:
        metrics.unauthorized.labels(reason=reason).inc()
        if (match := CLASSIFY_PATH.match(scope["path"])) is not None:  # counted with the classify requests too
            name = match.group(1) or service.default_task
            metrics.requests.labels(task=name if name in service.engines else "unknown", status="401").inc()
        return error_response(401, "unauthorized", REASONS[reason], headers={"WWW-Authenticate": "Bearer"})

    if settings.api_keys is not None:  # added last, so it runs first: before the body is read
        open_paths = {"/health", "/ready"} | (set() if settings.metrics_need_key else {"/metrics"})
        app.add_middleware(RequireApiKey, keys=settings.api_keys, open_paths=open_paths, refuse=unauthorized)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.kind, exc.message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        details = [dict(zip(("field", "message"), describe(e), strict=True)) for e in exc.errors()]
        metrics.requests.labels(task=task_label(request), status="422").inc()
        first = details[0]
        return error_response(422, "invalid_request", f"{first['field']}: {first['message']}", first["field"],
                              details=details)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        too_large = exc.status_code == 413
        kind = "body_too_large" if too_large else "http_error"
        return error_response(exc.status_code, kind, str(exc.detail), "body" if too_large else None,
                              getattr(exc, "headers", None))

    @app.get("/health", summary="Liveness: the process answers")
    async def health():
        return {"status": "ok", "dtype": service.settings.dtype, "dtype_reason": service.settings.dtype_reason}

    @app.get("/ready", summary="Readiness: the model is loaded and the worker runs")
    async def ready():
        if service.ready:
            return {"status": "ready", "tasks": list(service.engines)}
        status = "failed" if service.load_error else ("stopping" if service.batcher else "loading")
        return JSONResponse({"status": status, "error": service.load_error}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_route():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/info", summary="Served tasks, their labels, and the request limits")
    async def info():
        return service.info()

    @app.post("/v1/classify", response_model=ClassifyResponse, summary="Classify with the default task")
    async def classify_default(body: ClassifyRequest, request: Request):
        return await classify(service.default_task, body, request)

    @app.post("/v1/tasks/{name}/classify", response_model=ClassifyResponse, summary="Classify with a task")
    async def classify_named(name: str, body: ClassifyRequest, request: Request):
        return await classify(name, body, request)

    async def classify(name: str | None, body: ClassifyRequest, request: Request):
        start = time.perf_counter()
        status = "500"
        try:
            response = await answer(name, body, request, start)
            status = str(getattr(response, "status_code", 200))
            return response
        except ApiError as exc:
            status = str(exc.status)
            raise
        finally:
            metrics.requests.labels(task=task_label(request), status=status).inc()
            metrics.latency.labels(task=task_label(request)).observe(time.perf_counter() - start)

    async def answer(name: str | None, body: ClassifyRequest, request: Request, start: float):
        if not service.ready:
            raise ApiError(503, "not_ready", "the model is not loaded yet" if not service.batcher
                           else "the server is shutting down", headers={"Retry-After": "1"})
        if name not in service.engines:
            raise ApiError(404, "unknown_task",
                           f"task {name!r} does not exist; served: {sorted(service.engines)}")
        texts, ids = body.items()
        if len(texts) > settings.max_texts:
            raise ApiError(413, "too_many_texts", f"the request has {len(texts)} texts; the limit is "
                           f"{settings.max_texts} per request", "texts")
        for i, text in enumerate(texts):
            if len(text) > settings.max_text_chars:
                raise ApiError(413, "text_too_long", f"texts[{i}] has {len(text)} characters; the limit is "
                               f"{settings.max_text_chars} characters per text", f"texts[{i}]")
        batcher = service.batcher
        try:
            pending = batcher.submit(name, texts)
        except QueueFull as exc:
            metrics.errors.labels(task=name, kind="queue_full").inc()
            retry = {"Retry-After": str(exc.retry_after_s)}
            raise ApiError(503, "overloaded", str(exc), headers=retry) from exc
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
                    metrics.dropped.labels(task=name).inc()
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

    return app


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
