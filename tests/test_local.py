"""The windowed job loop: input order, bad rows, durable output formats, bounded memory."""

from __future__ import annotations

import hashlib
import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slimroute.backends.local import JobConfig, JobSummary, run_job, windows
from slimroute.io.durable import DurableOutput, OutputError, input_fingerprint, parts_path, progress_path
from slimroute.io.records import PredictionWriter
from slimroute.io.rows import Row, iter_rows
from slimroute.labels import Prediction

LABELS = ["billing", "technical", "account"]
SETTINGS = {"model": "stub", "window": 4}


class StubClassifier:
    """Instant and deterministic: each label's log-prob comes from a hash of the text."""

    def __init__(self, fail_on=()):
        self.fail_on = set(fail_on)
        self.batch_sizes: list[int] = []

    def classify(self, texts, progress=None):
        self.batch_sizes.append(len(texts))
        preds = []
        for text in texts:
            if text in self.fail_on:
                raise RuntimeError(f"cannot handle {text!r}")
            digest = hashlib.sha256(text.encode()).digest()
            logprobs = {label: -digest[i] / 7 for i, label in enumerate(LABELS)}
            preds.append(Prediction(max(logprobs, key=logprobs.get), logprobs, len(text), len(text) > 40))
        if progress:
            progress(len(texts))
        return preds


def fail_on_commit(patch, nth: int, error: BaseException) -> None:
    """Make the nth DurableOutput.commit of the run raise error (KeyboardInterrupt: Ctrl-C; OSError: a full disk)."""
    commit, calls = DurableOutput.commit, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == nth:
            raise error
        commit(self, *args)

    patch.setattr(DurableOutput, "commit", failing)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tickets(n):
    return [{"id": f"t{i}", "text": f"ticket number {i} " + "word " * (i % 11), "label": LABELS[i % 3]}
            for i in range(n)]


def run(input, out, window=4, classifier=None, errors=None, resume=False, overwrite=False):
    output = DurableOutput.prepare(out, LABELS, input_fingerprint(input), SETTINGS, resume=resume,
                                   overwrite=overwrite, errors=errors)
    summary = JobSummary.from_state(LABELS, output.record.summary)
    with output:
        run_job(classifier or StubClassifier(), iter_rows(input), output, summary, window)
    return summary


def test_windows_never_read_ahead():
    pulled = []

    def rows():
        for i in range(10):
            pulled.append(i)
            yield i

    seen = []
    for batch in windows(rows(), 4):
        assert len(pulled) == len(seen) + len(batch)  # nothing beyond this window has been read
        seen += batch
    assert [len(b) for b in windows(range(10), 4)] == [4, 4, 2] and seen == list(range(10))
    assert list(windows([], 4)) == []


def test_job_config_validates():
    with pytest.raises(ValueError, match="window"):
        JobConfig(window=0)
    with pytest.raises(ValueError, match="limit"):
        JobConfig(limit=-1)
    with pytest.raises(ValueError, match="--resume or --overwrite"):
        JobConfig(resume=True, overwrite=True)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_output_matches_the_plain_writer_byte_for_byte(tmp_path, suffix):
    """Committing window by window writes exactly what PredictionWriter writes (one batch per window)."""
    src = write_jsonl(tmp_path / "in.jsonl", tickets(10))
    run(src, tmp_path / f"out{suffix}", window=4)
    rows = list(iter_rows(src))
    with PredictionWriter(tmp_path / f"plain{suffix}", LABELS) as writer:
        for batch in windows(rows, 4):
            writer.write(batch, StubClassifier().classify([r.text for r in batch]))
    assert (tmp_path / f"out{suffix}").read_bytes() == (tmp_path / f"plain{suffix}").read_bytes()
    assert not progress_path(tmp_path / f"out{suffix}").exists()
    assert not parts_path(tmp_path / f"out{suffix}").exists()


def test_windows_are_classified_in_input_order(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", tickets(11))
    stub = StubClassifier()
    summary = run(src, tmp_path / "out.jsonl", window=4, classifier=stub)
    ids = [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert ids == [f"t{i}" for i in range(11)]
    assert stub.batch_sizes == [4, 4, 3]
    assert summary.num_items == 11 and summary.num_gold == 11


def bad_inputs(tmp_path):
    """One file per format; each has good rows around bad rows of every kind that format can have."""
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_bytes(b"\n".join([
        b'{"id": "a", "text": "fine one"}',
        b'{"id": "b", "text": "bad \xff\xfe bytes"}',  # undecodable text
        b'{"id": "c"}',  # no text value
        b'{"id": "d", "text": null}',
        b'{"id": "e", "text": "   "}',
        b'{"id": "f", "text": 12}',
        b'{"id": "g", "text": "broken',  # not JSON
        b'["not", "an", "object"]',
        b'{"id": "i", "text": "fine two"}',
    ]) + b"\n")
    csv = tmp_path / "bad.csv"
    csv.write_bytes(b"id,text\r\na,fine one\r\nb,bad \xff bytes\r\nc\r\nd,\r\ni,fine two\r\n")
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["a", "d", "i"], "text": ["fine one", None, "fine two"]}), parquet)
    return {"jsonl": (jsonl, 9, 7), "csv": (csv, 5, 3), "parquet": (parquet, 3, 1)}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_bad_rows_are_reported_and_the_job_goes_on(tmp_path, fmt):
    src, num_rows, num_bad = bad_inputs(tmp_path)[fmt]
    summary = run(src, tmp_path / "out.jsonl", window=2)
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == num_rows and summary.num_items == num_rows and summary.num_errors == num_bad
    assert [r["label"] is not None for r in out].count(True) == num_rows - num_bad
    for rec in out:
        assert (rec["error"] is None) == (rec["label"] is not None)
        if rec["error"]:
            assert all(rec[f"p_{label}"] is None for label in LABELS)


