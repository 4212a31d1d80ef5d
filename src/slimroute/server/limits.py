"""What a request's body may cost, as ASGI middlewares: its size (`BodyLimit`, 413) and the time it takes to arrive
(`BodyDeadline`, 408). Both answer with `Connection: close`: the rest of such a body is never read.

The deadline runs from the moment the request's headers are complete to its body's last byte, so a client that sends
half a body holds its connection for `seconds` at most. (The headers have their deadline in protocol.py.)
"""

from __future__ import annotations

import asyncio

from slimroute.server.requestlog import refuse
from slimroute.server.schemas import ApiError

CLOSE = {"Connection": "close"}


class BodyLimit:
    """Answer 413 to a body over `max_bytes`, from Content-Length or while a chunked body streams in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than the limit of {self.max_bytes} bytes; send fewer or shorter texts"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            return await refuse(scope, 413, "body_too_large", message, "body", CLOSE)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.max_bytes:
                raise ApiError(413, "body_too_large", message, "body", CLOSE)
            return event

        await self.app(scope, limited_receive, send)


class BodyDeadline:
    """Answer 408 when the body is not complete within `seconds` of the headers (raised from `receive`, so the app's
    error handling answers it; once the body is in, `receive` waits as long as the app likes)."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, complete = loop.time() + self.seconds, False

        async def timed_receive():
            nonlocal complete
            if complete:
                return await receive()
            try:
                event = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise ApiError(408, "request_timeout", f"the request body did not arrive within {self.seconds:g} s; "
                               f"send it whole and without pauses", "body", CLOSE) from None
            complete = event["type"] != "http.request" or not event.get("more_body", False)
            return event

        await self.app(scope, timed_receive, send)
