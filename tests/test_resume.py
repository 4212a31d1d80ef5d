"""Interrupted jobs resume to byte-identical output: crashes at every commit step (in process, stub
classifier), kill -9 and Ctrl-C of the real CLI on a tiny saved model, and the refusals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console
from test_local import LABELS, SETTINGS, StubClassifier, fail_on_commit, run, tickets, write_jsonl
from typer.testing import CliRunner

from slimroute import cli
from slimroute.backends.local import JobSummary, run_job
from slimroute.io.durable import DurableOutput, input_fingerprint, parts_path, progress_path
from slimroute.io.rows import iter_rows
from slimroute.io.synth import synthetic_tickets

WINDOW = 10


class Crash(BaseException):
    """Stands in for the process dying: nothing catches it and nothing is cleaned up."""


def crash_at_step(monkeypatch, n: int) -> list[int]:
    """Die just before the n-th fsync or rename (every step of the commit protocol is one of these)."""
    calls = [0]
    for name in ("fsync", "replace"):
        real = getattr(os, name)

        def step(*args, _real=real):
            calls[0] += 1
            if calls[0] == n:
                raise Crash
            return _real(*args)

        monkeypatch.setattr(os, name, step)
    return calls


def crashed_run(src, out, errors, monkeypatch, n: int, resume: bool) -> bool:
    """Run until the n-th step; leave the files as a killed process would. True when it crashed."""
    with monkeypatch.context() as patch:
        crash_at_step(patch, n)
        output = DurableOutput.prepare(out, LABELS, input_fingerprint(src), SETTINGS, resume=resume,
                                       errors=errors)
        try:
            output.start()
            summary = JobSummary.from_state(LABELS, output.record.summary)
            run_job(StubClassifier(), iter_rows(src), output, summary, window=4)
        except Crash:
            return True
    return False


def outputs(out, errors):
    return out.read_bytes(), errors.read_bytes() if errors else None


@pytest.mark.parametrize("suffix, with_errors", [(".jsonl", False), (".csv", True), (".parquet", False),
                                                 (".parquet", True)])
def test_crash_at_every_step_then_resume_is_identical(tmp_path, monkeypatch, suffix, with_errors):
    src = write_jsonl(tmp_path / "in.jsonl", [*tickets(9), {"id": "n", "text": None}, *tickets(4)])
    errors = tmp_path / "ref-errors.jsonl" if with_errors else None
    run(src, tmp_path / f"ref{suffix}", errors=errors)
    expected = outputs(tmp_path / f"ref{suffix}", errors)
    n = 1
    while True:
        out = tmp_path / f"run{n}" / f"out{suffix}"
        errors = out.with_name("errors.jsonl") if with_errors else None
        if not crashed_run(src, out, errors, monkeypatch, n, resume=False):
            break  # n is past the last step: the run completed
        if n % 3 == 0 and progress_path(out).exists():  # and crash again, a little later, while resuming
            crashed_run(src, out, errors, monkeypatch, n // 3 + 2, resume=True)
        if progress_path(out).exists() or not out.exists():  # else it died after completing
            summary = run(src, out, errors=errors, resume=True)
            assert summary.num_items == 14 and summary.num_errors == 1
            assert not parts_path(out).exists()
        assert outputs(out, errors) == expected, f"crash before step {n}"
        assert not progress_path(out).exists()
        n += 1
    assert n > 20  # every window's commit was interrupted somewhere


def test_half_written_window_is_dropped_on_resume(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", tickets(13))
    run(src, tmp_path / "ref.jsonl")
    out = tmp_path / "out.jsonl"
    crashed_run(src, out, None, monkeypatch, 8, resume=False)
    with out.open("ab") as f:  # a torn write: part of the next window reached the disk
        f.write(b'{"id": "t8", "label": "bill')
    run(src, out, resume=True)
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()


# --------------------------------------------------------------------------- the real CLI


NUM_ROWS = 200  # 20 windows


def write_tickets(path, n: int, bad_at=()):
    """n synthetic tickets, texts cut to 300 characters (the tiny model is quick on short texts),
    with a broken line and a null text at the given positions."""
    lines = [json.dumps({**t, "text": t["text"][:300]}) for t in synthetic_tickets(n, seed=3)]
    for i, position in enumerate(bad_at):
        lines[position] = ['{"id": "broken", "text": ', '{"id": "nulltext", "text": null}'][i % 2]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_tickets(tmp_path_factory.mktemp("input") / "tickets.jsonl", NUM_ROWS, bad_at=(30, 101))


def classify_args(src, model_dir, out, *extra):
    return ["classify", str(src), "--labels", "billing,technical,account", "--model", str(model_dir),
            "--threads", "1", "--window", str(WINDOW), "--out", str(out), *extra]


@pytest.fixture
def invoke(monkeypatch):
    monkeypatch.setattr(cli.ui, "console", Console(stderr=True, width=1000))

    def invoke(args):
        result = CliRunner().invoke(cli.app, args)
        result.text = " ".join(result.output.split())
        return result

    return invoke


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir, src):
    """Uninterrupted runs, one per output format."""
    folder = tmp_path_factory.mktemp("reference")
    runner = CliRunner()
    for suffix in (".jsonl", ".parquet"):
        result = runner.invoke(cli.app, classify_args(src, model_dir, folder / f"out{suffix}"))
        assert result.exit_code == 0, result.output
    return folder


# The CLI, with one change: after committing window PAUSE_AFTER it sleeps (a minute at most), so a job
# the test means to interrupt cannot finish first, however late a loaded machine schedules the test.
PACED_CLI = """
import os, signal, sys, time
# Ctrl-C as in a terminal: a test run started in the background (`&`, nohup) has SIGINT ignored, which the job
# inherits and Python keeps; it then saw a Ctrl-C only inside a commit (interrupts_deferred): the test failed at times
signal.signal(signal.SIGINT, signal.default_int_handler)
from slimroute import cli
from slimroute.io import durable as output
pause_after, commit = int(os.environ["PAUSE_AFTER"]), output.DurableOutput.commit
def paced(self, *args):
    commit(self, *args)
    if self.record.windows_done == pause_after:
        time.sleep(60)
