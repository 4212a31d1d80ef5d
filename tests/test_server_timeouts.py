"""Read timeouts (#33): a request whose headers or body do not arrive within `read_timeout_s` is answered 408 where a
status can still be sent, and its connection is closed; tested with raw sockets and a 0.5 s timeout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_server import live_server, make_engine, metric_samples
from tiny import tiny_model

from slimroute.server import ApiKeys, ServerSettings, create_app, read_timeout_protocol

TIMEOUT = 0.5
KEY = "sk-timeout-0123456789"


@pytest.fixture(scope="module")
def server():
    app = create_app({"default": make_engine(tiny_model("qwen2"))},
                     ServerSettings(read_timeout_s=TIMEOUT, api_keys=ApiKeys([KEY])))
    with live_server(app, http=read_timeout_protocol(TIMEOUT)) as url:
        host, port = url.removeprefix("http://").split(":")
        yield url, (host, int(port))


def read_until_closed(sock: socket.socket, limit: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds from now)."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit)
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split()[1]), json.loads(body)["error"]


HEAD = (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        + KEY.encode() + b"\r\n")


def test_half_a_body_is_408_and_closed(server):
    url, address = server
    body = b'{"text": "refund please"}'
    before = metric_samples(url)
    with socket.create_connection(address) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        answer, waited = read_until_closed(sock)
    status, error = status_and_error(answer)
    assert status == 408 and error["type"] == "request_timeout" and error["field"] == "body"
    assert TIMEOUT * 0.8 < waited < TIMEOUT + 2
    key = ("slimroute_requests_total", (("status", "408"), ("task", "default")))
    assert metric_samples(url)[key] - before.get(key, 0) == 1


def test_a_body_trickled_past_the_deadline_is_408(server):
    _, address = server
    body = b'{"text": "refund please, I was charged twice"}'
    with socket.create_connection(address) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
        for k in range(len(body)):  # one byte every 0.1 s: each arrives in time, the whole does not
            try:
                sock.sendall(body[k : k + 1])
            except OSError:  # closed by the server
                break
            time.sleep(0.1)
        answer, _ = read_until_closed(sock)
    assert status_and_error(answer)[0] == 408


def test_half_the_headers_are_408_and_closed(server):
    _, address = server
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Ty")
        answer, waited = read_until_closed(sock)
    status, error = status_and_error(answer)
    assert status == 408 and error["field"] == "headers" and len(error["request_id"]) == 16
    assert TIMEOUT * 0.8 < waited < TIMEOUT + 2


def test_a_connection_that_sends_nothing_is_closed(server):
    _, address = server
    with socket.create_connection(address) as sock:
        answer, waited = read_until_closed(sock)
    assert answer == b"" and waited < TIMEOUT + 2


def test_a_refused_request_whose_body_never_ends_is_closed(server):
    """Answered 401 before its body was read; the body then trickles on: the connection is closed all the same."""
    _, address = server
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        start = time.monotonic()
        for _ in range(40):  # keeps sending for up to 4 s
            try:
                sock.sendall(b" ")
            except OSError:
                break
            time.sleep(0.1)
        answer, _ = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - start < TIMEOUT + 2


def test_prompt_clients_are_untouched_and_keep_their_connection(server):
    url, _ = server
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as client:
        first = client.post("/v1/classify", json={"text": "refund please"})
        time.sleep(TIMEOUT * 1.5)  # idle between requests: the keep-alive timeout's business, not this one
        second = client.post("/v1/classify", json={"text": "the app crashes"})
    assert first.status_code == second.status_code == 200
