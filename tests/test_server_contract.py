"""The service keeps its contract (#33): every input gets the documented status in the error shape, counted in the
metrics with that status, one log line and no traceback; the OpenAPI schema says what the server does."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest
from test_server import LABELS, TEXTS, Probe, live_server, make_engine, metric_samples
from tiny import tiny_model

from slimroute.server import ApiKeys, ServerSettings, Service, create_app

KEY = "sk-contract-0123456789"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def probed(tiny):
    """(url, probe): a server whose engine records its calls."""
    probe = Probe(make_engine(tiny))
    app = create_app({"default": probe}, ServerSettings(max_texts=8, max_text_chars=300))
    with live_server(app, log_config=None) as url:
        yield url, probe


def requests_by_status(url: str, task: str = "default") -> dict[str, float]:
    return {dict(labels)["status"]: value for (name, labels), value in metric_samples(url).items()
            if name == "slimroute_requests_total" and dict(labels)["task"] == task}


def grew(before: dict, after: dict) -> dict[str, float]:
    return {status: after[status] - before.get(status, 0) for status in after if after[status] != before.get(status, 0)}


# -------------------------------------------------------------------------------- texts and ids the model cannot take

BAD_TEXTS = [  # (raw JSON body, field)
    (b'{"text": "charged twice \\udfff"}', "text"),
    (b'{"texts": ["fine", "half a pair \\ud83d here"]}', "texts[1]"),
    (b'{"text": "\\u200b"}', "text"),
    (b'{"text": "\\u0000"}', "text"),
    (b'{"texts": ["ok", " \\t\\n\\u00a0\\u2028 "]}', "texts[1]"),
    (b'{"text": "\\ufeff\\u200d\\u2060"}', "text"),
]


@pytest.mark.parametrize(("body", "field"), BAD_TEXTS)
def test_a_text_with_a_lone_surrogate_or_nothing_visible_is_422_naming_the_row(probed, body, field, caplog):
    url, probe = probed
    calls, before = len(probe.calls), requests_by_status(url)
    with caplog.at_level(logging.INFO), httpx.Client(base_url=url) as client:  # one keep-alive connection
        refused = client.post("/v1/classify", content=body, headers=JSON)
        after = client.post("/v1/classify", json={"text": "still serving"})
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == field
    assert ("surrogate" in error["message"]) == (b"\\ud" in body)
    assert "visible" in error["message"] or "surrogate" in error["message"]
    assert after.status_code == 200  # the connection survived
    assert len(probe.calls) == calls + 1  # only "still serving" reached the model
    assert grew(before, requests_by_status(url)) == {"422": 1, "200": 1}
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize("body", [
    b'{"text": "refund", "id": "r\\udfff"}',
    b'{"texts": ["refund", "crash"], "ids": ["a", "\\ud800"]}',
])
def test_an_id_with_a_lone_surrogate_is_422_before_the_model_runs(probed, body):
    url, probe = probed
    calls, before = len(probe.calls), requests_by_status(url)
    response = httpx.post(f"{url}/v1/classify", content=body, headers=JSON)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] in ("id", "ids[1]")
    assert len(probe.calls) == calls
    assert grew(before, requests_by_status(url)) == {"422": 1}


@pytest.mark.parametrize("body", [b'{"texts": ["refund", "crash"], "ids": [null, null]}',
                                  b'{"texts": ["refund"], "ids": [true]}', b'{"text": "refund", "id": 1.5}',
                                  b'{"text": "refund", "id": 9223372036854775808}'])
def test_an_id_that_is_null_in_a_list_or_not_an_integer_is_422(probed, body):
    """The schema's ids are strings or integers (a list item is never null; a one-text id may be null: no id)."""
    url, probe = probed
    calls = len(probe.calls)
    response = httpx.post(f"{url}/v1/classify", content=body, headers=JSON)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] in ("id", "ids[0]")
    assert len(probe.calls) == calls


def test_an_integral_number_is_an_integer_id_as_json_schema_says(probed):
    url, _ = probed
    many = httpx.post(f"{url}/v1/classify", content=b'{"texts": ["refund", "crash"], "ids": [9472.0, -3.0]}',
                      headers=JSON)
    one = httpx.post(f"{url}/v1/classify", content=b'{"text": "refund", "id": 4992940763.0}', headers=JSON)
    assert [r["id"] for r in many.json()["results"]] == [9472, -3]
    assert one.json()["results"][0]["id"] == 4992940763


