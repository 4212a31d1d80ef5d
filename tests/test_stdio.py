"""`-` for classify: standard input spooled into a file, predictions streamed to standard output."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console
from test_local import LABELS, SETTINGS, StubClassifier, run, tickets, write_jsonl
from typer.testing import CliRunner

from slimroute import cli
from slimroute.backends.local import JobSummary, run_job
from slimroute.io.durable import OutputError, input_fingerprint
from slimroute.io.rows import InputError, iter_rows, read_rows
from slimroute.io.stdio import StreamOutput, spooled_stdin


def test_spooled_stdin_is_jsonl_or_text_lines_and_is_removed_afterwards():
    jsonl = b'\xef\xbb\xbf\n{"id": "a", "text": "charged twice", "label": "billing"}\n{"text": 5}\n'
    with spooled_stdin(io.BytesIO(jsonl)) as path:
        assert path.suffix == ".jsonl"
        rows = read_rows(path)
        assert [(r.id, r.text, r.gold) for r in rows] == [("a", "charged twice", "billing"), ("1", None, None)]
    assert not path.parent.exists()
    with spooled_stdin(io.BytesIO(b"the app crashes\n\n[1, 2]\n{not json\n")) as path:
        assert path.suffix == ".txt"
        assert [r.text for r in read_rows(path)] == ["the app crashes", "[1, 2]", "{not json"]
    assert not path.parent.exists()
    with spooled_stdin(io.BytesIO(b"")) as path:  # nothing piped: no rows
        assert read_rows(path) == []


@pytest.mark.parametrize("first", [b"id,text", b'"id","text",label', b"body"])
def test_a_csv_header_on_stdin_is_refused_and_nothing_is_left(first):
    column = "body" if first == b"body" else "text"
    with pytest.raises(InputError, match=f"looks like CSV .*names the column '{column}'.*as a file"):
        with spooled_stdin(io.BytesIO(first + b"\n1,hello\n"), text_column=column):
            pass


def test_stream_output_writes_the_bytes_a_jsonl_file_gets(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", tickets(10) + [{"id": "bad"}])
    run(src, tmp_path / "out.jsonl", window=4)
    stream = io.BytesIO()
    output = StreamOutput(LABELS, input_fingerprint(src), SETTINGS, stream=stream)
    with output:
        summary = run_job(StubClassifier(), iter_rows(src), output, JobSummary.from_state(LABELS, {}), 4)
    assert stream.getvalue() == (tmp_path / "out.jsonl").read_bytes()
    record = output.record
    assert (record.rows_done, record.windows_done, summary.num_items, summary.num_errors) == (11, 3, 11, 1)


def test_stream_output_with_an_errors_file_and_no_resume(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", tickets(3) + [{"id": "bad"}])
    stream, errors = io.BytesIO(), tmp_path / "errors.jsonl"
    with StreamOutput(LABELS, {}, SETTINGS, errors=errors, stream=stream) as output:
        run_job(StubClassifier(), iter_rows(src), output, JobSummary.from_state(LABELS, {}), 2)
    assert [json.loads(line)["id"] for line in stream.getvalue().splitlines()] == ["t0", "t1", "t2"]
    failed = {"index": 3, "id": "bad", "error": "text column 'text' is missing in this row"}
    assert json.loads(errors.read_text()) == failed
    with pytest.raises(OutputError, match="--resume needs an output file"):
        StreamOutput(LABELS, {}, SETTINGS, resume=True)
    with pytest.raises(OutputError, match="must be a .jsonl file"):
        StreamOutput(LABELS, {}, SETTINGS, errors=tmp_path / "errors.csv")


@pytest.fixture
def invoke(monkeypatch, model_dir):
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))

    def invoke(*args, stdin: bytes = b""):
        extra = ["--model", str(model_dir), "--threads", "1", "--labels", ",".join(LABELS)]
        return CliRunner().invoke(cli.app, ["classify", *map(str, args), *extra], input=stdin)

    return invoke


def test_classify_reads_stdin_and_writes_stdout_as_it_would_files(tmp_path, invoke):
    records = tickets(5) + [{"id": "bad", "text": ""}]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    assert invoke(src, "--out", tmp_path / "out.jsonl").exit_code == 0
    piped = invoke("-", "--out", "-", "--window", "2", stdin=src.read_bytes())
    assert piped.exit_code == 0, piped.output
    assert piped.stdout.encode() == (tmp_path / "out.jsonl").read_bytes()  # nothing else on stdout
    assert "wrote 6 predictions to standard output" in " ".join(piped.stderr.split())
    assert "accuracy" in piped.stderr  # the gold labels came through stdin too
    lines = "".join(r["text"] + "\n" for r in records[:5]).encode()  # one text per line; ids are row numbers
    as_text = invoke("-", "--out", tmp_path / "text.csv", stdin=lines)
    assert as_text.exit_code == 0, as_text.output
    text_rows = (tmp_path / "text.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in text_rows] == ["0", "1", "2", "3", "4"]
    file_rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row.split(",")[1] for row in text_rows] == [row["label"] for row in file_rows[:5]]


def test_classify_stdio_usage_errors_exit_2_before_any_work(tmp_path, invoke):
    result = invoke("-", "--out", "-", stdin=b"id,text\n1,hello\n")
    assert result.exit_code == 2 and "looks like CSV" in result.stderr and result.stdout == ""
    result = invoke(write_jsonl(tmp_path / "in.jsonl", tickets(2)), "--out", "-", "--resume")
    assert result.exit_code == 2 and "--resume needs an output file" in result.stderr
    result = invoke("-", "--out", tmp_path / "o.jsonl", "--backend", "ray", stdin=b"hello\n")
    assert result.exit_code == 2 and "give INPUT and --out as paths" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_closed_stdout_stops_quietly(tmp_path, model_dir):
    """`slimroute classify - --out - | head -1`: the reader goes away; no traceback, exit 141 like a Unix tool."""
    texts = "".join(f"ticket {i} about my invoice\n" for i in range(40)).encode()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimroute.cli", "classify", "-", "--out", "-", "--window", "2", "--labels",
         ",".join(LABELS), "--model", str(model_dir), "--threads", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(texts)
    proc.stdin.close()
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()  # the reader stops here
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert first["id"] == "0" and "Traceback" not in stderr
    assert "standard output was closed after" in stderr and "; stopped" in stderr


def test_eval_reads_predictions_from_stdin(tmp_path, invoke):
    """`slimroute classify - --out - | slimroute eval - --gold in.jsonl`: the metrics of the same file."""
    src = write_jsonl(tmp_path / "in.jsonl", tickets(6))
    out = tmp_path / "out.jsonl"
    assert invoke(src, "--out", out).exit_code == 0
    runner = CliRunner()
    from_file = runner.invoke(cli.app, ["eval", str(out), "--gold", str(src), "--json", str(tmp_path / "a.json")])
    piped = runner.invoke(cli.app, ["eval", "-", "--gold", str(src), "--json", str(tmp_path / "b.json")],
                          input=out.read_bytes())
    assert from_file.exit_code == piped.exit_code == 0, piped.output
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    assert "accuracy" in piped.stdout