def test_errors_file_takes_the_failed_rows(tmp_path):
    src, num_rows, num_bad = bad_inputs(tmp_path)["jsonl"]
    summary = run(src, tmp_path / "out.csv", window=3, errors=tmp_path / "errors.jsonl")
    good = (tmp_path / "out.csv").read_text().splitlines()[1:]
    failed = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert len(good) == num_rows - num_bad and len(failed) == num_bad == summary.num_errors
    assert [f["index"] for f in failed] == [1, 2, 3, 4, 5, 6, 7]
    assert "UTF-8" in failed[0]["error"] and failed[0]["id"] == "b"
    ids = [line.split(",")[0] for line in good] + [f["id"] for f in failed]
    assert sorted(ids) == sorted(set(ids))  # every row exactly once across the two files


def test_model_failure_on_one_row_is_isolated(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", tickets(6))
    run(src, tmp_path / "out.jsonl", window=3, classifier=StubClassifier(fail_on={tickets(6)[4]["text"]}))
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["error"] is not None for r in out] == [False] * 4 + [True, False]
    assert "model failed on this row" in out[4]["error"]


def test_empty_input(tmp_path):
    (tmp_path / "in.csv").write_text("id,text\r\n")
    for suffix in (".jsonl", ".csv", ".parquet"):
        summary = run(tmp_path / "in.csv", tmp_path / f"out{suffix}")
        assert summary.num_items == 0
    assert (tmp_path / "out.jsonl").read_bytes() == b""
    header = b"id,label,p_billing,p_technical,p_account,truncated,error\r\n"
    assert (tmp_path / "out.csv").read_bytes() == header
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 0


def test_existing_output_is_never_silently_replaced(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", tickets(3))
    (tmp_path / "out.jsonl").write_text("precious\n")
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        run(src, tmp_path / "out.jsonl")
    assert (tmp_path / "out.jsonl").read_text() == "precious\n"
    run(src, tmp_path / "out.jsonl", overwrite=True)
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_summary_state_round_trips():
    summary = JobSummary(LABELS)
    rows = [Row(0, "a", "x", "billing", None), Row(1, "b", None, None, "text is empty"),
            Row(2, "c", "y", "account", None)]
    preds = [Prediction("billing", {}, 1, True), Prediction.failed("text is empty"), Prediction("billing")]
    summary.add(rows, preds)
    again = JobSummary.from_state(LABELS, json.loads(json.dumps(summary.state())))
    assert again.state() == summary.state() and again.num_resumed == 3
    assert (again.num_items, again.num_errors, again.num_truncated, again.accuracy) == (3, 1, 1, 0.5)


def _stream(tmp_path, n: int, window: int, trace: bool) -> int:
    """Stream n synthetic rows through the job; check the rows in flight; the traced heap peak."""
    src = tmp_path / f"in-{n}.jsonl"
    with src.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i}", "text": f"ticket {i} " + "word " * (i % 17)}) + "\n")
    out = tmp_path / f"out-{n}.jsonl"
    output = DurableOutput.prepare(out, LABELS, input_fingerprint(src), SETTINGS)
    pulled, in_flight = [0], []

    class Watching(StubClassifier):
        def classify(self, texts, progress=None):
            in_flight.append(pulled[0] - output.record.rows_done)  # rows read but not yet committed
            return super().classify(texts, progress)

    def counted(rows):
        for row in rows:
            pulled[0] += 1
            yield row

    if trace:
        tracemalloc.start()
    with output:
        run_job(Watching(), counted(iter_rows(src)), output, JobSummary(LABELS), window=window)
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    tracemalloc.stop()
    assert max(in_flight) <= window and output.record.rows_done == n
    assert sum(1 for _ in out.open()) == n
    return peak


def test_100k_rows_stream_with_one_window_in_flight(tmp_path):
    _stream(tmp_path, 100_000, window=1024, trace=False)


def test_heap_does_not_grow_with_the_input(tmp_path):
    """Python heap peak for 20k rows within 10% of that for 2k (benchmarks/stream_memory.py: RSS, 100k)."""
    small, large = _stream(tmp_path, 2_000, 256, trace=True), _stream(tmp_path, 20_000, 256, trace=True)
    assert large < 1.1 * small, (small, large)


def test_job_settings_name_the_server_so_resume_cannot_switch_servers():
    from slimroute.backends.local import job_settings
    from slimroute.config import EngineConfig
    from slimroute.task import Task

    def settings(server=None, server_task=None):
        return job_settings(task=Task(("a", "b")), config=EngineConfig(), model="m", dtype="float32", device="cpu",
                            threads=1, reference=False, window=8, columns=("text", "id", None), limit=None,
                            errors=None, server=server, server_task=server_task)

    local, remote = settings(), settings("http://127.0.0.1:8000/", "tickets")
    assert local["server"] is None and local["server_task"] is None
    assert remote["server"] == "http://127.0.0.1:8000" and remote["server_task"] == "tickets"
    assert settings("http://other:8000", "tickets") != remote
