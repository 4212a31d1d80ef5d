"""slimroute.backends.remote against a live server, the task file, and `slimroute serve` end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from test_local import fail_on_commit
from test_server import LABELS, TEXTS, check_matches_offline, free_port, live_server, make_engine, wait_until
from tiny import tiny_model
from typer.testing import CliRunner

from slimroute import cli
from slimroute.backends.local import classify_rows
from slimroute.backends.remote import RemoteClassifier, ServerError, ServerUnreachable
from slimroute.engine.fast import Engine
from slimroute.io.rows import Row
from slimroute.server import ServerSettings, create_app, load_task_set
from slimroute.task import Task


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def offline(tiny):
    engine = Engine(*tiny, Task.from_labels(LABELS))
    return dict(zip(TEXTS, engine.classify(TEXTS), strict=True))


def as_dicts(predictions):
    return [{"label": p.label, "logprobs": p.logprobs, "probs": p.probs, "truncated": p.truncated}
            for p in predictions]


def test_remote_classifier_matches_the_engine_in_order(tiny, offline):
    app = create_app({"default": make_engine(tiny)}, ServerSettings(max_texts=5))
    with live_server(app) as url, RemoteClassifier(url, chunk_size=64, concurrency=3) as clf:
        done = []
        predictions = clf.classify(TEXTS, progress=done.append)
        assert clf.labels() == tuple(LABELS.split(","))
    assert done == [5] * (len(TEXTS) // 5) + [len(TEXTS) % 5] * bool(len(TEXTS) % 5)  # capped by max_texts
    check_matches_offline(TEXTS, as_dicts(predictions), offline)


def test_classify_rows_through_the_server_isolates_bad_rows(tiny, offline):
    app = create_app({"default": make_engine(tiny)}, ServerSettings(max_text_chars=500))
    good = [t for t in TEXTS if len(t) < 500][:4]
    rows = [Row(0, "a", good[0], None, None), Row(1, "b", None, None, "row 1: text is missing"),
            Row(2, "c", good[1], None, None), Row(3, "d", "x" * 600, None, None),
            Row(4, "e", good[2], None, None), Row(5, "f", good[3], None, None)]
    with live_server(app) as url, RemoteClassifier(url, chunk_size=2) as clf:
        predictions = classify_rows(clf, rows)
    assert predictions[1].error == "row 1: text is missing"
    assert "limit is 500 characters" in predictions[3].error
    ok = [predictions[i] for i in (0, 2, 4, 5)]
    check_matches_offline(good, as_dicts(ok), offline)


def test_busy_server_is_retried_after_retry_after():
    answers = iter([
        httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}}),
        httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}}),
        httpx.Response(200, json={"results": [{"label": "a", "logprobs": {"a": -0.1, "b": -2.4}}]}),
    ])
    calls = []

    def handler(request):
        calls.append(request.url.path)
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"limits": {"max_texts": 10}, "default_task": "t", "tasks": []})
        return next(answers)

    client = httpx.Client(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler))
    clf = RemoteClassifier("http://127.0.0.1:1", task_name="t", client=client)
    [prediction] = clf.classify(["hello"])
    assert prediction.label == "a" and prediction.logprobs == {"a": -0.1, "b": -2.4}
    assert calls.count("/v1/tasks/t/classify") == 3
    clf.max_busy_retries = 0
    answers = iter([httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})])
    with pytest.raises(ServerError, match="503: busy"):
        clf.classify(["hello"])


def test_classify_with_server_writes_the_engines_answers(tiny, offline, tmp_path):
    texts = TEXTS[:10]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    with live_server(create_app({"default": make_engine(tiny)})) as url:
        result = CliRunner().invoke(cli.app, ["classify", str(src), "--out", str(out), "--server", url])
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["id"] for w in written] == [f"r{i}" for i in range(len(texts))]
    assert [w["label"] for w in written] == [offline[t].label for t in texts]


def test_classify_with_a_floored_server_writes_its_routes_and_the_models_choices(tiny, offline, tmp_path):
    from slimroute.config import EngineConfig

    texts = TEXTS[:6]
    chosen = sorted(offline[t].probs[offline[t].label] for t in texts)
    engine = Engine(*tiny, Task.from_labels(LABELS), EngineConfig(min_prob=(chosen[2] + chosen[3]) / 2))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.csv"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    with live_server(create_app({"default": engine})) as url:
        result = CliRunner().invoke(cli.app, ["classify", str(src), "--out", str(out), "--server", url])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0].startswith("id,label,model_label,p_billing")
    rows = [line.split(",") for line in lines[1:]]
    assert [r[2] for r in rows] == [offline[t].label for t in texts]
    assert sorted(r[1] == "unsure" for r in rows) == [False] * 3 + [True] * 3
    assert "fallback" in result.output and "3 rows" in result.output


def test_a_server_job_resumes_only_against_a_server_that_answers_as_before(tiny, tmp_path, monkeypatch):
    """A --server job records what decides the served answers (model, dtype, prompt, calibration, fallback floor):
    resumed against the same address restarted with a floor, it refuses and names the change; against the server as
    it was, it finishes with the bytes of an uninterrupted run."""
    from slimroute.config import EngineConfig

    src, out, whole = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS[:8])))
    port = free_port()

    def args(path, *more):
        return ["classify", str(src), "--out", str(path), "--server", f"http://127.0.0.1:{port}", "--window", "2",
                *more]

    with live_server(create_app({"default": make_engine(tiny)}), port=port):
        with monkeypatch.context() as patch:
            fail_on_commit(patch, 2, KeyboardInterrupt())
            assert CliRunner().invoke(cli.app, args(out)).exit_code == 130
    assert len(out.read_text().splitlines()) == 2
    floored = Engine(*tiny, Task.from_labels(LABELS, name="default"), EngineConfig(min_prob=0.9))
    with live_server(create_app({"default": floored}), port=port):
        result = CliRunner().invoke(cli.app, args(out, "--resume"))
    assert result.exit_code == 2 and "settings differ" in result.output and "served:" in result.output
    assert "'fallback': {'min_prob': 0.9" in " ".join(result.output.split())
    cut = Engine(*tiny, Task.from_labels(LABELS, name="default", truncate_tokens=4))
    with live_server(create_app({"default": cut}), port=port):
        assert RemoteClassifier(f"http://127.0.0.1:{port}").answer_settings()["truncate_tokens"] == 4
        result = CliRunner().invoke(cli.app, args(out, "--resume"))
    assert result.exit_code == 2 and "'truncate_tokens': 4" in " ".join(result.output.split())
    with live_server(create_app({"default": make_engine(tiny)}), port=port):
        assert "truncate_tokens" not in RemoteClassifier(f"http://127.0.0.1:{port}").answer_settings()
        result = CliRunner().invoke(cli.app, args(out, "--resume"))
        assert result.exit_code == 0, result.output
        assert CliRunner().invoke(cli.app, args(whole)).exit_code == 0
    assert out.read_bytes() == whole.read_bytes() and len(whole.read_text().splitlines()) == 8


def test_a_server_job_says_how_far_the_server_read_the_texts(tiny, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS[:4])))
    cut = Engine(*tiny, Task.from_labels(LABELS, name="default", truncate_tokens=4))
    with live_server(create_app({"default": cut})) as url:
        result = CliRunner().invoke(cli.app, ["classify", str(src), "--out", str(out), "--server", url])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "4 text(s) were longer than --truncate-tokens 4" in text and "(texts read up to 4 tokens)" in text
    assert all(json.loads(line)["truncated"] for line in out.read_text().splitlines())


def test_unreachable_server_is_a_usage_error():
    clf = RemoteClassifier(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(ServerUnreachable, match="no slimroute server answers"):
        clf.labels()
    assert isinstance(ServerUnreachable("x"), ValueError)


def test_classify_with_an_unreachable_server_exits_2_and_writes_nothing(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "r0", "text": "refund please"}) + "\n")
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(cli.app, ["classify", str(src), "--out", str(out), "--server", url])
    assert result.exit_code == 2 and "no slimroute server answers" in result.output
    assert not out.exists()


def test_task_file_with_several_tasks(tmp_path):
    path = tmp_path / "tasks.yaml"
    path.write_text(
        "default: urgency\ntasks:\n"
        "  tickets:\n    labels: [billing, technical]\n    examples:\n"
        "      - {text: charged twice, label: billing}\n"
        "  urgency:\n    labels: [low, high]\n    instructions: How urgent is it?\n    truncate_tokens: 64\n"
    )
    tasks = load_task_set(path)
    assert tasks.default == "urgency"
    assert (tasks.tasks["tickets"].truncate_tokens, tasks.tasks["urgency"].truncate_tokens) == (None, 64)
    from slimroute.server.tasks import with_accuracy_options

    cut = with_accuracy_options(tasks, truncate_tokens=16)  # serve --truncate-tokens: every task
    assert [task.truncate_tokens for task in cut.tasks.values()] == [16, 16]
    assert [task.truncate_tokens for task in with_accuracy_options(tasks).tasks.values()] == [None, 64]
    assert tasks.tasks["tickets"].examples[0].label == "billing"
    assert tasks.tasks["urgency"].instructions == "How urgent is it?"
    assert tasks.tasks["urgency"].name == "urgency"
    single = tmp_path / "support.json"
    single.write_text(json.dumps({"labels": ["a", "b"]}))
    assert list(load_task_set(single).tasks) == ["support"]


@pytest.mark.parametrize(("text", "message"), [
    ("tasks:\n  t: {labels: [a, a]}\n", "tasks.t: labels: label 'a' is given twice"),
    ("tasks:\n  bad name: {labels: [a, b]}\n", "task name 'bad name'"),
    ("default: x\ntasks:\n  t: {labels: [a, b]}\n", "default: task 'x' is not one of ['t']"),
    ("tasks: {}\n", "non-empty mapping"),
    ("tasks:\n  t: {labels: [a, b]}\nextra: 1\n", "unknown top-level field(s) ['extra']"),
])
def test_task_file_errors_name_the_field(tmp_path, text, message):
    path = tmp_path / "tasks.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_task_set(path)
    assert message in str(info.value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model, tokenizer = tiny
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_slimroute_serve_end_to_end(model_dir, offline):
    port = free_port()
    command = [sys.executable, "-m", "slimroute.cli", "serve", "--model", str(model_dir), "--labels", LABELS,
               "--port", str(port), "--threads", "1", "--max-wait-ms", "2", "--dtype", "float32"]
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url) or proc.poll() is not None, timeout=90)
        assert proc.poll() is None, "slimroute serve exited early"
        with RemoteClassifier(url, chunk_size=8) as clf:
            predictions = clf.classify(TEXTS)
        check_matches_offline(TEXTS, as_dicts(predictions), offline)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_calibrated_task_with_descriptions_over_http(tiny):
    from slimroute.accuracy.calibration import content_free_offsets
    from slimroute.engine.fast import Engine
    from slimroute.task import Task

    task = Task.from_dict({"labels": [{"name": "billing", "description": "money"}, "technical", "account"]})
    plain = Engine(*tiny, task)
    engine = plain.with_calibration(content_free_offsets(plain, task.labels))
    want = engine.classify(TEXTS[:5])
    with live_server(create_app({"default": engine})) as url, RemoteClassifier(url) as clf:
        got = clf.classify(TEXTS[:5])
        info = httpx.get(f"{url}/v1/info").json()["tasks"][0]
    assert [p.label for p in got] == [p.label for p in want]
    for g, w in zip(got, want, strict=True):
        assert g.calibrated_logprobs == pytest.approx(w.calibrated_logprobs, abs=1e-4)
        assert g.probs == pytest.approx(w.probs, abs=1e-4) and g.raw_probs == pytest.approx(w.raw_probs, abs=1e-4)
    assert info["descriptions"] == {"billing": "money"} and info["calibration"]["mode"] == "content-free"


@pytest.mark.parametrize("args, message", [
    (["--labels", LABELS, "--calibrate", "batch"], "on a server, --calibrate batch needs --calibration-data"),
    (["--task", "{tasks}", "--examples", "{examples}"], "need a single task; the task file has 2"),
    (["--labels", LABELS, "--examples", "{bad}"], "label 'sales' is not one of the task's labels"),
    (["--labels", LABELS, "--calibrate", "fitted", "--calibration-data", "{bad}"], "gold label 'sales'"),
])
def test_serve_refuses_bad_accuracy_settings_before_loading(tmp_path, args, message):
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("tasks:\n  a: {labels: [x, y]}\n  b: {labels: [x, z]}\n")
    examples = tmp_path / "examples.jsonl"
    examples.write_text(json.dumps({"text": "hi", "label": "x"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t, "label": label}) + "\n"
                           for t, label in [("a", "billing"), ("b", "technical"), ("c", "account"), ("d", "sales")]))
    args = [a.format(tasks=tasks, examples=examples, bad=bad) for a in args]
    result = CliRunner().invoke(cli.app, ["serve", "--model", str(tmp_path / "not-loaded"), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_slimroute_serve_with_examples_and_fitted_calibration(model_dir, tmp_path):
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in [
        ("refund my card", "billing"), ("app crash", "technical"), ("reset password", "account"),
        ("charged twice", "billing"), ("error 500", "technical"), ("cannot log in", "account")]))
    port = free_port()
    command = [sys.executable, "-m", "slimroute.cli", "serve", "--model", str(model_dir), "--labels", LABELS,
               "--port", str(port), "--threads", "1", "--examples", str(labelled), "--shots", "1",
               "--calibrate", "fitted", "--calibration-data", str(labelled), "--truncate-tokens", "5"]
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url) or proc.poll() is not None, timeout=90)
        assert proc.poll() is None, "slimroute serve exited early"
        info = httpx.get(f"{url}/v1/info").json()["tasks"][0]
        assert info["num_examples"] == 3 and info["calibration"]["mode"] == "fitted"
        assert info["calibration"]["num_inputs"] == 6 and info["truncate_tokens"] == 5
        result = httpx.post(f"{url}/v1/classify", json={"text": "refund please"}).json()["results"][0]
        assert set(result["calibrated_logprobs"]) == set(LABELS.split(","))
        results = httpx.post(f"{url}/v1/classify", json={"texts": ["hi", "refund " * 40]}).json()["results"]
        assert [r["truncated"] for r in results] == [False, True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