output.DurableOutput.commit = paced
sys.argv[0] = "slimroute"
sys.exit(cli.main())
"""


def start_cli(args, log, pause_after: int) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "1000", "PAUSE_AFTER": str(pause_after)}
    command = [sys.executable, "-c", PACED_CLI, *args]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def committed_windows(out) -> int:
    try:
        return json.loads(progress_path(out).read_text())["windows_done"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def interrupt_after(args, out, k: int, log, sig=signal.SIGKILL, delay: float = 0, timeout: float = 60) -> int:
    """Run the CLI, send `sig` once k windows are committed (plus `delay` s: during window k + 1 or in the
    pause after it, see PACED_CLI); its exit code."""
    with open(log, "wb") as f:
        proc = start_cli(args, f, pause_after=k + 1)
        deadline = time.monotonic() + timeout
        while committed_windows(out) < k:
            assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before {k} windows"
            assert time.monotonic() < deadline, f"no {k} windows committed after {timeout}s"
            time.sleep(0.005)
        time.sleep(delay)
        assert proc.poll() is None, "the job finished before it could be interrupted"
        proc.send_signal(sig)
        return proc.wait(timeout=timeout)


def check_ids_once(out):
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == NUM_ROWS and len(set(ids)) == NUM_ROWS


def test_kill_9_at_random_points_then_resume_is_identical(tmp_path, model_dir, src, reference, invoke):
    """One job killed twice (after k committed windows plus a random delay: anywhere in the next window,
    classifying or committing), then resumed to the end."""
    rng = random.Random(6)
    out = tmp_path / "out.jsonl"
    for number, k in enumerate((1, 9)):
        args = classify_args(src, model_dir, out, *(["--resume"] if number else []))
        assert interrupt_after(args, out, k, tmp_path / f"log{number}", delay=rng.uniform(0, 0.15)) == -9
        assert progress_path(out).exists()
    result = invoke(classify_args(src, model_dir, out, "--resume"))
    assert result.exit_code == 0, result.output
    assert "resuming:" in result.text and "resumed after" in result.text
    assert f"items │ {NUM_ROWS}" in result.text and "row errors │ 2" in result.text  # the whole job
    assert out.read_bytes() == (reference / "out.jsonl").read_bytes()
    check_ids_once(out)
    assert not progress_path(out).exists()


def test_ctrl_c_then_kill_9_of_a_parquet_job_then_resume_is_identical(tmp_path, model_dir, src, reference,
                                                                       invoke):
    out = tmp_path / "out.parquet"
    args = classify_args(src, model_dir, out)
    assert interrupt_after(args, out, 3, tmp_path / "log0", sig=signal.SIGINT) == 130
    message = " ".join((tmp_path / "log0").read_text().split())
    assert "interrupted:" in message and "window in progress was dropped" in message
    assert "resume with: slimroute classify" in message and message.endswith("--resume")
    record = json.loads(progress_path(out).read_text())
    parts = sorted(parts_path(out).iterdir())  # only whole windows are on disk
    assert [p.name for p in parts] == [f"part-{k:06d}.parquet" for k in range(record["windows_done"])]
    assert record["rows_done"] == WINDOW * record["windows_done"]
    assert interrupt_after([*args, "--resume"], out, 11, tmp_path / "log1", delay=0.05) == -9
    assert not out.exists()
    result = invoke([*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == (reference / "out.parquet").read_bytes()
    assert not parts_path(out).exists() and not progress_path(out).exists()


# --------------------------------------------------------------------------- refusals


@pytest.fixture
def unfinished(tmp_path, model_dir, invoke, monkeypatch):
    """A 40-row job interrupted (Ctrl-C, in process) after two committed windows."""
    src = write_tickets(tmp_path / "small.jsonl", 40)
    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:
        fail_on_commit(patch, 3, KeyboardInterrupt())
        result = invoke(classify_args(src, model_dir, out))
    assert result.exit_code == 130 and "resume with:" in result.text
    assert len(out.read_text().splitlines()) == 2 * WINDOW
    return src, out


def test_an_unfinished_job_is_not_restarted_by_accident(unfinished, model_dir, invoke):
    src, out = unfinished
    before = out.read_bytes()
    result = invoke(classify_args(src, model_dir, out))
    assert result.exit_code == 2 and f"has {2 * WINDOW} rows committed; pass --resume" in result.text
    result = invoke(classify_args(src, model_dir, out, "--resume", "--overwrite"))
    assert result.exit_code == 2 and "not both" in result.text
    assert out.read_bytes() == before


def test_resume_refuses_other_settings_or_another_input(unfinished, model_dir, invoke, tmp_path):
    src, out = unfinished
    result = invoke(classify_args(src, model_dir, out, "--resume", "--window", "5"))
    assert result.exit_code == 2 and "settings differ" in result.text
    assert f"window: was {WINDOW}, now 5" in result.text
    result = invoke(classify_args(src, model_dir, out, "--resume", "--decision", "max-prob"))
    assert result.exit_code == 2 and "engine.decision: was 'greedy', now 'max-prob'" in result.text
    result = invoke(classify_args(src, model_dir, out, "--resume", "--truncate-tokens", "16"))
    assert result.exit_code == 2 and "truncate_tokens: was None, now 16" in result.text
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(src.read_bytes() + b'{"id": "late", "text": "one more ticket"}\n')
    result = invoke(classify_args(edited, model_dir, out, "--resume"))
    assert result.exit_code == 2 and "is not the file the job began with" in result.text


def test_resume_finishes_it_and_overwrite_starts_it_over(unfinished, model_dir, invoke, tmp_path):
    src, out = unfinished
    result = invoke(classify_args(src, model_dir, out, "--resume"))
    assert result.exit_code == 0, result.output
    resumed = out.read_bytes()
    result = invoke(classify_args(src, model_dir, out, "--resume"))
    assert result.exit_code == 2 and "has no progress record" in result.text  # finished: nothing to resume
    result = invoke(classify_args(src, model_dir, out, "--overwrite"))
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == resumed and len(resumed.splitlines()) == 40


def test_resume_with_nothing_to_resume_starts_from_the_first_row(tmp_path, model_dir, invoke):
    src = write_tickets(tmp_path / "small.jsonl", 5)
    result = invoke(classify_args(src, model_dir, tmp_path / "out.jsonl", "--resume"))
    assert result.exit_code == 0 and "nothing to resume" in result.text
    assert "starting from the first row" in result.text