def test_an_answer_that_cannot_be_encoded_is_a_500_and_counted_so(tiny):
    """Should an answer hold what JSON cannot carry (here a label with a lone surrogate, which no request can bring),
    the client gets 500 in the error shape, and the metrics count a 500, never a 200."""

    class BadLabel(Probe):
        def classify(self, texts, progress=None, on_results=None):
            predictions = super().classify(texts, progress, None)
            for i, p in enumerate(predictions):
                p.label = "bill\udfffing"
                if on_results:
                    on_results([(i, p)])
            return predictions

    with live_server(create_app({"default": BadLabel(make_engine(tiny))})) as url:
        with httpx.Client(base_url=url) as client:
            response = client.post("/v1/classify", json={"text": "refund"})
            after = client.get("/health")
        counted = requests_by_status(url)
    assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
    assert after.status_code == 200
    assert counted == {"500": 1}


UNREADABLE = [  # (body, content type, what the message says)
    (b'{"text": "caf\xe9"}', "application/json", "not UTF-8"),  # latin-1
    (b'{"text": "\xff\xfe"}', "application/json", "not UTF-8"),
    ('{"text": "refund"}'.encode("utf-16"), "application/json", "not UTF-8"),  # with its byte-order mark
    ('{"text": "refund"}'.encode("utf-16-le"), "application/json", "malformed JSON"),
    (b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", "nests"),
    (b'{"text": "a", "x": ' + b"[" * 50_000 + b"}", "application/json", "nests"),
    (b'{"text": "a", "id": ' + b"7" * 5000 + b"}", "application/json", "digits"),
    (b'{"text": "a", "id": NaN}', "application/json", "NaN"),
    (b'\xef\xbb\xbf{"text": "a"}', "application/json", "byte-order mark"),
]


@pytest.mark.parametrize(("body", "content_type", "message"), UNREADABLE)
def test_an_unreadable_body_is_422_invalid_request_and_counted(tiny, body, content_type, message, caplog):
    with live_server(create_app({"default": make_engine(tiny)}), log_config=None) as url:
        with caplog.at_level(logging.INFO):
            response = httpx.post(f"{url}/v1/classify", content=body, headers={"content-type": content_type})
        counted = requests_by_status(url)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == "body" and message in error["message"]
    assert counted == {"422": 1}
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("slimroute")]
    assert len(lines) == 1 and "422 invalid_request" in lines[0] and error["request_id"] in lines[0]
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "application/vnd.x+json", "application/x-www-form-urlencoded",
    "application/json; charset=utf-16", "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_utf8_json_by_its_media_type_is_415(probed, content_type):
    url, probe = probed
    calls, before = len(probe.calls), requests_by_status(url)
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{url}/v1/classify", content=b'{"text": "refund"}', headers=headers)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["type"] == "unsupported_media_type" and "application/json" in error["message"]
    assert len(probe.calls) == calls and grew(before, requests_by_status(url)) == {"415": 1}
    for fine in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        assert httpx.post(f"{url}/v1/classify", content=b'{"text": "refund"}',
                          headers={"content-type": fine}).status_code == 200


def test_a_trailing_slash_is_404_and_never_a_redirect_built_from_the_host_header(probed):
    url, _ = probed
    for path in ("/v1/classify/", "/v1/tasks/default/classify/", "/health/", "/v1/info/"):
        response = httpx.request("POST" if "classify" in path else "GET", f"{url}{path}", json={"text": "refund"},
                                 headers={"host": "evil.example"}, follow_redirects=False)
        assert response.status_code == 404, (path, response.status_code)
        assert "location" not in response.headers and "evil" not in response.text
        assert response.json()["error"]["type"] == "not_found"


def test_a_wrong_method_is_405_with_allow(probed):
    url, _ = probed
    response = httpx.get(f"{url}/v1/classify")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "method_not_allowed"


def test_every_answer_carries_a_request_id_and_a_client_id_is_kept_when_safe(probed):
    url, _ = probed
    plain = httpx.post(f"{url}/v1/classify", json={"text": "refund"})
    given = httpx.post(f"{url}/v1/classify", json={"texts": []}, headers={"x-request-id": "ticket-42.a_b"})
    unsafe = httpx.post(f"{url}/v1/classify", json={"texts": []}, headers={"x-request-id": "a b\tc"})
    assert len(plain.headers["x-request-id"]) == 16
    assert given.headers["x-request-id"] == given.json()["error"]["request_id"] == "ticket-42.a_b"
    assert unsafe.headers["x-request-id"] != "a b\tc" and len(unsafe.headers["x-request-id"]) == 16


