"""`slimroute tune` and the head on the command line and the server: tune writes a head that classify,
verify and serve use; bad input and a head for another model exit 2 and write nothing."""

from __future__ import annotations

import csv
import json
import socket
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from rich.console import Console
from test_server import live_server
from tiny import tiny_model
from typer.testing import CliRunner

from slimroute import cli
from slimroute.accuracy.fit import Candidate, _logits, fit_head, fit_options, fit_temperature
from slimroute.accuracy.head import Head
from slimroute.accuracy.prompts import REPRESENTATION_TEMPLATE
from slimroute.accuracy.tune import TuneConfig, check_labelled, parse_layer
from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.runtime.load import load_model
from slimroute.server import BatchSettings, ServerSettings, TaskSet, create_app, serve

BANKING77 = Path(__file__).resolve().parents[1] / "data" / "banking77" / "train.csv"
INTENTS = ("card_arrival", "exchange_rate", "lost_or_stolen_card", "top_up_failed")


def banking_rows(per_intent: int, intents=INTENTS) -> list[dict]:
    """The first rows of a few BANKING77 intents (split=train), in file order."""
    counts = dict.fromkeys(intents, 0)
    rows = []
    with BANKING77.open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["split"] == "train" and counts.get(row["label"], per_intent) < per_intent:
                counts[row["label"]] += 1
                rows.append({"id": row["id"], "text": row["text"], "intent": row["label"]})
    return rows


def write_csv(path: Path, rows: list[dict], fields=("id", "text", "intent")) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture
def labelled(tmp_path) -> Path:
    return write_csv(tmp_path / "labelled.csv", banking_rows(6))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    """Same architecture and tokenizer as model_dir, other weights."""
    folder = tmp_path_factory.mktemp("tiny-qwen2-seed1")
    model, tokenizer = tiny_model("qwen2", seed=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def run(monkeypatch, model_dir):
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))

    def run(command, *args, model=None):
        extra = ["--model", str(model or model_dir), "--threads", "1"]
        result = CliRunner().invoke(cli.app, [command, *map(str, args), *extra])
        result.text = " ".join(result.output.split())
        return result

    return run


@pytest.fixture
def head_dir(tmp_path, labelled, run) -> Path:
    result = run("tune", labelled, "--label-column", "intent", "--out", tmp_path / "head", "--folds", "3",
                 "--dtype", "float32")
    assert result.exit_code == 0, result.output
    return tmp_path / "head"


def test_tune_writes_a_head_that_classify_and_verify_use(tmp_path, head_dir, labelled, run, model_dir):
    head = Head.load(head_dir)
    assert head.labels == tuple(sorted(INTENTS)) and head.features == "hidden"  # the representation prompt's
    assert head.task.template == REPRESENTATION_TEMPLATE and head.layers == ()
    meta = json.loads((head_dir / "head.json").read_text())
    assert meta["task"]["template"] == REPRESENTATION_TEMPLATE and meta["cv"]["prompt"] == "represent"
    assert meta["format"] == "slimroute-head" and meta["identity"]["hidden_size"] == 32
    assert set(meta["identity"]) == {"model_fingerprint", "tokenizer_fingerprint", "prompt_fingerprint",
                                     "hidden_size"}
    assert meta["task"]["labels"] == sorted(INTENTS) and meta["num_examples"] == 24
    assert meta["cv"]["folds"] == 3 and 0 <= meta["cv"]["accuracy"] <= 1 and meta["command"].startswith("slimroute")
    assert meta["model"] == model_dir and meta["slimroute"]

    out = tmp_path / "preds.jsonl"
    result = run("classify", labelled, "--head", head_dir, "--out", out, "--label-column", "intent")
    assert result.exit_code == 0, result.output
    first = json.loads(out.read_text().splitlines()[0])
    assert list(first) == ["id", "label", *(f"p_{label}" for label in sorted(INTENTS)), "truncated", "error"]
    assert first["label"] in INTENTS and sum(first[f"p_{label}"] for label in INTENTS) == pytest.approx(1)
    assert "accuracy" in result.text

    for extra in (["--batch-size", "1"], ["--batch-size", "7", "--no-prefix-cache"], ["--batch-size", "32"]):
        result = run("verify", labelled, "--head", head_dir, "--json", tmp_path / "v.json", "--dtype", "float32",
                     *extra)
        assert result.exit_code == 0, result.output
        record = json.loads((tmp_path / "v.json").read_text())
        assert record["agreement"] == 1.0 and record["max_abs_logprob_diff"] <= 1e-4


