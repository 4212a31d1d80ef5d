"""`slimroute eval`: predictions joined with gold labels by id; the CLI, its plot and its errors."""

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from slimroute import cli
from slimroute.accuracy.evaluate import evaluate_files
from slimroute.io.rows import InputError

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


def test_accuracy_of_the_truncated_rows_beside_the_rest(files, tmp_path):
    preds, gold = files
    assert evaluate_files(preds, gold).truncation() == {"rows": 0, "accuracy": None, "rest_rows": 3,
                                                        "rest_accuracy": pytest.approx(2 / 3)}
    cut = tmp_path / "cut.csv"  # rows 1 (right) and 2 (wrong) cut; row 4 is an error row, not scored
    cut.write_text(PREDICTIONS.replace("1,billing,0.8,0.1,0.1,false,", "1,billing,0.8,0.1,0.1,true,")
                   .replace("2,billing,0.5,0.4,0.1,false,", "2,billing,0.5,0.4,0.1,true,")
                   .replace("4,,,,,false,text is empty", "4,,,,,true,text is empty"))
    assert evaluate_files(cut, gold).truncation() == {"rows": 2, "accuracy": 0.5, "rest_rows": 1, "rest_accuracy": 1.0}
    as_jsonl = tmp_path / "cut.jsonl"  # JSONL and Parquet hold booleans
    as_jsonl.write_text("".join(json.dumps({"id": i, "label": label, "p_billing": 0.5, "truncated": t}) + "\n"
                                for i, label, t in [("1", "billing", True), ("2", "billing", False)]))
    assert evaluate_files(as_jsonl, gold).truncation()["rows"] == 1
    result = run_eval(cut, "--gold", gold, "--json", tmp_path / "m.json")
    assert result.exit_code == 0, result.output
    assert "truncated rows │ 2, 50.0% right (the other 1: 100.0%)" in result.text
    assert json.loads((tmp_path / "m.json").read_text())["truncated"]["rows"] == 2
    no_column = tmp_path / "plain.jsonl"
    no_column.write_text(json.dumps({"id": "1", "label": "billing", "p_billing": 0.9}) + "\n")
    assert evaluate_files(no_column, gold).truncation() is None


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
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
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
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
    preds, gold = files
    args = [a.format(preds=preds, gold=gold, tmp=tmp_path) for a in args]
    result = run_eval(*args, "--json", tmp_path / "m.json")
    assert result.exit_code == 2 and message in result.text, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gold.jsonl", "preds.csv"]


FLOORED = "\n".join([
    "id,label,model_label,p_billing,p_technical,p_account,truncated,error",
    "1,billing,billing,0.8,0.1,0.1,false,", "2,human,billing,0.5,0.4,0.1,false,",
    "3,account,account,0.1,0.1,0.8,false,", "4,human,technical,0.3,0.4,0.3,false,",
    "5,billing,billing,0.7,0.2,0.1,false,"]) + "\n"


def test_a_file_written_with_a_floor_and_the_floors_table(files, tmp_path, monkeypatch):
    _, gold = files
    preds = tmp_path / "floored.csv"
    preds.write_text(FLOORED)
    evaluation = evaluate_files(preds, gold)
    assert (evaluation.fallback_label, evaluation.num_fallback) == ("human", 2)
    assert evaluation.metrics.accuracy == pytest.approx(3 / 5)  # routed rows are not right answers
    assert evaluation.answered.num_items == 3 and evaluation.answered.accuracy == 1.0
    # floors rank the model's own choices (model_label) by their probability: 0.8 and 0.8 and 0.7 right, 0.5
    # (id 2: gold technical) and 0.4 (id 4: gold billing) wrong
    points = {round(p.coverage, 2): p for p in evaluation.floors}
    assert (points[1.0].answered, points[1.0].correct) == (5, 3)
    assert (points[0.6].min_prob, points[0.6].answered, points[0.6].correct) == (0.7, 3, 3)
    record = evaluation.to_dict()
    assert record["fallback"] == {"label": "human", "rows": 2, "answered": 3, "answered_accuracy": 1.0}
    assert record["floors"][0]["coverage"] == 1.0
    assert record["macro_f1"] == pytest.approx(evaluation.metrics.macro_f1_except("human"))
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
    result = run_eval(preds, "--gold", gold)
    assert result.exit_code == 0, result.output
    for text in ("routed to the fallback │ 2 ('human')", "accuracy answered │ 100.0% of 3",
                 "floors: what --min-prob P would answer", "0.700", "3 of 5"):
        assert text in result.text, text
    plain = evaluate_files(*files)
    assert plain.answered is None and plain.to_dict()["fallback"] is None and plain.floors


def test_target_accuracy_names_the_floor(files, tmp_path, monkeypatch):
    """eval --target-accuracy: the --min-prob that answers the most rows at that accuracy, in the output and the
    JSON; one that no floor reaches says so; a target that is not a share exits 2."""
    preds, gold = files
    evaluation = evaluate_files(preds, gold, target_accuracy=0.9)  # scored: 0.8 right, 0.5 wrong, 0.8 right
    point = evaluation.target_floor
    assert (point.min_prob, point.answered, point.correct, point.total) == (0.8, 2, 2, 3)
    assert evaluation.to_dict()["target"] == {"accuracy": 0.9, "floor": point.to_dict()}
    assert "target" not in evaluate_files(preds, gold).to_dict()
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
    out = tmp_path / "m.json"
    result = run_eval(preds, "--gold", gold, "--target-accuracy", "0.9", "--json", out)
    assert result.exit_code == 0, result.output
    assert "for 90.0% or better: --min-prob 0.800 answers 2 of 3 rows (66.7%), 100.0% of them right" in result.text
    assert json.loads(out.read_text())["target"]["floor"]["min_prob"] == 0.8
    wrong_only = tmp_path / "wrong.csv"
    wrong_only.write_text("id,label,p_billing,p_technical,p_account\n2,billing,0.5,0.4,0.1\n")
    result = run_eval(wrong_only, "--gold", gold, "--target-accuracy", "0.5")
    assert result.exit_code == 0 and "no --min-prob gets the answered rows to 50.0% here" in result.text
    unrated = tmp_path / "unrated.csv"
    unrated.write_text("id,label\n1,billing\n2,billing\n")
    result = run_eval(unrated, "--gold", gold, "--target-accuracy", "0.5")
    assert result.exit_code == 0 and "no scored row has the probability of its label" in result.text
    result = run_eval(preds, "--gold", gold, "--target-accuracy", "90")
    assert result.exit_code == 2 and "a share in (0, 1], e.g. 0.9 for 90%" in result.text
