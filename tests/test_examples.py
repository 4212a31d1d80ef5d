"""Few-shot examples from a labelled file: deterministic selection, the prefix, and bad files."""

import json

import pytest
from test_cli import LABELS, invoke, src  # noqa: F401 (fixtures)

from slimroute.accuracy.examples import read_examples, select_examples, with_examples_from
from slimroute.io.rows import InputError
from slimroute.task import Example, Task

PAIRS = [("refund", "billing"), ("crash", "technical"), ("charged twice", "billing"), ("login", "account"),
         ("error 500", "technical"), ("invoice", "billing"), ("password", "account")]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_first_k_of_each_label_in_round_robin_order():
    chosen = select_examples(PAIRS, ("billing", "technical", "account"), 2)
    assert chosen == (Example("refund", "billing"), Example("crash", "technical"), Example("login", "account"),
                      Example("charged twice", "billing"), Example("error 500", "technical"),
                      Example("password", "account"))
    assert select_examples(list(PAIRS), ("account", "billing", "technical"), 1) == (
        Example("login", "account"), Example("refund", "billing"), Example("crash", "technical"))


@pytest.mark.parametrize("pairs, shots, message", [
    (PAIRS + [("hi", "sales")], 1, "label 'sales' is not one of the task's labels"),
    (PAIRS, 3, "has 2 example\\(s\\) of 'technical'; --shots 3 needs 3"),
    ([], 1, "no rows"),
    (PAIRS, 0, "shots must be an integer >= 1"),
])
def test_bad_example_sets_are_refused(pairs, shots, message):
    with pytest.raises(ValueError, match=message):
        select_examples(pairs, ("billing", "technical", "account"), shots)


def test_read_from_a_file(tmp_path):
    path = write_jsonl(tmp_path / "ex.jsonl", [{"body": t, "intent": label} for t, label in PAIRS])
    examples = read_examples(path, ("billing", "technical", "account"), 1, "body", "intent")
    assert [e.text for e in examples] == ["refund", "crash", "login"]
    task = with_examples_from(Task(("billing", "technical", "account")), path, 2, "body", "intent")
    assert len(task.examples) == 6
    with pytest.raises(ValueError, match="already has examples"):
        with_examples_from(task, path, 1, "body", "intent")
    with pytest.raises(ValueError, match="--shots needs --examples"):
        with_examples_from(task, None, 2)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "refund", "label": "billing"}, {"text": "x"}])
    with pytest.raises(InputError, match="row 1 \\(id 1\\) has no label"):
        read_examples(bad, ("billing",), 1)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match="has no rows"):
        read_examples(tmp_path / "empty.jsonl", ("billing",), 1)


@pytest.mark.parametrize("records, extra, message", [
    ([{"text": "x", "label": "sales"}], [], "label 'sales' is not one of the task's labels"),
    ([], [], "has no rows"),
    ([{"text": "refund", "label": "billing"}], ["--shots", "1"], "has 0 example(s) of 'technical'"),
    ([{"text": "refund", "label": "billing"}], ["--shots", "0"], "shots must be an integer >= 1"),
])
def test_bad_examples_files_exit_2_and_write_nothing(tmp_path, src, invoke, records, extra, message):  # noqa: F811
    examples = write_jsonl(tmp_path / "examples.jsonl", records)
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", "--examples", examples, *extra)
    assert result.exit_code == 2, result.output
    assert message in result.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples.jsonl", "in.jsonl"]


def test_shots_without_examples_exit_2(tmp_path, src, invoke):  # noqa: F811
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", "--shots", "2")
    assert result.exit_code == 2 and "--shots needs --examples" in result.text


def test_examples_go_into_the_prefix_and_the_summary_reports_it(tmp_path, src, invoke):  # noqa: F811
    examples = write_jsonl(tmp_path / "examples.jsonl", [{"text": t, "label": label} for t, label in PAIRS])
    summary_json = tmp_path / "summary.json"
    plain = invoke(src, "--labels", LABELS, "--out", tmp_path / "plain.jsonl", "--summary-json", summary_json)
    plain_prefix = json.loads(summary_json.read_text())["prefix_tokens"]
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", "--examples", examples, "--shots", "2",
                    "--summary-json", summary_json)
    assert plain.exit_code == 0 and result.exit_code == 0, result.output
    prefix = json.loads(summary_json.read_text())["prefix_tokens"]
    assert prefix > plain_prefix + 12 and f"prompt prefix │ {prefix} tokens" in result.text