def test_a_head_tuned_in_float32_serves_int8(tmp_path, head_dir, labelled, run):
    """The model fingerprint is the checkpoint's, taken before int8 smoothing rewrites the norms."""
    from slimroute.runtime.int8 import int8_failure

    if int8_failure() is not None:
        pytest.skip(f"int8 does not run here: {int8_failure()}")
    assert json.loads((head_dir / "head.json").read_text())["dtype"] == "float32"
    result = run("verify", labelled, "--head", head_dir, "--dtype", "int8", "--json", tmp_path / "v.json")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "v.json").read_text())
    assert record["dtype"] == "int8" and record["agreement"] == 1.0 and record["max_abs_logprob_diff"] <= 1e-4


def test_tune_with_label_log_probs_as_features(tmp_path, labelled, run):
    """Features in order: the last state (32), the mean of decoder layer 1's output (32), the 4 label log-probs."""
    out = tmp_path / "head"
    result = run("tune", labelled, "--label-column", "intent", "--out", out, "--folds", "3", "--with-label-logprobs",
                 "--states", "last", "--classifier", "logistic", "--layer", "1")
    assert result.exit_code == 0, result.output
    head = Head.load(out)
    assert head.features == "hidden+label-logprobs" and head.weight.shape == (4, 32 + 32 + 4) and head.layers == (1,)
    assert json.loads((out / "head.json").read_text())["cv"]["classifier"] == "logistic"
    result = run("verify", labelled, "--head", out, "--limit", "6")  # the reference scores each label's tokens
    assert result.exit_code == 0 and "label agreement 100.00%" in result.text


