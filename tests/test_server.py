"""The HTTP service on a real uvicorn (127.0.0.1, a free port) with tiny-model engines.

Every answer is checked against the offline engine's answer for the same text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tiny import tiny_model

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.io.synth import synthetic_tickets
from slimroute.server import BatchSettings, ServerSettings, create_app
from slimroute.server.microbatch import MicroBatcher
from slimroute.task import Task

LABELS = "billing,technical,account"
TEXTS = [t["text"] for t in synthetic_tickets(40, 3)] + ["refund " * 300, "app crash " * 120, "hi"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def offline(tiny):
    """text -> the offline engine's Prediction."""
    engine = Engine(*tiny, Task.from_labels(LABELS))
    return dict(zip(TEXTS, engine.classify(TEXTS), strict=True))


def make_engine(tiny, labels=LABELS, name="default"):
    return Engine(*tiny, Task.from_labels(labels, name=name))


class Probe:
    """An engine wrapper: records calls, can hold the worker at a gate, sleep, or fail on a marker."""

    def __init__(self, engine, gate: threading.Event | None = None, delay: float = 0.0, fail_on=None):
        self.engine, self.gate, self.delay, self.fail_on = engine, gate, delay, fail_on
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.ran_on_event_loop = False

    def __getattr__(self, name):
        if name == "steps":  # the server then runs each call through classify(), where the probe sees it
            raise AttributeError(name)
        return getattr(self.engine, name)

    def classify(self, texts, progress=None, on_results=None):
        self.calls.append(list(texts))
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            self.ran_on_event_loop = True
        self.entered.set()
        if self.gate is not None and not self.gate.wait(20):
            raise TimeoutError("gate never opened")
        time.sleep(self.delay)
        if self.fail_on and any(self.fail_on in t for t in texts):
            raise RuntimeError("simulated engine failure")
        return self.engine.classify(texts, progress, on_results)


