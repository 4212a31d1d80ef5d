"""uvicorn's h11 protocol with a deadline for what the app never sees: a request's line and headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but nothing bounds a connection that sends
nothing at all, or half a request's headers, or trickles a body the app answered without reading: each holds a
connection (and a file descriptor) for as long as its client likes. `read_timeout_protocol(seconds)` gives a protocol
class for `uvicorn.Config(http=...)` that closes such a connection `seconds` after it opened or after the request's
first byte, answering 408 `request_timeout` first when part of a request line or headers had come. Once the headers
are complete the app has the request, and limits.BodyDeadline bounds its body.
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from slimroute.server.requestlog import new_request_id

log = logging.getLogger(__name__)


def read_timeout_protocol(seconds: float) -> type[H11Protocol]:
    if not seconds > 0:
        raise ValueError(f"the read timeout must be > 0 seconds, got {seconds!r}")
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout_s": float(seconds)})


class ReadTimeoutProtocol(H11Protocol):
    read_timeout_s = 30.0
    _deadline = None  # an asyncio.TimerHandle while the connection waits for request bytes the app does not have

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first byte of the next request (or of a body nobody reads)
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are complete: the app has the request

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a request line or headers
            rid = new_request_id()
            message = (f"the request line and headers did not arrive within {self.read_timeout_s:g} s; send them "
                       f"whole and without pauses")
            log.info("408 request_timeout request=%s (headers incomplete)", rid)
            body = json.dumps({"error": {"type": "request_timeout", "message": message, "field": "headers",
                                         "request_id": rid}}).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\nx-request-id: %s\r\n\r\n%s"
                                 % (len(body), rid.encode(), body))
        self.transport.close()