def test_a_head_for_another_model_or_prompt_exits_2_and_writes_nothing(tmp_path, head_dir, labelled, run,
                                                                        other_model_dir):
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "preds.jsonl"
    result = run("classify", labelled, "--head", head_dir, "--out", out, model=other_model_dir)
    assert result.exit_code == 2 and "error: the head was tuned for another model" in result.text
    result = run("verify", labelled, "--head", head_dir, model=other_model_dir)
    assert result.exit_code == 2 and "tuned for another model" in result.text
    result = run("classify", labelled, "--head", head_dir, "--out", out, "--labels", ",".join(INTENTS[::-1]))
    assert result.exit_code == 2 and "tuned for another prompt" in result.text  # the labels' order differs
    result = run("classify", labelled, "--head", tmp_path / "nowhere", "--out", out)
    assert result.exit_code == 2 and "is not a head folder" in result.text
    result = run("classify", labelled, "--head", head_dir, "--out", out, "--server", "http://127.0.0.1:9")
    assert result.exit_code == 2 and "--head runs on the local engine" in result.text
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_calibrate_with_a_head_exits_2_and_writes_nothing(tmp_path, head_dir, labelled, run):
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "preds.jsonl"
    for command, extra in (("classify", ["--out", out]), ("verify", ["--json", tmp_path / "v.json"]),
                           ("serve", ["--port", "9"])):
        for mode, data in (("content-free", []), ("batch", []), ("fitted", ["--calibration-data", labelled])):
            result = run(command, *([labelled] if command != "serve" else []), "--head", head_dir, *extra,
                         "--calibrate", mode, *data, "--label-column", "intent")
            assert result.exit_code == 2, result.output
            assert f"error: --calibrate {mode} does not apply to a tuned head" in result.text
            assert len(result.output.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(ValueError, match="does not apply to a tuned head"):  # the Python API, before anything starts
        from slimroute.accuracy.calibration import CalibrationSettings

        head = Head.load(head_dir)
        serve(TaskSet({"default": head.task}, "default"), "unused", head=head, calibration=CalibrationSettings(
            "content-free"))


@pytest.mark.parametrize("rows, args, message", [
    ("few", ["--text-column", "body"], "text column 'body' is not in"),
    ("few", ["--label-column", "label"], "label column 'label' is not in"),
    ("one", [], "only one label ('card_arrival') in the rows; a head needs at least two"),
    ("few", ["--folds", "7"], "has 6 examples; tuning needs at least 7 per label (7-fold cross-validation)"),
    ("none", [], "no labelled rows: the input is empty"),
    ("empty file", [], "no labelled rows: the input is empty"),
    ("unlabelled", [], "has no label in column 'intent'"),
    ("few", ["--folds", "1"], "folds must be an integer >= 2"),
    ("few", ["--classifier", "svm"], "classifier must be one of auto, logistic, lda"),
    ("few", ["--states", "first"], "--states must be 'auto', 'last' or 'last+mean'"),
    ("few", ["--prompt", "chat"], "--prompt must be one of auto, task, represent or a template holding {text}"),
    ("few", ["--prompt", "{{text}} and {{text}}"], "template: must hold {text} exactly once"),
    ("few", ["--label-rows", "all"], "--label-rows must be one of auto, none, names"),
    ("few", ["--per-label", "0"], "--per-label must be a number of rows >= 1"),
    ("few", ["--sample-seed", "3"], "--sample-seed draws --per-label rows; give --per-label N too"),
    ("few", ["--per-label", "2"], "label 'card_arrival' has 2 examples; tuning needs at least 5"),
    ("few", ["--with-label-logprobs", "--labels", "card_arrival,exchange_rate"],
     "--with-label-logprobs needs the task's labels to be the head's labels"),
    ("few", ["--out", "{tmp}/labelled.csv"], "is a file; give a folder for the head"),
    ("few", ["--model", "{tmp}/no-such-model"], "unknown model"),
])
def test_tune_usage_errors_exit_2_and_write_nothing(tmp_path, run, rows, args, message):
    data = {"few": banking_rows(6), "one": banking_rows(6, INTENTS[:1]), "none": [], "empty file": None,
            "unlabelled": [*banking_rows(6), {"id": "x", "text": "where is my card", "intent": ""}]}[rows]
    src = write_csv(tmp_path / "labelled.csv", data) if data is not None else tmp_path / "labelled.csv"
    if data is None:
        src.write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "head")]
    if "--label-column" not in args:
        args += ["--label-column", "intent"]
    model = next((args[i + 1] for i, a in enumerate(args) if a == "--model"), None)
    if model:
        i = args.index("--model")
        del args[i: i + 2]
    result = run("tune", src, *args, model=model)
    assert result.exit_code == 2, result.output
    assert "error:" in result.text and message in result.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labelled.csv"]


def test_tune_keeps_an_existing_head_without_overwrite(tmp_path, head_dir, labelled, run):
    before = (head_dir / "head.safetensors").read_bytes()
    result = run("tune", labelled, "--label-column", "intent", "--out", head_dir, "--folds", "3")
    assert result.exit_code == 2 and "already holds a head; pass --overwrite" in result.text
    assert (head_dir / "head.safetensors").read_bytes() == before
    result = run("tune", labelled, "--label-column", "intent", "--out", head_dir, "--folds", "2", "--overwrite")
    assert result.exit_code == 0, result.output
    assert json.loads((head_dir / "head.json").read_text())["cv"]["folds"] == 2


