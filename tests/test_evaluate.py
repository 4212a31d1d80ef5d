"""`slimroute eval`: predictions joined with gold labels by id; the CLI, its plot and its errors."""

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from slimroute import cli
from slimroute.data import InputError
from slimroute.evaluate import evaluate_files

GOLD = [{"id": "1", "text": "x", "label": "billing"}, {"id": "2", "text": "x", "label": "technical"},
        {"id": "3", "text": "x", "label": "account"}, {"id": "4", "text": "x", "label": "billing"},
        {"id": "5", "text": "x", "label": "billing"}]
PREDICTIONS = "\n".join([
    "id,label,p_billing,p_technical,p_account,truncated,error",
    "1,billing,0.8,0.1,0.1,false,", "2,billing,0.5,0.4,0.1,false,", "3,account,0.1,0.1,0.8,false,",
    "4,,,,,false,text is empty", "6,technical,0.1,0.8,0.1,false,"]) + "\n"


@pytest.fixture
def files(tmp_path):
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(json.dumps(r) + "\n" for r in GOLD))
    preds = tmp_path / "preds.csv"
    preds.write_text(PREDICTIONS)
    return preds, gold


def test_join_by_id_and_counts(files):
    evaluation = evaluate_files(*files)
    m = evaluation.metrics
    assert m.labels == ("billing", "technical", "account")  # from the p_<label> columns
    assert m.num_items == 3 and m.accuracy == pytest.approx(2 / 3)
    assert m.confusion == ((1, 0, 0), (1, 0, 0), (0, 0, 1))
    assert (evaluation.num_predictions, evaluation.num_errors, evaluation.num_missing,
            evaluation.num_without_gold) == (5, 1, 1, 1)


def test_errors(files, tmp_path):
    preds, gold = files
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "1", "label": "a"}\n{"id": "1", "label": "b"}\n')
    with pytest.raises(InputError, match="id '1' appears twice"):
        evaluate_files(preds, dup)
    with pytest.raises(InputError, match="has no column 'intent'"):
        evaluate_files(preds, gold, label_column="intent")
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "x9", "label": "billing"}\n')
    with pytest.raises(InputError, match="no id of"):
        evaluate_files(preds, other)


def run_eval(*args):
    result = CliRunner().invoke(cli.app, ["eval", *map(str, args)])
    result.text = " ".join(result.output.split())
    return result


def test_eval_cli_prints_writes_json_and_plot(files, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "console", Console(stderr=True, width=1000))
    preds, gold = files
    result = run_eval(preds, "--gold", gold, "--json", tmp_path / "m.json", "--plot", tmp_path / "cm.png")
    assert result.exit_code == 0, result.output
    for text in ("accuracy", "66.7% of 3", "macro-F1", "per label", "precision", "support",
                 "confusion (rows: gold, columns: predicted)", "errors (not scored) │ 1"):
        assert text in result.text, text
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["accuracy"] == pytest.approx(2 / 3) and record["errors"] == 1
    assert (tmp_path / "cm.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["{preds}", "--gold", "{tmp}/missing.jsonl"], "does not exist"),
    (["{preds}", "--gold", "{gold}", "--label-column", "intent"], "has no column 'intent'"),
    (["{preds}", "--gold", "{gold}", "--plot", "{tmp}/cm.jpg"], "must end in .png"),
])
def test_eval_bad_input_exits_2_and_writes_nothing(files, tmp_path, monkeypatch, args, message):
    monkeypatch.setattr(cli, "console", Console(stderr=True, width=1000))
    preds, gold = files
    args = [a.format(preds=preds, gold=gold, tmp=tmp_path) for a in args]
    result = run_eval(*args, "--json", tmp_path / "m.json")
    assert result.exit_code == 2 and message in result.text, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gold.jsonl", "preds.csv"]