@contextlib.contextmanager
def live_server(app, port: int = 0, **config):
    """Serve app on 127.0.0.1 (port: a fixed one, e.g. to restart a server at the same address) while inside."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may rebind while the old one lingers
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", "lifespan": "on", **config}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


async def post_all(url: str, bodies: list, path: str = "/v1/classify") -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def check_matches_offline(texts, results, offline):
    assert len(results) == len(texts)
    for text, item in zip(texts, results, strict=True):
        want = offline[text]
        assert item["label"] == want.label
        assert item["logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
        assert sum(item["probs"].values()) == pytest.approx(1.0)
        assert item["truncated"] == want.truncated


def metric_samples(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_concurrent_clients_each_get_their_own_answers(tiny, offline):
    gate = threading.Event()
    probe = Probe(make_engine(tiny), gate=gate)
    settings = ServerSettings(batch=BatchSettings(max_batch_items=16, max_wait_ms=20))
    bodies = []  # singles, multi-text requests with ids, long tickets mixed in
    for i in range(24):
        if i % 3 == 0:
            bodies.append({"text": TEXTS[i], "id": f"s{i}"})
        else:
            chunk = [TEXTS[(i + k * 7) % len(TEXTS)] for k in range(1 + i % 4)]
            bodies.append({"texts": chunk, "ids": [f"r{i}-{k}" for k in range(len(chunk))]})
    with live_server(create_app({"default": probe}, settings)) as url:

        async def scenario():
            first = asyncio.ensure_future(post_all(url, [{"text": "hold the worker"}]))
            await asyncio.to_thread(probe.entered.wait, 10)
            rest = asyncio.ensure_future(post_all(url, bodies))
            await asyncio.sleep(0.3)  # everything queues behind the held batch
            gate.set()
            return await first, await rest

        _, responses = asyncio.run(scenario())
        samples = metric_samples(url)
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        data = response.json()
        texts = body.get("texts") or [body["text"]]
        ids = body.get("ids") or [body["id"]]
        check_matches_offline(texts, data["results"], offline)
        assert [r["id"] for r in data["results"]] == ids
    assert max(r.json()["timing"]["batch_requests"] for r in responses) > 1  # requests were batched together
    assert all(len(call) <= 16 for call in probe.calls)
    assert not probe.ran_on_event_loop
    assert samples[("slimroute_requests_total", (("status", "200"), ("task", "default")))] == 25
    num_items = 1 + sum(len(b.get("texts", [None])) for b in bodies)
    assert samples[("slimroute_items_total", (("task", "default"),))] == num_items
    assert samples[("slimroute_batch_items_count", (("task", "default"),))] == len(probe.calls)
    assert samples[("slimroute_request_latency_seconds_count", (("task", "default"),))] == 25
    assert 0 <= samples[("slimroute_padding_overhead", (("task", "default"),))] < 1
    assert samples[("slimroute_queue_depth", ())] == 0


def test_batches_keep_within_item_and_token_caps_and_split_requests_keep_their_order(tiny):
    gate = threading.Event()
    probe = Probe(make_engine(tiny), gate=gate)
    lengths = [len(ids) for ids in probe.prompt.item_ids_batch(TEXTS[:12])]
    budget = sum(sorted(lengths)[:4]) + max(lengths)
    batcher = MicroBatcher({"default": probe}, BatchSettings(max_batch_items=5, max_gather_tokens=budget,
                                                              max_wait_ms=50))
    requests = [TEXTS[i : i + 1 + i % 3] for i in range(0, 12, 2)] + [TEXTS[:12]]

    async def scenario():
        batcher.start()
        held = batcher.submit("default", ["hold"])
        await asyncio.to_thread(probe.entered.wait, 10)
        pendings = [batcher.submit("default", texts) for texts in requests]
        gate.set()
        await held.future
        return [await p.future for p in pendings]

    results = asyncio.run(scenario())
    batcher.close()
    for texts, result in zip(requests, results, strict=True):
        assert [p.label for p in result.predictions] == [p.label for p in probe.engine.classify(texts)]
    for call in probe.calls[1:]:
        call_lengths = [len(ids) for ids in probe.prompt.item_ids_batch(call)]
        assert len(call) <= 5 and (sum(call_lengths) <= budget or len(call) == 1)
    assert sum(len(call) for call in probe.calls[1:]) == sum(map(len, requests))  # every text run once
    assert len(probe.calls) > 1 + len(requests) // 2  # the 12-text request was split over several calls


def test_a_request_is_answered_when_its_texts_are_done_not_when_the_whole_call_is(tiny, offline):
    """A short ticket gathered with a long one gets its answer after its own engine batch, while the engine is
    still on the long one, so its client can send the next ticket into the next call."""
    engine = Engine(*tiny, Task.from_labels(LABELS), EngineConfig(batch_size=1))  # one text per engine batch
    long_text, short_text = max(TEXTS, key=len), min(TEXTS, key=len)
    release = threading.Event()

    class HoldAfterFirstBatch(Probe):
        def classify(self, texts, progress=None, on_results=None):
            def forward(done):
                on_results(done)
                if len(self.calls) == 2 and not release.is_set():  # the gathered call: hold after batch one
                    release.wait(20)
            return super().classify(texts, progress, forward)

    gate = threading.Event()
    probe = HoldAfterFirstBatch(engine, gate=gate)
    batcher = MicroBatcher({"default": probe}, BatchSettings(max_wait_ms=200))

    async def scenario():
        batcher.start()
        held = batcher.submit("default", ["hold the worker"])
        await asyncio.to_thread(probe.entered.wait, 10)
        long_req, short_req = batcher.submit("default", [long_text]), batcher.submit("default", [short_text])
        gate.set()
        await held.future
        short_result = await asyncio.wait_for(short_req.future, 20)
        still_running = not long_req.future.done()
        release.set()
        return short_result, await long_req.future, still_running

    short_result, long_result, still_running = asyncio.run(scenario())
    batcher.close()
    assert probe.calls[1] == [long_text, short_text]  # gathered into one engine call
    assert still_running  # the short one was answered while the long one was still in the engine
    assert short_result.predictions[0].label == offline[short_text].label
    assert long_result.predictions[0].logprobs == pytest.approx(offline[long_text].logprobs, abs=1e-4)


def test_several_named_tasks_in_one_process(tiny, offline):
    urgency = make_engine(tiny, "low,high", name="urgency")
    engines = {"tickets": make_engine(tiny, name="tickets"), "urgency": urgency}
    texts = TEXTS[:6]
    want = Engine(*tiny, Task.from_labels("low,high")).classify(texts)
    with live_server(create_app(engines, ServerSettings(default_task="tickets"))) as url:
        with httpx.Client(base_url=url) as client:
            default, named, missing = (
                client.post(path, json={"texts": texts})
                for path in ("/v1/classify", "/v1/tasks/urgency/classify", "/v1/tasks/nope/classify")
            )
            info = client.get("/v1/info").json()
    check_matches_offline(texts, default.json()["results"], offline)
    assert default.json()["task"] == "tickets"
    assert named.json()["task"] == "urgency"
    assert [r["label"] for r in named.json()["results"]] == [p.label for p in want]
    assert named.json()["results"][0]["logprobs"] == pytest.approx(want[0].logprobs, abs=1e-4)
    assert missing.status_code == 404
    assert "nope" in missing.json()["error"]["message"] and "urgency" in missing.json()["error"]["message"]
    assert {t["name"]: t["labels"] for t in info["tasks"]} == {"tickets": LABELS.split(","),
                                                               "urgency": ["low", "high"]}
    assert info["default_task"] == "tickets"


BAD_BODIES = [
    (b'{"texts": ["a", ', 422, "body", "malformed JSON"),
    (b"{}", 422, "body", "exactly one of 'text'"),
    (b'{"texts": "one string"}', 422, "texts", "valid list"),
    (b'{"texts": ["ok", 7]}', 422, "texts[1]", "valid string"),
    (b'{"texts": ["ok", "  "]}', 422, "texts[1]", "empty"),
    (b'{"texts": []}', 422, "texts", "at least 1"),
    (b'{"text": ""}', 422, "text", "empty"),
    (b'{"texts": ["a", "b"], "ids": [1]}', 422, "ids", "1 ids for 2 texts"),
    (b'{"text": "a", "colour": "red"}', 422, "colour", "Extra inputs"),
    (json.dumps({"texts": ["x"] * 9}).encode(), 422, "texts", "limit is 8"),  # limits the schema states: 422
    (json.dumps({"texts": ["ok", "y" * 301]}).encode(), 422, "texts[1]", "limit is 300 characters"),
    (json.dumps({"texts": ["ok", "zq" * 100]}).encode(), 413, "texts[1]", "200 tokens; the limit is 100"),
    (json.dumps({"text": "z" * 5000}).encode(), 413, "body", "limit of 4000 bytes"),
]


@pytest.fixture(scope="module")
def strict_server(tiny):
    settings = ServerSettings(batch=BatchSettings(max_text_tokens=100), max_texts=8, max_text_chars=300,
                              max_body_bytes=4000)
    with live_server(create_app({"default": make_engine(tiny)}, settings)) as url:
        yield url


@pytest.mark.parametrize(("body", "status", "field", "message"), BAD_BODIES)
def test_bad_input_names_the_field_and_the_limit(strict_server, body, status, field, message):
    response = httpx.post(f"{strict_server}/v1/classify", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field
    assert message in error["message"]


def test_a_task_that_reads_the_first_tokens_only_takes_texts_over_the_token_limit(tiny):
    """--max-text-tokens bounds the work a text asks for; a task reading no text further than the limit
    (truncate_tokens) answers a longer one, cut as the reference cuts it; a task reading further still refuses."""
    from slimroute.engine.reference import ReferenceClassifier

    settings = ServerSettings(batch=BatchSettings(max_text_tokens=100))
    long_text = "zq" * 100  # 200 tokens with the tiny tokenizer
    for cut, status in ((50, 200), (100, 200), (150, 413)):
        task = Task.from_labels(LABELS, name="default", truncate_tokens=cut)
        with live_server(create_app({"default": Engine(*tiny, task)}, settings)) as url:
            response = httpx.post(f"{url}/v1/classify", json={"texts": [long_text, "ok"]})
        assert response.status_code == status, (cut, response.text)
        if status == 200:
            got = response.json()["results"]
            want = ReferenceClassifier(*tiny, task).classify([long_text, "ok"])
            assert [r["truncated"] for r in got] == [True, False]
            for r, p in zip(got, want, strict=True):
                assert r["label"] == p.label and r["logprobs"] == pytest.approx(p.logprobs, abs=1e-4)


def test_chunked_body_over_the_limit_is_refused_while_streaming(strict_server):
    def chunks():
        yield b'{"text": "'
        for _ in range(10):
            yield b"w" * 1000
        yield b'"}'

    response = httpx.post(f"{strict_server}/v1/classify", content=chunks(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "4000 bytes" in response.json()["error"]["message"]
    assert httpx.post(f"{strict_server}/v1/classify", json={"text": "still serving"}).status_code == 200


def test_full_queue_answers_503_with_retry_after(tiny, offline):
    gate = threading.Event()
    probe = Probe(make_engine(tiny), gate=gate)
    settings = ServerSettings(batch=BatchSettings(max_queue_items=3, max_wait_ms=0))
    app = create_app({"default": probe}, settings)
    with live_server(app) as url:

        async def scenario():
            held = asyncio.ensure_future(post_all(url, [{"text": TEXTS[0]}]))
            await asyncio.to_thread(probe.entered.wait, 10)
            queued = asyncio.ensure_future(post_all(url, [{"texts": TEXTS[1:3]}, {"text": TEXTS[3]}]))
            await asyncio.to_thread(wait_until, lambda: app.state.service.batcher.num_queued == 3)
            refused = await post_all(url, [{"text": TEXTS[4]}])
            gate.set()
            return await held, await queued, refused[0]

        held, queued, refused = asyncio.run(scenario())
        samples = metric_samples(url)
    errors = samples[("slimroute_errors_total", (("kind", "queue_full"), ("task", "default")))]
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    assert "limit 3" in refused.json()["error"]["message"]
    assert errors == 1
    check_matches_offline(TEXTS[:1], held[0].json()["results"], offline)
    check_matches_offline(TEXTS[1:3], queued[0].json()["results"], offline)
    check_matches_offline(TEXTS[3:4], queued[1].json()["results"], offline)


def test_request_of_a_disconnected_client_is_dropped_from_the_queue(tiny):
    gate = threading.Event()
    probe = Probe(make_engine(tiny), gate=gate)
    app = create_app({"default": probe}, ServerSettings(batch=BatchSettings(max_wait_ms=0)))
    with live_server(app) as url:

        async def scenario():
            held = asyncio.ensure_future(post_all(url, [{"text": "hold the worker"}]))
            await asyncio.to_thread(probe.entered.wait, 10)
            async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
                    await client.post("/v1/classify", json={"text": "nobody waits for me"})
            await asyncio.to_thread(wait_until, lambda: app.state.service.batcher.num_queued == 0)
            gate.set()
            return (await held)[0], (await post_all(url, [{"text": "after"}]))[0]

        held, after = asyncio.run(scenario())
        dropped = metric_samples(url)[("slimroute_dropped_requests_total", (("task", "default"),))]
    assert held.status_code == 200 and after.status_code == 200
    assert dropped == 1
    assert all("nobody waits for me" not in call for call in probe.calls)


def test_an_engine_call_stops_when_every_request_in_it_has_gone(tiny, offline):
    """A client that leaves while its texts are in the engine frees the worker within one transformer layer:
    the call stops before its first engine batch is done, the model is left as it was, the next call is exact."""
    engine = Engine(*tiny, Task.from_labels(LABELS), EngineConfig(batch_size=1))  # one text per engine batch
    batches, gone, call_over = [], {}, threading.Event()

    class LeaveAtTheStart(Probe):
        def classify(self, texts, progress=None, on_results=None):
            if len(self.calls) == 0:
                batcher.drop(gone["pending"])  # as the app does when the client disconnects
            try:
                return super().classify(texts, progress, lambda done: (batches.append(done), on_results(done)))
            finally:
                call_over.set()

    probe = LeaveAtTheStart(engine)
    batcher = MicroBatcher({"default": probe}, BatchSettings(max_wait_ms=0))
    num_hooks = sum(len(layer._forward_pre_hooks) for layer in engine.model.model.layers)  # other apps' too

    async def scenario():
        batcher.start()
        gone["pending"] = batcher.submit("default", TEXTS[:4])
        await asyncio.to_thread(call_over.wait, 20)
        return await batcher.submit("default", [TEXTS[5]]).future

    after = asyncio.run(scenario())
    batcher.close()
    assert probe.calls[0] == TEXTS[:4] and len(batches) == 1  # the first call finished no engine batch
    assert not gone["pending"].future.done()
    assert after.predictions[0].logprobs == pytest.approx(offline[TEXTS[5]].logprobs, abs=1e-4)
    assert sum(len(layer._forward_pre_hooks) for layer in engine.model.model.layers) == num_hooks  # close() removed


def test_engine_failure_answers_500_and_the_rest_are_served(tiny, offline):
    gate = threading.Event()
    probe = Probe(make_engine(tiny), gate=gate, fail_on="POISON")
    app = create_app({"default": probe}, ServerSettings(batch=BatchSettings(max_wait_ms=20)))
    bodies = [{"texts": [TEXTS[0], "POISON ticket"]}, {"text": TEXTS[1]}, {"texts": TEXTS[2:5]}]
    with live_server(app) as url:

        async def scenario():
            held = asyncio.ensure_future(post_all(url, [{"text": TEXTS[5]}]))
            await asyncio.to_thread(probe.entered.wait, 10)
            batch = asyncio.ensure_future(post_all(url, bodies))
            await asyncio.sleep(0.3)
            gate.set()
            return await held, await batch, await post_all(url, [{"text": TEXTS[6]}])

        held, (poisoned, single, multi), after = asyncio.run(scenario())
        errors = metric_samples(url)[("slimroute_errors_total", (("kind", "engine"), ("task", "default")))]
    assert poisoned.status_code == 500
    assert poisoned.json()["error"]["type"] == "engine_error"
    assert "simulated engine failure" in poisoned.json()["error"]["message"]
    assert any("POISON ticket" in call and TEXTS[1] in call for call in probe.calls)  # they shared a batch
    check_matches_offline(TEXTS[1:2], single.json()["results"], offline)
    check_matches_offline(TEXTS[2:5], multi.json()["results"], offline)
    check_matches_offline(TEXTS[6:7], after[0].json()["results"], offline)
    assert errors >= 1


def test_health_answers_while_the_model_loads_and_ready_follows(tiny):
    loaded = threading.Event()

    def load():
        assert loaded.wait(20)
        return {"default": make_engine(tiny)}

    with live_server(create_app(load)) as url:
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        assert httpx.get(f"{url}/ready").status_code == 503
        early = httpx.post(f"{url}/v1/classify", json={"text": "hi"})
        assert early.status_code == 503 and early.headers["retry-after"] == "1"
        loaded.set()
        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200)
        assert httpx.post(f"{url}/v1/classify", json={"text": "hi"}).status_code == 200
        assert "/v1/classify" in httpx.get(f"{url}/openapi.json").json()["paths"]


def test_a_failed_load_is_reported(tiny):
    failures = []

    def load():
        raise OSError("weights are missing")

    with live_server(create_app(load, on_load_error=failures.append)) as url:
        wait_until(lambda: failures)
        ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 503
    assert ready.json()["status"] == "failed" and "weights are missing" in ready.json()["error"]
    assert "weights are missing" in failures[0]


SLOW_SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
import uvicorn
from test_server import LABELS, Probe
from tiny import tiny_model
from slimroute.engine.fast import Engine
from slimroute.server import BatchSettings, ServerSettings, create_app
from slimroute.task import Task

engine = Probe(Engine(*tiny_model("qwen2"), Task.from_labels(LABELS)), delay=0.5)
settings = ServerSettings(batch=BatchSettings(max_batch_items=2, max_wait_ms=0))
uvicorn.run(create_app({{"default": engine}}, settings), host="127.0.0.1", port={port}, log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_finishes_accepted_requests_and_stops_accepting(tmp_path, offline):
    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(SLOW_SERVER.format(tests=str(Path(__file__).parent), port=port))
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), timeout=60)

        async def scenario():
            sent = asyncio.ensure_future(post_all(url, [{"text": t} for t in TEXTS[:6]]))
            await asyncio.sleep(0.3)  # all six accepted; the first engine call (0.5 s) is running
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ConnectError):
                await post_all(url, [{"text": "too late"}])
            responses = await sent
            return responses, time.monotonic() - signalled

        responses, waited = asyncio.run(scenario())
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert waited > 0.5  # the answers came after the signal: in-flight work was finished
    for text, response in zip(TEXTS[:6], responses, strict=True):
        assert response.status_code == 200
        check_matches_offline([text], response.json()["results"], offline)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_served_floor_routes_low_probability_texts_and_says_so(tiny, offline):
    from slimroute.backends.remote import RemoteClassifier

    texts = TEXTS[:8]
    chosen = sorted(offline[t].probs[offline[t].label] for t in texts)
    floor = (chosen[3] + chosen[4]) / 2
    engine = Engine(*tiny, Task.from_labels(LABELS), EngineConfig(min_prob=floor, fallback_label="human"))
    with live_server(create_app({"default": engine}, ServerSettings())) as url:
        results = httpx.post(f"{url}/v1/classify", json={"texts": texts}).json()["results"]
        info = httpx.get(f"{url}/v1/info").json()
        with RemoteClassifier(url) as remote:
            assert (remote.fallback().min_prob, remote.fallback().label) == (floor, "human")
            via_client = remote.classify(texts)
    for text, item, pred in zip(texts, results, via_client, strict=True):
        want = offline[text]
        assert item["model_label"] == pred.model_label == want.label
        assert item["label"] == pred.label == (want.label if want.probs[want.label] >= floor else "human")
    assert sum(item["label"] == "human" for item in results) == 4
    assert info["tasks"][0]["fallback"] == {"min_prob": floor, "label": "human"}
