"""API keys on the HTTP service (server/auth.py), the client and `classify --server` with keys, and overload."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest
import uvicorn
from test_server import LABELS, TEXTS, Probe, check_matches_offline, live_server, make_engine, metric_samples
from tiny import tiny_model
from typer.testing import CliRunner

from slimroute import cli
from slimroute.backends.remote import AccessDenied, RemoteClassifier
from slimroute.engine.fast import Engine
from slimroute.server import ApiKeys, BatchSettings, ServerSettings, create_app, prepare, serve
from slimroute.server.auth import gather_keys, is_loopback, read_key_file
from slimroute.task import Task

KEY, OTHER_KEY = "sk-test-0123456789abcdef", "sk-other-fedcba9876543210"
WRONG = "sk-test-0123456789abcdeX"  # one character off


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def offline(tiny):
    engine = Engine(*tiny, Task.from_labels(LABELS))
    return dict(zip(TEXTS, engine.classify(TEXTS), strict=True))


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv("SLIMROUTE_API_KEY", raising=False)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def keyed_settings(**kwargs) -> ServerSettings:
    return ServerSettings(api_keys=ApiKeys([KEY, OTHER_KEY]), **kwargs)


@pytest.mark.parametrize(("header", "reason"), [
    (None, "missing"), ("", "malformed"), ("Basic dXNlcjpwYXNz", "malformed"), ("Bearer", "malformed"),
    ("Bearer  ", "malformed"), (f"Bearer {KEY} extra", "malformed"), (f"Token {KEY}", "malformed"),
    (f"Bearer {WRONG}", "invalid"), (f"Bearer {KEY[:-1]}", "invalid"), (f"Bearer {KEY}x", "invalid"),
    (f"Bearer {KEY}", None), (f"bearer {OTHER_KEY}", None), (f"  Bearer   {KEY}  ", None),
])
def test_api_keys_refusal(header, reason):
    assert ApiKeys([KEY, OTHER_KEY]).refusal(header) == reason


def test_api_keys_hold_no_key_text():
    keys = ApiKeys([KEY])
    assert KEY not in repr(keys) and KEY not in repr(keyed_settings())
    assert KEY not in str(vars(keys)) and KEY.encode() not in str(vars(keys)).encode()


def test_keys_from_flags_file_and_env(tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text(f"# team keys\n\n{KEY}\n  {OTHER_KEY}  \n# {WRONG}\n")
    assert read_key_file(key_file) == [KEY, OTHER_KEY]
    assert gather_keys([KEY], None, {}) == (KEY,)
    assert gather_keys(None, key_file, {}) == (KEY, OTHER_KEY)
    assert gather_keys(None, None, {"SLIMROUTE_API_KEY": f"{KEY}, {OTHER_KEY},"}) == (KEY, OTHER_KEY)
    assert gather_keys([OTHER_KEY], None, {"SLIMROUTE_API_KEY": KEY}) == (OTHER_KEY,)  # flags win over env
    assert gather_keys(None, None, {}) == ()


@pytest.mark.parametrize(("text", "message"), [
    ("# only a comment\n\n", "holds no key"),
    (f"{KEY}\nsk key with spaces\n", "line 2: an API key may only hold printable ASCII"),
    (f"{KEY}\nsk-caf\u00e9\n", "line 2: an API key may only hold printable ASCII"),
])
def test_bad_key_file_names_the_line_not_the_key(tmp_path, text, message):
    key_file = tmp_path / "keys.txt"
    key_file.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        read_key_file(key_file)
    assert "sk key" not in str(info.value) and "caf" not in str(info.value) and KEY not in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(tmp_path / "missing.txt")


def test_prepare_reads_keys_and_refuses_a_keyed_metrics_without_key(tmp_path):
    _, settings = prepare(labels=LABELS, api_keys=[KEY], metrics_need_key=True, environ={})
    assert settings.api_keys.accepts(KEY) and settings.metrics_need_key
    _, from_env = prepare(labels=LABELS, environ={"SLIMROUTE_API_KEY": OTHER_KEY})
    assert from_env.api_keys.accepts(OTHER_KEY) and not from_env.api_keys.accepts(KEY)
    assert prepare(labels=LABELS, environ={})[1].api_keys is None
    with pytest.raises(ValueError, match="--metrics-need-key needs an API key"):
        prepare(labels=LABELS, metrics_need_key=True, environ={})


@pytest.fixture(scope="module")
def keyed_server(tiny):
    app = create_app({"default": make_engine(tiny), "urgency": make_engine(tiny, "low,high", "urgency")},
                     keyed_settings(max_body_bytes=4000))
    with live_server(app) as url:
        yield url


@pytest.mark.parametrize("path", ["/v1/classify", "/v1/tasks/urgency/classify", "/v1/tasks/nope/classify"])
@pytest.mark.parametrize(("headers", "message"), [
    ({}, "needs an API key"), (bearer(WRONG), "not valid"), ({"Authorization": KEY}, "must be 'Bearer KEY'"),
])
def test_classify_without_a_valid_key_is_401(keyed_server, path, headers, message):
    response = httpx.post(f"{keyed_server}{path}", json={"text": "refund please"}, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "unauthorized" and message in error["message"] and error["field"] is None
    assert KEY not in response.text and WRONG not in response.text


def test_the_key_is_checked_before_the_body_is_read(keyed_server):
    with httpx.Client(base_url=keyed_server) as client:  # one keep-alive connection throughout
        malformed = client.post("/v1/classify", content=b'{"texts": [', headers={"content-type": "application/json"})
        too_big = client.post("/v1/classify", json={"text": "x" * 5000}, headers=bearer(WRONG))
        info = client.get("/v1/info")
        ok = client.post("/v1/classify", json={"text": "refund please"}, headers=bearer(KEY))
    assert (malformed.status_code, too_big.status_code, info.status_code) == (401, 401, 401)
    assert ok.status_code == 200


def test_right_key_is_served_and_open_paths_stay_open(keyed_server, offline):
    texts = TEXTS[:5]
    with httpx.Client(base_url=keyed_server) as client:
        first = client.post("/v1/classify", json={"texts": texts}, headers=bearer(KEY))
        second = client.post("/v1/tasks/urgency/classify", json={"text": texts[0]}, headers=bearer(OTHER_KEY))
        info = client.get("/v1/info", headers=bearer(KEY))
        opened = [client.get(path) for path in ("/health", "/ready", "/metrics", "/openapi.json")]
    assert first.status_code == 200 and second.status_code == 200 and info.status_code == 200
    check_matches_offline(texts, first.json()["results"], offline)
    assert [r.status_code for r in opened] == [200, 200, 200, 200]
    assert opened[0].json()["status"] == "ok"
    assert KEY not in json.dumps(info.json()) and KEY not in opened[0].text + opened[1].text


def test_401s_are_counted_and_no_key_reaches_the_metrics(keyed_server):
    before = metric_samples(keyed_server)
    httpx.post(f"{keyed_server}/v1/classify", json={"text": "a"}, headers=bearer(WRONG))
    httpx.post(f"{keyed_server}/v1/tasks/urgency/classify", json={"text": "a"})
    httpx.get(f"{keyed_server}/v1/info", headers={"Authorization": "Basic abc"})
    after = metric_samples(keyed_server)

    def grew(name, labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("slimroute_requests_total", {"task": "default", "status": "401"}) == 1
    assert grew("slimroute_requests_total", {"task": "urgency", "status": "401"}) == 1
    for reason in ("invalid", "missing", "malformed"):
        assert grew("slimroute_unauthorized_requests_total", {"reason": reason}) == 1
    text = httpx.get(f"{keyed_server}/metrics").text
    assert KEY not in text and WRONG not in text and OTHER_KEY not in text


def test_metrics_behind_the_key_when_asked(tiny):
    app = create_app({"default": make_engine(tiny)}, keyed_settings(metrics_need_key=True))
    with live_server(app) as url:
        refused = httpx.get(f"{url}/metrics")
        served = httpx.get(f"{url}/metrics", headers=bearer(KEY))
        health = httpx.get(f"{url}/health")
    assert refused.status_code == 401 and served.status_code == 200 and health.status_code == 200
    assert "slimroute_unauthorized_requests_total" in served.text


def test_no_key_in_the_logs(tiny, caplog, capsys):
    app = create_app({"default": make_engine(tiny)}, keyed_settings())
    with caplog.at_level(logging.DEBUG), live_server(app, log_level="debug", access_log=True, log_config=None) as url:
        with httpx.Client(base_url=url) as client:
            for headers in ({}, bearer(WRONG), {"Authorization": KEY}, bearer(KEY), bearer(OTHER_KEY)):
                client.post("/v1/classify", json={"text": "refund please"}, headers=headers)
                client.get("/v1/info", headers=headers)
    server_records = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert any("/v1/classify" in r.getMessage() for r in server_records)  # the access log was captured
    logged = "\n".join(r.getMessage() for r in server_records) + "".join(capsys.readouterr())
    for secret in (KEY, WRONG, OTHER_KEY):
        assert secret not in logged


def test_overload_answers_503_with_retry_after_then_serves_normally(tiny, offline):
    """The worker is held at a gate while the queue fills (max 4 texts): further requests get 503 + Retry-After,
    bad ones their 4xx, none a 500; once the gate opens every accepted request and every new one is answered."""
    gate = threading.Event()
    probe = Probe(make_engine(tiny), gate=gate)
    app = create_app({"default": probe}, keyed_settings(batch=BatchSettings(max_queue_items=4, max_wait_ms=0)))
    with live_server(app) as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(KEY)) as client:
                held = asyncio.ensure_future(client.post("/v1/classify", json={"text": TEXTS[0]}))
                await asyncio.to_thread(probe.entered.wait, 10)
                queued = [asyncio.ensure_future(client.post("/v1/classify", json={"texts": TEXTS[i : i + 2]}))
                          for i in (1, 3)]
                await asyncio.to_thread(lambda: _wait(lambda: app.state.service.batcher.num_queued == 4))
                refused = await asyncio.gather(*(client.post("/v1/classify", json={"text": t}) for t in TEXTS[5:25]))
                bad = await asyncio.gather(
                    client.post("/v1/classify", content=b"{not json", headers={"content-type": "application/json"}),
                    client.post("/v1/classify", json={"text": "x"}, headers=bearer(WRONG)),
                    client.post("/v1/classify", json={"texts": []}))
                gate.set()
                accepted = [await held, *[await q for q in queued]]
                after = []
                for start in (25, 29):  # 4 at a time: they fit in the queue
                    after += await asyncio.gather(*(client.post("/v1/classify", json={"text": t})
                                                    for t in TEXTS[start : start + 4]))
                return accepted, refused, bad, after

        accepted, refused, bad, after = asyncio.run(scenario())
        depth = metric_samples(url)[("slimroute_queue_depth", ())]
    assert all(r.status_code == 503 and int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.json()["error"]["type"] == "overloaded" for r in refused)
    assert [r.status_code for r in bad] == [422, 401, 422]
    check_matches_offline(TEXTS[:1], accepted[0].json()["results"], offline)
    check_matches_offline(TEXTS[1:3], accepted[1].json()["results"], offline)
    check_matches_offline(TEXTS[3:5], accepted[2].json()["results"], offline)
    assert [r.status_code for r in after] == [200] * 8
    check_matches_offline(TEXTS[25:33], [r.json()["results"][0] for r in after], offline)
    assert depth == 0


def _wait(predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_client_passes_the_key_from_the_argument_or_the_env(keyed_server, offline, monkeypatch):
    texts = TEXTS[:4]
    with RemoteClassifier(keyed_server, api_key=KEY) as clf:
        check_matches_offline(texts, [_as_dict(p) for p in clf.classify(texts)], offline)
    with RemoteClassifier(keyed_server) as clf, pytest.raises(AccessDenied, match="401.*needs an API key"):
        clf.classify(texts)
    monkeypatch.setenv("SLIMROUTE_API_KEY", f"{OTHER_KEY},{KEY}")
    with RemoteClassifier(keyed_server) as clf:
        assert clf.labels() == tuple(LABELS.split(","))
    with RemoteClassifier(keyed_server, api_key=WRONG) as clf, pytest.raises(AccessDenied, match="not valid"):
        clf.classify_chunk(texts)


def _as_dict(p):
    return {"label": p.label, "logprobs": p.logprobs, "probs": p.probs, "truncated": p.truncated}


def test_classify_server_with_a_wrong_key_exits_2_and_writes_nothing(keyed_server, offline, tmp_path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS[:4])))
    runner = CliRunner()
    base = ["classify", str(src), "--out", str(out), "--server", keyed_server]
    for extra in (["--api-key", WRONG], [], ["--api-key", WRONG, "--labels", LABELS]):
        result = runner.invoke(cli.app, base + extra)
        assert result.exit_code == 2, result.output
        assert "401" in result.output and "Traceback" not in result.output and WRONG not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert not out.exists() and not list(tmp_path.glob("out.jsonl*"))
    assert runner.invoke(cli.app, base + ["--api-key", KEY]).exit_code == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["label"] for w in written] == [offline[t].label for t in TEXTS[:4]]
    monkeypatch.setenv("SLIMROUTE_API_KEY", KEY)
    assert runner.invoke(cli.app, base + ["--overwrite"]).exit_code == 0


def test_serve_warns_when_listening_beyond_loopback_without_a_key(tiny, monkeypatch, caplog):
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    task_set, _ = prepare(labels=LABELS, environ={})
    for host, settings, warned in [("0.0.0.0", None, True), ("10.1.2.3", None, True), ("::", None, True),
                                   ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
                                   ("0.0.0.0", keyed_settings(), False)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slimroute.server"):
            assert serve(task_set, "unused-model", settings=settings, host=host) == 0
        lines = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
        assert len(lines) == warned, (host, lines)
        assert all("\n" not in line and host in line for line in lines)
    assert is_loopback("127.0.0.2") and is_loopback("[::1]") and not is_loopback("example.com")


def test_serve_flags_are_checked(monkeypatch):
    result = CliRunner().invoke(cli.app, ["serve", "--labels", LABELS, "--metrics-need-key"])
    assert result.exit_code == 2 and "needs an API key" in result.output
    result = CliRunner().invoke(cli.app, ["serve", "--labels", LABELS, "--api-key", "has space"])
    assert result.exit_code == 2 and "printable ASCII" in result.output and "has space" not in result.output
