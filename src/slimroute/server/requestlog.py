"""Every request: an id, its count and time (classify requests), one log line per refusal, and no answer outside the
error shape.

`RequestLog` wraps the whole app, the API-key check included. It gives each request an id (the client's
`X-Request-ID` when that is 1-64 letters, digits, `.`, `_` or `-`, else 16 random hex digits), sent back in the
`X-Request-ID` header and in every error body. It counts each classify request (POST /v1/classify and
/v1/tasks/{name}/classify) in `slimroute_requests_total` with the status it was answered with, whatever answered it,
and times it. Should anything escape the app before it answered (a bug of ours, such as an answer JSON cannot
encode), it logs the traceback once and answers 500 `internal_error` in the error shape, with `Connection: close`.

`refuse()` builds an error answer and logs it as one line: status, type, request id, method and path (quoted, so a
path cannot forge a log line). A client's bad input never logs a traceback.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable

from slimroute.server.schemas import error_response

log = logging.getLogger(__name__)
CLIENT_ID = re.compile(rb"^[A-Za-z0-9._-]{1,64}$")
SCOPE_KEY = "slimroute.request_id"


def request_id(scope: dict) -> str:
    return scope.get(SCOPE_KEY) or new_request_id()


def new_request_id() -> str:
    return secrets.token_hex(8)


def refuse(scope: dict, status: int, kind: str, message: str, field: str | None = None, headers=None,
           details: list[dict] | None = None):
    """The error answer (an ASGI app), logged as one line."""
    rid = request_id(scope)
    level = logging.ERROR if status >= 500 and status != 503 else logging.INFO
    log.log(level, "%d %s request=%s %s %r", status, kind, rid, scope.get("method", "-"), scope.get("path", "")[:200])
    return error_response(status, kind, message, field, rid, headers, details)


class RequestLog:
    """ASGI middleware (see the module docstring). `task_of(scope)` -> the task label of a classify request, else
    None; `count(task, status, seconds)` records one."""

    def __init__(self, app, task_of: Callable[[dict], str | None], count: Callable[[str, int, float], None]):
        self.app, self.task_of, self.count = app, task_of, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"x-request-id"]
        rid = given[0].decode("ascii") if len(given) == 1 and CLIENT_ID.match(given[0]) else new_request_id()
        scope[SCOPE_KEY] = rid
        task, start, status = self.task_of(scope), time.perf_counter(), None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("500 internal_error request=%s %s %r: an error of the server's own", rid, scope["method"],
                          scope["path"][:200])
            if status is None:  # nothing sent yet: the client still gets an answer in the error shape
                status = 500
                answer = error_response(500, "internal_error", "the server failed to answer this request; it is "
                                        "logged with this request id", None, rid, {"Connection": "close"})
                await answer(scope, receive, send_with_id)
        finally:
            if task is not None:
                self.count(task, status or 500, time.perf_counter() - start)
