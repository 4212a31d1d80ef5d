"""`slimroute classify` as a user meets it: usage errors exit 2 before any work, and the summary."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from test_local import fail_on_commit
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
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))

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
    (["{src}", "--labels", LABELS, "--truncate-tokens", "-1"], "--truncate-tokens: expected a number of tokens"),
    (["{src}", "--labels", LABELS, "--truncate-tokens", "8", "--server", "http://127.0.0.1:9"],
     "the server's task decides how much of a text is read"),
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


def test_truncate_tokens_cuts_long_texts_and_says_so(tmp_path, src, invoke):
    out, summary_json = tmp_path / "out.jsonl", tmp_path / "summary.json"
    result = invoke(src, "--labels", LABELS, "--out", out, "--summary-json", summary_json, "--truncate-tokens", "12")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    cut = sorted(key for key, row in rows.items() if row["truncated"])
    assert cut == ["a", "b", "long"]  # c is 12 tokens or fewer with the tiny model's tokenizer
    assert "3 text(s) were longer than --truncate-tokens 12 (or the context): only their first tokens were read" \
        in result.text and "truncated │ 3 (texts read up to 12 tokens)" in result.text
    summary = json.loads(summary_json.read_text())
    assert (summary["truncated"], summary["truncate_tokens"]) == (3, 12)
    task = tmp_path / "task.yaml"  # the same from a task file
    task.write_text("labels: [billing, technical, account]\ntruncate_tokens: 12\n")
    again = tmp_path / "again.jsonl"
    assert invoke(src, "--task", task, "--out", again).exit_code == 0
    assert again.read_bytes() == out.read_bytes()
    whole = tmp_path / "whole.jsonl"  # 0: whole texts again
    assert invoke(src, "--task", task, "--truncate-tokens", "0", "--out", whole).exit_code == 0
    assert [json.loads(line)["truncated"] for line in whole.read_text().splitlines()] == [False] * 3 + [True, False]


def test_many_multi_token_labels_get_a_note(tmp_path, src, invoke):
    many = ",".join(f"refund case {k}" for k in range(8))  # several tokens each
    result = invoke(src, "--labels", many, "--out", tmp_path / "many.jsonl")
    assert result.exit_code == 0, result.output
    assert "note: 8 of the 8 labels are several tokens long" in result.text and "slimroute tune" in result.text
    result = invoke(src, "--labels", ",".join(f"refund case {k}" for k in range(7)), "--out", tmp_path / "few.jsonl")
    assert result.exit_code == 0 and "several tokens long" not in result.text


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


def disk_full_on_commit(patch, nth: int) -> None:
    """Make the nth DurableOutput.commit of the run fail as a full disk would."""
    fail_on_commit(patch, nth, OSError(28, "No space left on device"))


def test_a_failed_write_keeps_the_committed_windows_and_says_how_to_resume(tmp_path, src, invoke, monkeypatch):
    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:
        disk_full_on_commit(patch, 3)
        result = invoke(src, "--labels", LABELS, "--out", out, "--window", "2")
    assert result.exit_code == 1
    assert "No space left on device" in result.text and "4 rows (2 whole windows) are committed" in result.text
    assert "resume with:" in result.text and len(out.read_text().splitlines()) == 4
    assert invoke(src, "--labels", LABELS, "--out", out, "--window", "2", "--resume").exit_code == 0
    assert invoke(src, "--labels", LABELS, "--out", tmp_path / "again.jsonl", "--window", "2").exit_code == 0
    assert out.read_bytes() == (tmp_path / "again.jsonl").read_bytes()


def test_an_input_that_breaks_part_way_exits_2(tmp_path, src, invoke, monkeypatch):
    from slimroute.backends import local
    from slimroute.io.rows import InputError

    real = local.iter_rows

    def breaks_after_three(*args):
        for row in real(*args):
            if row.index == 3:
                raise InputError("'in.csv' is not valid CSV near line 5")
            yield row

    monkeypatch.setattr(local, "iter_rows", breaks_after_three)
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", "--window", "2")
    assert result.exit_code == 2 and "not valid CSV near line 5" in result.text
    assert "2 rows (1 whole window) are committed" in result.text and "start over with --overwrite" in result.text


# --------------------------------------------------------------------------- calibration


def labelled_file(tmp_path, rows=None):
    rows = rows or [("refund my card", "billing"), ("the app crashes", "technical"), ("reset my password", "account"),
                    ("charged twice", "billing"), ("error 500 on login", "technical"), ("cannot log in", "account")]
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in rows))
    return path


@pytest.mark.parametrize("mode", ["content-free", "batch", "fitted"])
def test_calibrated_output_keeps_the_models_probabilities(tmp_path, src, invoke, mode):
    out, summary_json = tmp_path / "out.csv", tmp_path / "summary.json"
    data = ["--calibration-data", labelled_file(tmp_path)] if mode == "fitted" else []
    result = invoke(src, "--labels", LABELS, "--out", out, "--calibrate", mode, *data, "--summary-json", summary_json)
    assert result.exit_code == 0, result.output
    header = out.read_text().splitlines()[0]
    assert header == ("id,label,p_billing,p_technical,p_account,raw_p_billing,raw_p_technical,raw_p_account,"
                      "truncated,error")
    calibration = json.loads(summary_json.read_text())["calibration"]
    assert calibration["mode"] == mode
    assert f"calibration │ {mode} from {calibration['num_inputs']} texts" in result.text
    assert calibration["num_inputs"] == {"content-free": 3, "batch": 4, "fitted": 6}[mode]


@pytest.mark.parametrize("args, message", [
    (["--calibrate", "platt"], "calibrate must be one of none, content-free, batch, fitted"),
    (["--calibrate", "fitted"], "--calibrate fitted needs labelled rows"),
    (["--calibration-data", "{data}"], "--calibration-data is used by --calibrate batch or fitted"),
    (["--calibrate", "fitted", "--calibration-data", "{tmp}/missing.csv"], "does not exist"),
    (["--calibrate", "fitted", "--calibration-data", "{unknown}"], "gold label 'sales' is not one of the labels"),
    (["--calibrate", "batch", "--server", "http://127.0.0.1:9"], "--calibrate runs with the local engine only"),
])
def test_bad_calibration_settings_exit_2_and_write_nothing(tmp_path, src, invoke, args, message):
    data = labelled_file(tmp_path)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(data.read_text() + json.dumps({"text": "buy more", "label": "sales"}) + "\n")
    args = [a.format(data=data, unknown=unknown, tmp=tmp_path) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", *args)
    assert result.exit_code == 2 and message in result.text, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_batch_offsets_come_from_the_first_window_and_survive_resume(tmp_path, src, invoke, monkeypatch):
    whole, summary_json = tmp_path / "whole.jsonl", tmp_path / "summary.json"
    args = ["--labels", LABELS, "--calibrate", "batch", "--window", "2"]
    assert invoke(src, *args, "--out", whole, "--summary-json", summary_json).exit_code == 0
    first = json.loads(summary_json.read_text())["calibration"]
    assert first["num_inputs"] == 2 and "rows 0-1" in first["source"]  # the first window only

    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:
        disk_full_on_commit(patch, 2)
        assert invoke(src, *args, "--out", out).exit_code == 1
    record = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    assert record["rows_done"] == 2 and record["calibration"] == first
    changed = invoke(src, "--labels", LABELS, "--calibrate", "content-free", "--window", "2", "--out", out,
                     "--resume")
    assert changed.exit_code == 2 and "settings differ" in changed.text and "calibration" in changed.text
    resumed = invoke(src, *args, "--out", out, "--resume", "--summary-json", summary_json)
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(summary_json.read_text())["calibration"] == first
    assert out.read_bytes() == whole.read_bytes()


def test_verify_holds_under_calibration(tmp_path, src, model_dir, monkeypatch):
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
    for mode in ("content-free", "batch"):
        result = CliRunner().invoke(cli.app, ["verify", str(src), "--labels", LABELS, "--model", model_dir,
                                              "--threads", "1", "--calibrate", mode, "--json",
                                              str(tmp_path / "v.json")])
        assert result.exit_code == 0, result.output
        record = json.loads((tmp_path / "v.json").read_text())
        assert record["agreement"] == 1.0 and record["max_abs_logprob_diff"] <= 1e-4
        assert record["calibration"]["mode"] == mode


def test_verify_warns_where_the_log_probs_differ_by_more_than_the_dtype_claims(tmp_path, src, model_dir, monkeypatch):
    import slimroute.cli.verify as verify_cli
    from slimroute.runtime.dtypes import Exactness

    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
    monkeypatch.setattr(verify_cli, "exactness", lambda *a, **k: Exactness(-1.0, True, "a claim no run can meet"))
    result = CliRunner().invoke(cli.app, ["verify", str(src), "--labels", LABELS, "--model", model_dir,
                                          "--threads", "1", "--json", str(tmp_path / "v.json")])
    assert result.exit_code == 0, result.output  # every label agrees: the answers hold, the claim does not
    assert json.loads((tmp_path / "v.json").read_text())["within_expected"] is False
    assert "claims on this CPU (-1); please report it" in result.output and "slimroute info --json" in result.output


def test_a_fallback_floor_routes_low_probability_rows(tmp_path, src, invoke):
    plain = tmp_path / "plain.jsonl"
    assert invoke(src, "--labels", LABELS, "--out", plain).exit_code == 0
    rows = [json.loads(line) for line in plain.read_text().splitlines()]
    chosen = sorted(r[f"p_{r['label']}"] for r in rows if r["error"] is None)
    floor = (chosen[1] + chosen[2]) / 2  # two of the four good rows fall below it
    out, summary_json = tmp_path / "out.csv", tmp_path / "summary.json"
    result = invoke(src, "--labels", LABELS, "--out", out, "--min-prob", floor, "--fallback-label", "human",
                    "--summary-json", summary_json)
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0] == "id,label,model_label,p_billing,p_technical,p_account,truncated,error"
    for before, line in zip(rows, lines[1:], strict=True):
        cells = line.split(",")
        if before["error"] is not None:
            assert cells[1:3] == ["", ""]
            continue
        assert cells[2] == before["label"]  # model_label: the model's choice, as without the floor
        assert cells[1] == (before["label"] if before[f"p_{before['label']}"] >= floor else "human")
    summary = json.loads(summary_json.read_text())
    assert summary["fallback"]["rows"] == 2 and summary["fallback"]["label"] == "human"
    assert "fallback │ 2 rows (40.0%) answered 'human'" in result.text and "accuracy answered" in result.text


@pytest.mark.parametrize("args, message", [
    (["--min-prob", "1.5"], "min_prob must be a probability in (0, 1]"),
    (["--min-prob", "0.5", "--fallback-label", "billing"], "fallback_label 'billing' is one of the labels"),
    (["--fallback-label", "human"], "fallback_label 'human' needs min_prob"),
    (["--min-prob", "0.5", "--server", "http://127.0.0.1:9"], "the fallback floor is the server's setting"),
    (["--min-prob", "0.5", "--backend", "ray", "--fallback-label", "account"], "is one of the labels"),
])
def test_bad_floor_settings_exit_2_and_write_nothing(tmp_path, src, invoke, args, message):
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(src, "--labels", LABELS, "--out", tmp_path / "out.jsonl", *args)
    assert result.exit_code == 2 and message in result.text, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_verify_holds_under_a_floor(tmp_path, src, model_dir, monkeypatch):
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))
    result = CliRunner().invoke(cli.app, ["verify", str(src), "--labels", LABELS, "--model", model_dir,
                                          "--threads", "1", "--min-prob", "0.34", "--json", str(tmp_path / "v.json")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "v.json").read_text())
    assert record["agreement"] == 1.0 and record["fallback"] == {"min_prob": 0.34, "label": "unsure"}