def test_the_server_answers_with_the_head(head_dir, labelled, model_dir):
    head = Head.load(head_dir)
    loaded = load_model(model_dir, "float32", 1)
    engine = Engine.from_loaded(loaded, head.task, EngineConfig(), head)
    texts = [row["text"] for row in banking_rows(2)]
    offline = engine.classify(texts)
    settings = ServerSettings(batch=BatchSettings(max_wait_ms=0))
    with live_server(create_app({"default": engine}, settings)) as url:
        info = httpx.get(f"{url}/v1/info").json()
        results = httpx.post(f"{url}/v1/classify", json={"texts": texts}, timeout=30).json()["results"]
    assert info["tasks"][0]["labels"] == sorted(INTENTS)
    for item, want in zip(results, offline, strict=True):
        assert item["label"] == want.label and set(item["probs"]) == set(INTENTS)
        assert item["logprobs"] == pytest.approx(want.logprobs, abs=1e-4)


def test_serve_exits_2_for_a_head_of_another_model(head_dir, other_model_dir):
    head = Head.load(head_dir)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = serve(TaskSet({"default": head.task}, "default"), other_model_dir, threads=1, head=head, port=port,
                 log_level="critical")
    assert code == 2


def test_fit_head_matches_scikit_learn_and_handles_two_labels():
    import torch
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    for num_classes in (2, 5):
        y = np.repeat(np.arange(num_classes), 12)
        x = rng.normal(size=(len(y), 6)) + y[:, None] * 1.5
        for classifier in ("logistic", "lda"):
            tensors, report = fit_head(x, y, TuneConfig(folds=3, classifier=classifier))
            assert tensors["weight"].shape == (num_classes, 6) and report.accuracy > 0.8
            assert report.classifier == classifier and list(report.scores) == list(
                TuneConfig(classifier=classifier).candidates())
            head = Head(tuple(f"c{j}" for j in range(num_classes)), **tensors)
            z = (x - tensors["mean"].numpy()) / tensors["std"].numpy()
            model = (LogisticRegression(C=report.c, max_iter=2000) if classifier == "logistic"
                     else LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto"))
            logits = _logits(model.fit(z, y).decision_function(z)) / report.temperature  # temperature-scaled
            want = np.exp(logits - logits.max(axis=1, keepdims=True))
            want /= want.sum(axis=1, keepdims=True)
            got = head.logprobs(torch.tensor(x)).exp().numpy()
            np.testing.assert_allclose(got, want, atol=1e-6)
            assert (got.argmax(axis=1) == model.predict(z)).all()  # the temperature changes no decision


def test_temperature_makes_overconfident_logits_honest():
    """Logits 50x too sharp, with a fifth of the answers wrong: T brings their out-of-fold log-loss down."""
    from scipy.special import log_softmax

    rng = np.random.default_rng(2)
    y = rng.integers(0, 4, size=400)
    logits = rng.normal(size=(400, 4))
    right = rng.random(400) < 0.8
    logits[np.arange(400)[right], y[right]] += 3.0
    sharp = 50 * logits
    t = fit_temperature(sharp, y)
    nll = lambda v: -log_softmax(v, axis=1)[np.arange(400), y].mean()  # noqa: E731
    assert 20 < t < 200 and nll(sharp / t) < nll(sharp) / 10 and nll(sharp / t) <= nll(logits) + 1e-3


def test_auto_picks_the_best_cross_validated_candidate():
    """Few rows per label in many dimensions: shrinkage LDA beats the logistic regression in CV and is chosen."""
    rng = np.random.default_rng(1)
    num_classes, dims = 6, 40
    centres = rng.normal(size=(num_classes, dims)) * 0.6
    y = np.repeat(np.arange(num_classes), 8)
    x = centres[y] + rng.normal(size=(len(y), dims)) @ rng.normal(size=(dims, dims)) * 0.3
    _, report = fit_head(x, y, TuneConfig(folds=4))
    assert set(report.scores) == {"logistic C=0.01", "logistic C=0.03", "logistic C=0.1", "logistic C=0.3",
                                  "logistic C=1", "lda"}
    assert report.accuracy == max(report.scores.values()) and report.chosen in report.scores


def test_layer_options_and_their_names():
    assert TuneConfig().layer_options(24) == [(), (6,), (12,), (18,)]  # a quarter, half, three quarters up
    assert TuneConfig().layer_options(2) == [(), (1,)]  # hidden_states[2] of 2 layers is the final state itself
    assert TuneConfig(layer=None).layer_options(24) == [()] and TuneConfig(layer=3).layer_options(24) == [(3,)]
    with pytest.raises(ValueError, match="layer 24: the model has 24 decoder layers; give 1 to 23"):
        TuneConfig(layer=24).layer_options(24)
    with pytest.raises(ValueError, match="layer must be 'auto', None or a decoder layer number"):
        TuneConfig(layer=0)
    assert [parse_layer(t) for t in ("auto", "none", "7")] == ["auto", None, 7]
    for bad in ("0", "-1", "middle"):
        with pytest.raises(ValueError, match="--layer must be auto, none or a decoder layer number"):
            parse_layer(bad)


@pytest.mark.parametrize("informative", ["final", "layer 2"])
def test_the_layer_option_is_chosen_by_cross_validation(informative):
    """Features laid out as tune_head gets them: final states (H), the means of layers 1 and 2 (H each), then
    2 label log-probs. The class signal sits in one block; the LDA pass picks the option holding it (the
    final states alone when they carry it: ties go to fewer features), and the head reads exactly its columns."""
    rng = np.random.default_rng(3)
    hidden, num_classes = 12, 4
    y = np.repeat(np.arange(num_classes), 10)
    blocks = [rng.normal(size=(len(y), hidden)) for _ in range(3)] + [rng.normal(size=(len(y), 2))]
    signal = {"final": 0, "layer 2": 2}[informative]
    blocks[signal] += 3 * rng.normal(size=(num_classes, hidden))[y]
    features = np.concatenate(blocks, axis=1)
    config = TuneConfig(folds=4, with_mean=False, with_label_logprobs=True)
    none = np.zeros((0, features.shape[1]))

    def fit(x, options):
        return fit_options({"task": Candidate(x, none, config, options, hidden)}, y, np.zeros(0, int), ["none"])[1:]

    tensors, report = fit(features, [(), (1,), (2,)])
    assert set(report.option_scores) == {"task prompt", "task prompt + layer 1", "task prompt + layer 2"}
    assert report.layers == {"final": (), "layer 2": (2,)}[informative]
    width = hidden * (1 + len(report.layers)) + 2
    assert tensors["weight"].shape == (num_classes, width)
    picked = np.concatenate([blocks[0], *([blocks[2]] if report.layers else []), blocks[3]], axis=1)
    assert np.allclose(tensors["mean"].numpy(), picked.mean(axis=0))  # the head was fitted on those columns
    only_1 = np.concatenate([blocks[0], blocks[1], blocks[3]], axis=1)  # the features hold the options' layers only
    alone, single = fit(only_1, [(1,)])
    assert single.layers == (1,) and single.option_scores == {}  # one option: nothing to choose, no LDA pass
    assert alone["weight"].shape == (num_classes, 2 * hidden + 2)


def test_check_labelled_names_the_problem():
    assert check_labelled(["a", "b", "c", "d"], ["x", "y", "x", "y"], 2) == ["x", "y"]
    with pytest.raises(ValueError, match="got 2 texts but 1 labels"):
        check_labelled(["a", "b"], ["x"], 2)
    with pytest.raises(ValueError, match="row 1: the text is empty"):
        check_labelled(["a", " "], ["x", "y"], 2)
    with pytest.raises(ValueError, match="label 'y' has 1 example; tuning needs at least 2"):
        check_labelled(["a", "b", "c"], ["x", "x", "y"], 2)


DESCRIBED_TASK = """\
labels:
  - name: card_arrival
    description: when a new or replacement card will arrive in the post
  - name: exchange_rate
    description: the rate used to convert between currencies
  - name: lost_or_stolen_card
    description: a card that was lost or stolen and must be blocked
instructions: Route the banking question.
"""


def test_a_head_from_descriptions_scores_cosine_similarities(tiny_qwen, tmp_path):
    """From first principles: the mean states of the items, the descriptions and the content-free texts, the
    cosine similarity of item - centre and description - centre, times the scale, softmaxed."""
    from slimroute.accuracy.calibration import CONTENT_FREE_TEXTS
    from slimroute.accuracy.tune import DESCRIPTION_SCALE, description_head, description_task
    from slimroute.engine.reference import ReferenceClassifier
    from slimroute.task import Task

    model, tok = tiny_qwen
    (tmp_path / "task.yaml").write_text(DESCRIBED_TASK)
    described = Task.from_file(tmp_path / "task.yaml")
    task = description_task(described)
    assert task.labels == described.labels and task.descriptions == () and task.instructions == described.instructions
    engine = Engine(model, tok, task, EngineConfig(batch_size=4))
    head = description_head(engine, dict(described.descriptions))
    assert head.features == "mean" and head.normalize and head.labels == task.labels
    assert head.meta["from_descriptions"]["centre_texts"] == list(CONTENT_FREE_TEXTS)

    texts = [row["text"] for row in banking_rows(3)]
    mean = lambda items: engine.features(items, states="mean")  # noqa: E731  (N, H) float64
    centre = mean(list(CONTENT_FREE_TEXTS)).mean(dim=0)
    protos = mean([f"{label}: {described.description(label)}" for label in task.labels]) - centre
    items = mean(texts) - centre
    cosine = (items / items.norm(dim=1, keepdim=True)) @ (protos / protos.norm(dim=1, keepdim=True)).T  # (N, C)
    expected = torch.log_softmax(DESCRIPTION_SCALE * cosine, dim=1)
    preds = Engine(model, tok, task, EngineConfig(batch_size=7), head=head).classify(texts)
    got = torch.tensor([[p.logprobs[label] for label in task.labels] for p in preds], dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-9)
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    assert [p.label for p in ref] == [p.label for p in preds]
    assert max(abs(p.logprobs[k] - r.logprobs[k]) for p, r in zip(preds, ref, strict=True) for k in task.labels) <= 1e-4


def test_tune_from_descriptions_writes_a_head_that_classify_and_verify_use(tmp_path, labelled, run):
    task_file = tmp_path / "task.yaml"
    task_file.write_text(DESCRIBED_TASK)
    head_dir = tmp_path / "head"
    result = run("tune", "--from-descriptions", "--task", task_file, "--out", head_dir, "--dtype", "float32")
    assert result.exit_code == 0, result.output
    head = Head.load(head_dir)
    assert head.features == "mean" and head.normalize and head.meta["command"].startswith("slimroute")
    assert "cosine similarity" in result.text
    result = run("verify", labelled, "--head", head_dir, "--json", tmp_path / "v.json", "--dtype", "float32",
                 "--batch-size", "5")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "v.json").read_text())
    assert record["agreement"] == 1.0 and record["max_abs_logprob_diff"] <= 1e-4
    assert record["truncate_tokens"] is None


