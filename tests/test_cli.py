"""`slimroute classify` as a user meets it: usage errors exit 2 before any work, and the summary."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from slimroute import cli

LABELS = "billing,technical,account"


@pytest.fixture
def src(tmp_path):
    rows = [
        {"id": "a", "text": "I was charged twice for my plan", "label": "billing"},
        {"id": "b", "text": "the app crashes when I open it", "label": "technical"},
        {"id": "c", "text": "I cannot log in to my account", "label": "account"},
        {"id": "long", "text": "refund " * 3000, "label": "billing"},  # longer than the tiny context
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "x", "text": \n')
    return path


@pytest.fixture
def invoke(monkeypatch, model_dir):
    monkeypatch.setattr(cli, "console", Console(stderr=True, width=1000))

    def invoke(*args, model=True):
        extra = ["--model", str(model_dir), "--threads", "1"] if model else []
        result = CliRunner().invoke(cli.app, ["classify", *map(str, args), *extra])
        result.text = " ".join(result.output.split())
        return result

    return invoke


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl", "--labels", LABELS], "does not exist"),
    (["{src}", "--labels", LABELS, "--text-column", "body"], "text column 'body' is not in"),
    (["{src}", "--labels", ""], "the label list is empty"),
    (["{src}", "--labels", "billing,billing"], "label 'billing' is given twice"),
    (["{src}", "--labels", LABELS, "--task", "{task}"], "either --task or --labels, not both"),
    (["{src}"], "no labels"),
    (["{src}", "--labels", LABELS, "--window", "0"], "window must be an integer >= 1"),
    (["{src}", "--labels", LABELS, "--resume", "--overwrite"], "not both"),
    (["{src}", "--labels", LABELS, "--errors", "{tmp}/errors.csv"], "must be a .jsonl file"),
    (["{src}", "--labels", LABELS, "--out", "{tmp}/out.xlsx"], "must end in .jsonl, .csv or .parquet"),
    (["{src}", "--labels", LABELS, "--model", "{tmp}/no-such-model"], "unknown model"),
])
def test_usage_errors_exit_2_and_write_nothing(tmp_path, src, invoke, args, message):
    (tmp_path / "task.yaml").write_text("labels: [billing, technical]\n")
    fill = {"src": src, "task": tmp_path / "task.yaml", "tmp": tmp_path}
    args = [a.format(**fill) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out.jsonl")]
    result = invoke(*args, model="--model" not in args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.text and message in result.text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl", "task.yaml"])


def test_summary_covers_errors_truncation_accuracy_and_timing(tmp_path, src, invoke):
    out, summary_json = tmp_path / "out.csv", tmp_path / "summary.json"
    result = invoke(src, "--labels", LABELS, "--out", out, "--summary-json", summary_json, "--window", "2")
    assert result.exit_code == 0, result.output
    for row in ("items │ 5", "row errors │ 1", "truncated │ 1", "items/s", "seconds", "padding overhead",
                "accuracy", "of 4", "confusion (rows: gold, columns: predicted)"):
        assert row in result.text, row
    assert "1 text(s) were longer than the context and were truncated" in result.text
    assert f"wrote 5 predictions to {out}" in result.text
    lines = out.read_text().splitlines()
    assert lines[0] == "id,label,p_billing,p_technical,p_account,truncated,error" and len(lines) == 6
    assert lines[4].startswith("long,") and ",true," in lines[4]
    assert lines[5].startswith("4,,,,,false,row is not valid JSON")
    summary = json.loads(summary_json.read_text())
    assert (summary["items"], summary["errors"], summary["truncated"], summary["resumed"]) == (5, 1, 1, 0)
    assert sum(n for _, _, n in summary["confusion"]) == 4 and summary["items_per_s"] > 0


def test_errors_file_and_identical_reruns(tmp_path, src, invoke):
    """Failed rows go to --errors; output rows carry no timings, so a rerun is byte-identical."""
    first, errors = tmp_path / "first.jsonl", tmp_path / "errors.jsonl"
    result = invoke(src, "--labels", LABELS, "--out", first, "--errors", errors)
    assert result.exit_code == 0, result.output
    assert f"wrote 4 predictions to {first} and 1 failed rows to {errors}" in result.text
    assert [json.loads(line)["id"] for line in first.read_text().splitlines()] == ["a", "b", "c", "long"]
    failed = json.loads(errors.read_text())
    assert (failed["index"], failed["id"]) == (4, "4") and "not valid JSON" in failed["error"]
    second = tmp_path / "second.jsonl"
    result = invoke(src, "--labels", LABELS, "--out", second, "--errors", tmp_path / "e2.jsonl")
    assert result.exit_code == 0, result.output
    assert second.read_bytes() == first.read_bytes()


def test_existing_output_needs_overwrite(tmp_path, src, invoke):
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    result = invoke(src, "--labels", LABELS, "--out", out)
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.text
    assert out.read_text() == "keep me\n"
    result = invoke(src, "--labels", LABELS, "--out", out, "--overwrite", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_a_failed_write_keeps_the_committed_windows_and_says_how_to_resume(tmp_path, src, invoke, monkeypatch):
    from slimroute.output import DurableOutput

    commit, calls = DurableOutput.commit, []

    def disk_full_on_the_third(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        commit(self, *args)

    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:
        patch.setattr(DurableOutput, "commit", disk_full_on_the_third)
        result = invoke(src, "--labels", LABELS, "--out", out, "--window", "2")
    assert result.exit_code == 1
    assert "No space left on device" in result.text and "4 rows (2 whole windows) are committed" in result.text
    assert "resume with:" in result.text and len(out.read_text().splitlines()) == 4
    assert invoke(src, "--labels", LABELS, "--out", out, "--window", "2", "--resume").exit_code == 0
    assert invoke(src, "--labels", LABELS, "--out", tmp_path / "again.jsonl", "--window", "2").exit_code == 0
    assert out.read_bytes() == (tmp_path / "again.jsonl").read_bytes()


def test_an_input_that_breaks_part_way_exits_2(tmp_path, src, invoke, monkeypatch):
    from slimroute import data

    real = data.iter_rows

    def breaks_after_three(*args):
        for row in real(*args):
            if row.index == 3:
                raise data.InputError("'in.csv' is not valid CSV near line 5")
            yield row

    monkeypatch.setattr(data, "iter_rows", breaks_after_three)
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", "--window", "2")
    assert result.exit_code == 2 and "not valid CSV near line 5" in result.text
    assert "2 rows (1 whole window) are committed" in result.text and "start over with --overwrite" in result.text