def test_a_body_cut_short_by_its_content_length_is_422_on_a_raw_socket(probed):
    """A client bug (a Content-Length shorter than its JSON) gets its 422, not a dropped socket."""
    url, _ = probed
    host, port = url.removeprefix("http://").split(":")
    body = b'{"text": "refund please"}'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body) - 3, body[:-3]))
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < content_length(answer):
            answer += sock.recv(65536)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 422") and json.loads(payload)["error"]["field"] == "body"


def content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


# -------------------------------------------------------------------------------- the OpenAPI schema

def openapi(settings: ServerSettings | None = None) -> dict:
    return Service({}, settings).app.openapi()


def test_the_request_schema_admits_exactly_one_of_text_and_texts():
    schema = openapi(ServerSettings(max_texts=4, max_text_chars=300))
    body = schema["paths"]["/v1/classify"]["post"]["requestBody"]
    assert body["required"] is True and list(body["content"]) == ["application/json"]
    components = schema["components"]["schemas"]
    choice = components["ClassifyRequest"]["oneOf"]
    one, many = (components[ref["$ref"].rsplit("/", 1)[1]] for ref in choice)
    assert one["required"] == ["text"] and many["required"] == ["texts"]
    assert one["additionalProperties"] is False and many["additionalProperties"] is False
    texts = many["properties"]["texts"]
    assert (texts["minItems"], texts["maxItems"]) == (1, 4)
    text = one["properties"]["text"]
    assert text["maxLength"] == 300 and "pattern" in text
    lengths = [branch["properties"]["ids"].get("maxItems") for branch in many["anyOf"]]  # ids as many as texts
    assert lengths == [None, 1, 2, 3, 4]


@pytest.mark.parametrize("keyed", [False, True])
def test_every_route_declares_the_statuses_it_can_answer_with_the_error_model(keyed):
    settings = ServerSettings(api_keys=ApiKeys([KEY]) if keyed else None)
    schema = openapi(settings)
    paths = schema["paths"]
    classify = {"200", "408", "413", "415", "422", "500", "503"} | ({"401"} if keyed else set())
    assert set(paths["/v1/classify"]["post"]["responses"]) == classify
    assert set(paths["/v1/tasks/{name}/classify"]["post"]["responses"]) == classify | {"404"}
    assert set(paths["/v1/info"]["get"]["responses"]) == {"200"} | ({"401"} if keyed else set())
    assert set(paths["/ready"]["get"]["responses"]) == {"200", "503"}
    for status, answer in paths["/v1/classify"]["post"]["responses"].items():
        if status != "200":
            assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    secured = {path for path, item in paths.items() for op in item.values() if op.get("security")}
    if keyed:
        assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
        assert secured == {"/v1/classify", "/v1/tasks/{name}/classify", "/v1/info"}
        assert "WWW-Authenticate" in paths["/v1/info"]["get"]["responses"]["401"]["headers"]
    else:
        assert "securitySchemes" not in schema.get("components", {}) and not secured


def test_metrics_behind_the_key_are_declared_so():
    schema = openapi(ServerSettings(api_keys=ApiKeys([KEY]), metrics_need_key=True))
    assert schema["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
    assert "401" in schema["paths"]["/metrics"]["get"]["responses"]


def test_the_server_refuses_each_limit_the_schema_states(probed):
    url, _ = probed
    too_many = httpx.post(f"{url}/v1/classify", json={"texts": ["a"] * 9})
    too_long = httpx.post(f"{url}/v1/classify", json={"text": "y" * 301})
    assert (too_many.status_code, too_long.status_code) == (422, 422)
    assert too_many.json()["error"]["field"] == "texts" and "limit is 8" in too_many.json()["error"]["message"]
    assert too_long.json()["error"]["field"] == "text" and "limit is 300" in too_long.json()["error"]["message"]


def test_the_client_reads_the_error_shape(probed):
    from slimroute.backends.remote import RemoteClassifier, ServerError

    url, _ = probed
    with RemoteClassifier(url) as remote, pytest.raises(ServerError) as info:
        remote.classify_chunk(["fine", "\u200b"])
    assert info.value.status == 422 and info.value.field == "texts[1]" and "visible" in info.value.message
    with RemoteClassifier(url) as remote:
        assert [p.label for p in remote.classify(TEXTS[:3])] and remote.labels() == tuple(LABELS.split(","))