def test_a_head_tuned_with_truncate_tokens_reads_texts_as_it_was_tuned(tmp_path, labelled, run):
    """The cap is the head's task's: classify and verify with the head read the same first tokens by default;
    a description head reads its descriptions whole (the same head as without the cap, but for the cap)."""
    task_file = tmp_path / "task.yaml"
    task_file.write_text(DESCRIBED_TASK)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for out, extra in ((whole, []), (cut, ["--truncate-tokens", "6"])):
        result = run("tune", "--from-descriptions", "--task", task_file, "--out", out, "--dtype", "float32", *extra)
        assert result.exit_code == 0, result.output
    assert Head.load(cut).task.truncate_tokens == 6 and Head.load(whole).task.truncate_tokens is None
    assert torch.equal(Head.load(cut).weight, Head.load(whole).weight)
    result = run("verify", labelled, "--head", cut, "--json", tmp_path / "v.json", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "v.json").read_text())
    assert record["agreement"] == 1.0 and record["truncate_tokens"] == 6
    tuned = tmp_path / "tuned"
    result = run("tune", labelled, "--label-column", "intent", "--out", tuned, "--dtype", "float32",
                 "--truncate-tokens", "6", "--folds", "2")
    assert result.exit_code == 0, result.output
    assert Head.load(tuned).task.truncate_tokens == 6
    for head, flag, want in ((tuned, [], 6), (tuned, ["--truncate-tokens", "0"], None)):
        result = run("verify", labelled, "--head", head, "--json", tmp_path / "v.json", "--dtype", "float32", *flag)
        assert result.exit_code == 0, result.output
        assert json.loads((tmp_path / "v.json").read_text())["truncate_tokens"] == want


