"""The OpenAPI schema, made to say what the server does: each route's statuses with their bodies and headers, the
request shapes with this server's limits (schemas.request_models), `text/plain` for /metrics, and, with API keys, a
Bearer security scheme on the routes that need one. tests/test_server_schema.py runs schemathesis against it.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from slimroute.server.schemas import ErrorBody, Readiness, request_models

BEARER = "bearer"
WHEN = {  # status -> when a route answers it
    401: "No API key, a malformed Authorization header, or a key that is not valid.",
    404: "The task is not served.",
    408: "The body did not arrive whole within the read timeout (--read-timeout).",
    413: "A text over --max-text-tokens tokens, or a body over --max-body-bytes bytes (limits JSON Schema cannot "
         "state).",
    415: "The body is not declared 'Content-Type: application/json' (with no charset but UTF-8).",
    422: "The body is not UTF-8 JSON, or not one of the request shapes (see the request body's schema).",
    500: "The model failed on this request's texts (other requests are unaffected).",
    503: "The model is still loading, the queue is full, or the server is stopping; retry after Retry-After seconds.",
}
HEADERS = {
    401: {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying", "required": True,
                          "schema": {"type": "integer", "minimum": 1}}},
}
CLASSIFY_STATUSES = (408, 413, 415, 422, 500, 503)


def error_responses(*statuses: int) -> dict:
    """FastAPI `responses=` for these statuses: the error body, and the headers each always carries."""
    return {status: {"model": ErrorBody, "description": WHEN[status], **({"headers": HEADERS[status]}
                                                                         if status in HEADERS else {})}
            for status in statuses}


def readiness_responses() -> dict:
    return {503: {"model": Readiness, "description": "Loading, failed to load, or stopping."}}


def classify_extra(task_names: tuple[str, ...] | None, named: bool) -> dict:
    """The request body (and the task parameter) that the classify routes read by hand (body.py)."""
    extra = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ClassifyRequest"}}}}}
    if named:
        name = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
        if task_names:
            name = {"type": "string", "enum": list(task_names)}
        extra["parameters"] = [{"name": "name", "in": "path", "required": True, "schema": name,
                                "description": "A served task (any other name: 404)"}]
    return extra


def keyed(responses: dict, extra: dict | None = None) -> tuple[dict, dict]:
    """A route behind the API key: 401 among its answers, the Bearer scheme on it."""
    return {**responses, **error_responses(401)}, {**(extra or {}), "security": [{BEARER: []}]}


def build(app, max_texts: int, max_text_chars: int, with_keys: bool) -> dict:
    """The app's schema: FastAPI's, plus the request shapes and the security scheme."""
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                         routes=app.routes)
    one, many = request_models(max_texts, max_text_chars)
    components = schema.setdefault("components", {})
    ref = "#/components/schemas/{model}"
    components.setdefault("schemas", {}).update({
        "ClassifyRequest": {"oneOf": [{"$ref": "#/components/schemas/OneText"},
                                      {"$ref": "#/components/schemas/ManyTexts"}],
                            "description": "Exactly one of 'text' (OneText) and 'texts' (ManyTexts)."},
        "OneText": one.model_json_schema(ref_template=ref),
        "ManyTexts": many.model_json_schema(ref_template=ref),
    })
    if with_keys:
        components["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer"}}
    return schema