@pytest.mark.parametrize("task_text, args, message", [
    (DESCRIBED_TASK.replace("    description: the rate used to convert between currencies\n", ""), [],
     "needs a description for every label; 'exchange_rate' has none"),
    (DESCRIBED_TASK, ["{tmp}/labelled.csv"], "--from-descriptions takes no input file"),
    (None, [], "--from-descriptions needs --task"),
])
def test_tune_from_descriptions_errors_exit_2_and_write_nothing(tmp_path, labelled, run, task_text, args, message):
    task_args = []
    if task_text is not None:
        (tmp_path / "task.yaml").write_text(task_text)
        task_args = ["--task", tmp_path / "task.yaml"]
    result = run("tune", *[a.format(tmp=tmp_path) for a in args], "--from-descriptions", *task_args,
                 "--out", tmp_path / "head")
    assert result.exit_code == 2, result.output
    assert "error:" in result.text and message in result.text
    assert not (tmp_path / "head").exists()


def test_the_server_answers_with_a_head_from_descriptions(tmp_path, run, model_dir):
    """The head file carries `normalize`; the server's engine applies it as classify does."""
    (tmp_path / "task.yaml").write_text(DESCRIBED_TASK)
    result = run("tune", "--from-descriptions", "--task", tmp_path / "task.yaml", "--out", tmp_path / "head",
                 "--dtype", "float32")
    assert result.exit_code == 0, result.output
    head = Head.load(tmp_path / "head")
    engine = Engine.from_loaded(load_model(model_dir, "float32", 1), head.task, EngineConfig(), head)
    texts = [row["text"] for row in banking_rows(2)]
    offline = engine.classify(texts)
    with live_server(create_app({"default": engine}, ServerSettings(batch=BatchSettings(max_wait_ms=0)))) as url:
        results = httpx.post(f"{url}/v1/classify", json={"texts": texts}, timeout=30).json()["results"]
    assert head.normalize and [item["label"] for item in results] == [p.label for p in offline]
    for item, want in zip(results, offline, strict=True):
        assert item["logprobs"] == pytest.approx(want.logprobs, abs=1e-4)


def test_label_rows_join_every_training_fold_and_the_refit_but_are_never_scored():
    """Out-of-fold logits for the rows alone, each fold fitted on its training part plus every label row; the
    refit on the rows plus the label rows."""
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.model_selection import StratifiedKFold
    from sklearn.preprocessing import StandardScaler

    from slimroute.accuracy.fit import _cv_scores

    rng = np.random.default_rng(4)
    y = np.repeat(np.arange(3), 6)
    x = rng.normal(size=(len(y), 5)) + y[:, None]
    extra, extra_y = rng.normal(size=(3, 5)) + np.arange(3)[:, None] * 2, np.arange(3)
    config = TuneConfig(folds=3, classifier="lda")
    scores, logits = _cv_scores(x, y, config, extra, extra_y)
    want = np.zeros((len(y), 3))
    for train, test in StratifiedKFold(3, shuffle=True, random_state=0).split(x, y):
        fit_x, fit_y = np.concatenate([x[train], extra]), np.concatenate([y[train], extra_y])
        scaler = StandardScaler().fit(fit_x)
        lda = LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto").fit(scaler.transform(fit_x), fit_y)
        want[test] = lda.decision_function(scaler.transform(x[test]))
    assert logits["lda"].shape == (len(y), 3) and np.allclose(logits["lda"], want)
    assert scores["lda"] == (want.argmax(axis=1) == y).mean()
    tensors, _ = fit_head(x, y, config, extra, extra_y)
    assert np.allclose(tensors["mean"].numpy(), np.concatenate([x, extra]).mean(axis=0))
    without, _ = fit_head(x, y, config)
    assert np.allclose(without["mean"].numpy(), x.mean(axis=0))


def test_label_rows_are_chosen_by_cross_validation():
    """Rows too noisy to tell apart alone, label rows on the class centres: with them CV does better, so auto
    takes them; the options' LDA scores are reported."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 20))
    y = np.repeat(np.arange(4), 3)
    x = centres[y] + rng.normal(size=(len(y), 20)) * 1.5
    config = TuneConfig(folds=3, with_mean=False)
    found = {"represent": Candidate(x, centres, config, [()], 20)}
    prompt, _, report = fit_options(found, y, np.arange(4), ["none", "names"])
    assert prompt == "represent" and set(report.option_scores) == {"represent prompt",
                                                                    "represent prompt + label rows"}
    assert report.option_scores["represent prompt + label rows"] > report.option_scores["represent prompt"]
    assert report.label_rows == "names"


@pytest.mark.parametrize("seed", [None, 3])
def test_per_label_takes_n_rows_of_each_label_in_file_order(seed):
    from slimroute.accuracy.tune import per_label

    labels = ["a", "b", "a", "c", "a", "b", "a", "b", "a"]
    keep, short = per_label(labels, 3, seed)
    assert keep == sorted(keep) and short == {"c": 1}  # c has one row: taken, and said
    assert sorted(labels[i] for i in keep) == ["a", "a", "a", "b", "b", "b", "c"]
    if seed is None:
        assert keep == [0, 1, 2, 3, 4, 5, 7]
    else:
        assert per_label(labels, 3, seed) == (keep, short)  # seeded: the same draw again
        draws = {tuple(per_label(labels, 2, s)[0]) for s in range(10)}
        assert len(draws) > 1
    with pytest.raises(ValueError, match="--per-label must be a number of rows >= 1"):
        per_label(labels, 0)


def test_tune_prompt_task_per_label_and_label_rows_on_the_command_line(tmp_path, run, model_dir):
    """--prompt task: the chat prompt's head, as before; --prompt auto: both prompts scored, the summary says
    which was chosen; --per-label with --sample-seed tunes on a seeded draw; each head verifies."""
    rows = banking_rows(8)
    labelled = write_csv(tmp_path / "labelled.csv", rows)
    out = tmp_path / "task-head"
    result = run("tune", labelled, "--label-column", "intent", "--out", out, "--folds", "3", "--prompt", "task",
                 "--label-rows", "none", "--per-label", "6", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "tuning on the first 6 rows of each label: 24 of 32 rows" in result.text
    head = Head.load(out)
    assert head.features == "hidden+mean" and head.task.template is None and head.meta["num_examples"] == 24
    assert head.meta["cv"]["label_rows"] == "none" and "label_rows" not in head.meta

    auto = tmp_path / "auto-head"
    result = run("tune", labelled, "--label-column", "intent", "--out", auto, "--folds", "3", "--prompt", "auto",
                 "--per-label", "9", "--sample-seed", "1", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "a random 9 (seed 1) rows of each label: 32 of 32 rows" in result.text
    assert "4 label(s) have fewer than 9 rows, all of them taken" in result.text
    scores = Head.load(auto).meta["cv"]["option_scores"]
    assert {"task prompt", "represent prompt", "represent prompt + label rows"} <= set(scores)
    assert "options (LDA CV)" in result.text and "represent prompt + label rows" in result.text
    for folder in (out, auto):
        result = run("verify", labelled, "--head", folder, "--json", tmp_path / "v.json", "--dtype", "float32",
                     "--batch-size", "7")
        assert result.exit_code == 0, result.output
        record = json.loads((tmp_path / "v.json").read_text())
        assert record["agreement"] == 1.0 and record["max_abs_logprob_diff"] <= 1e-4
