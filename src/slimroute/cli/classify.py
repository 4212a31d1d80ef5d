"""`slimroute classify`: a file of rows in, one prediction per row out, committed window by window (local engine, a
server, or Ray). The job itself is backends.local.FileJob; this file holds the flags and what is printed."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import typer

from slimroute.backends.local import FileJob, JobConfig, job_settings
from slimroute.backends.remote import RemoteClassifier
from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.cli.build import (
    build_task,
    calibrated,
    calibration_settings,
    check_fallback,
    engine_config,
    load,
    resolve_dtype,
    task_and_head,
)
from slimroute.cli.report import print_summary
from slimroute.io.rows import InputError
from slimroute.io.stdio import STDIO, StreamOutput, silence_stdout, spooled_stdin
from slimroute.router import Recipe
from slimroute.runtime.packaged import ModelNotFoundError
from slimroute.runtime.threads import physical_cores
from slimroute.task import Task

MANY_MULTI_TOKEN_LABELS = 8  # from this many multi-token labels on, a note suggests shorter names or a head


def classify(
    ctx: typer.Context,
    input: Path = typer.Argument(..., help="CSV, JSONL or Parquet file."),
    out: Path = typer.Option(..., "--out", "-o", help="predictions.jsonl / .csv / .parquet"),
    labels: str = opt.LABELS, instructions: str = opt.INSTRUCTIONS, task: Path = opt.TASK,
    truncate_tokens: int = opt.TRUNCATE,
    model: str = opt.MODEL, dtype: str = opt.DTYPE, threads: int = opt.THREADS, device: str = opt.DEVICE,
    text_column: str = opt.TEXT_COL, id_column: str = opt.ID_COL, label_column: str = opt.LABEL_COL,
    batch_size: int = opt.BATCH, max_batch_tokens: int = opt.MAX_TOKENS, no_prefix_cache: bool = opt.NO_PREFIX,
    no_sort: bool = opt.NO_SORT, decision: str = opt.DECISION, limit: int = opt.LIMIT,
    max_padding: float = opt.MAX_PADDING, recheck_margin: float = opt.RECHECK, head: Path = opt.HEAD,
    examples: Path = opt.EXAMPLES, shots: int = opt.SHOTS, calibrate: str = opt.CALIBRATE,
    calibration_data: Path = opt.CALIBRATION_DATA, min_prob: float = opt.MIN_PROB, fallback_label: str = opt.FALLBACK,
    reference: bool = typer.Option(False, "--reference", help="Use the slow one-at-a-time reference path."),
    summary_json: Path = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
    window: int = typer.Option(2048, "--window", help="Rows read, classified and committed together."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted job after its last window."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
    errors: Path = typer.Option(None, "--errors", help="Write failed rows to this .jsonl, not to --out."),
    server: str = typer.Option(None, "--server", help="Send the rows to a running `slimroute serve` at this URL."),
    server_task: str = typer.Option(None, "--server-task", help="Named task on the server (default task if unset)."),
    api_key: str = typer.Option(None, "--api-key", help="The server's API key (default: $SLIMROUTE_API_KEY)."),
    backend: str = typer.Option("local", "--backend", help="local, or ray (Ray Data; see docs/ray.md)."),
    ray_address: str = typer.Option(None, "--ray-address", help="auto or ray://host:10001 (default: start locally)."),
    replicas: int = typer.Option(1, "--replicas", help="Ray backend: model replicas (actors)."),
    threads_per_replica: int = typer.Option(None, "--threads-per-replica", help="Ray backend: torch threads each."),
):
    """Classify every row of INPUT, streaming, and write one prediction per row, in input order.

    Output is committed window by window; an interrupted job continues with --resume (docs/jobs.md). INPUT - reads
    standard input (JSONL, or one text per line); --out - writes JSONL to standard output."""
    check_combinations(backend, head, server, calibrate, examples, min_prob, fallback_label, truncate_tokens, input,
                       out)
    try:
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding,
                               recheck_margin, min_prob, fallback_label)
    except ValueError as exc:
        ui.fail(str(exc))
    if backend == "ray":
        return classify_on_ray(input, out, labels, instructions, task, model, dtype, text_column, id_column,
                               label_column, config, replicas, threads_per_replica, ray_address, examples, shots,
                               truncate_tokens)
    columns = (text_column, id_column, label_column)
    try:
        job = JobConfig(window, limit, resume, overwrite, errors)
        remote = RemoteClassifier(server, server_task, api_key=api_key) if server else None
        if remote is not None:  # checks the address, the key and the task before anything is written
            the_task = build_task(labels, instructions, task) if (labels or task) else Task(remote.labels())
            the_head, answers = None, list(the_task.labels)
        else:
            the_task, the_head, answers = task_and_head(labels, instructions, task, head, examples, shots,
                                                        text_column, label_column, truncate_tokens)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        calibration.check_data(answers, the_head)  # before the model loads
        check_fallback(config, answers)
        if str(input) == STDIO:  # read to its end into a temporary file, removed when the command ends
            input = ctx.with_resource(spooled_stdin(text_column=text_column))
        choice = None if remote else resolve_dtype(dtype, device)
        settings = job_settings(
            task=the_task, config=config, model=model, dtype=choice.name if choice else dtype, device=device,
            threads=threads or physical_cores(), reference=reference, window=job.window, columns=columns,
            limit=job.limit, errors=job.errors, server=server, server_task=server_task,
            head=the_head.digest if the_head else None, calibration=calibration.fingerprint(),
            served=remote.answer_settings() if remote else None)
        fallback = remote.fallback() if remote else config.fallback
        file_job = FileJob(input, out, answers, settings, job, columns, calibration.on, fallback)
        if remote is None:
            router = load(model, the_task, config, choice, threads, device, the_head)
            classifier = router.reference if reference else router.engine
        else:
            classifier = remote
        if (note := multi_token_note(getattr(classifier, "label_ids", []), the_head)) is not None:
            ui.console.print(note)
        classifier, offsets = calibrated(classifier, calibration, file_job.stored_calibration)
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    except KeyboardInterrupt:
        ui.console.print("interrupted before the first row; nothing was written")
        raise typer.Exit(130) from None
    file_job.summary.dtype = str(choice) if choice else None
    record = file_job.output.record
    if file_job.output.resuming:
        ui.console.print(f"resuming: {record.rows_done} rows ({record.windows_done} windows) are already committed "
                         f"to {file_job.output.out}")
    elif job.resume:
        ui.console.print(f"nothing to resume for {out}; starting from the first row")
    summary = run_with_progress(file_job, classifier, calibration.mode == "batch",
                                offsets.to_dict() if offsets is not None else None)
    cut = remote.task_info().get("truncate_tokens") if remote else the_task.truncate_tokens  # how far texts were read
    if summary.num_truncated:
        ui.console.print(truncation_note(summary.num_truncated, cut))
    written = print_summary(ui.console, summary, classifier, record.calibration, cut)
    if summary_json:
        summary_json.write_text(json.dumps(written, indent=2))
    if job.errors:
        ui.console.print(f"wrote {summary.num_items - summary.num_errors} predictions to {file_job.output.out} "
                         f"and {summary.num_errors} failed rows to {job.errors}")
    else:
        ui.console.print(f"wrote {summary.num_items} predictions to {file_job.output.out}")


def check_combinations(backend, head, server, calibrate, examples, min_prob, fallback_label, truncate_tokens, input,
                       out) -> None:
    """The flags that cannot go together: one line each, exit 2."""
    if backend not in ("local", "ray"):
        ui.fail(f"--backend must be local or ray, got {backend!r}")
    if head and (server or backend != "local"):
        ui.fail("--head runs on the local engine; leave out --server and --backend ray")
    if calibrate != "none" and (backend == "ray" or server):
        ui.fail("--calibrate runs with the local engine only: with --server it is the server's setting "
                "(slimroute serve --calibrate); the Ray backend does not calibrate yet")
    if examples is not None and server:
        ui.fail("with --server the prompt is the server's; start it with slimroute serve --examples")
    if (min_prob is not None or fallback_label is not None) and server:
        ui.fail("with --server the fallback floor is the server's setting: slimroute serve --min-prob")
    if truncate_tokens is not None and server:
        ui.fail("with --server the server's task decides how much of a text is read: slimroute serve "
                "--truncate-tokens")
    if backend == "ray" and STDIO in (str(input), str(out)):
        ui.fail("--backend ray reads and writes files: give INPUT and --out as paths, not -")


def multi_token_note(label_ids, head=None) -> str | None:
    """A note when many labels take several tokens: each is scored exactly, their tokens fed behind every text."""
    multi = sum(len(ids) > 1 for ids in label_ids)
    if head is not None or multi < MANY_MULTI_TOKEN_LABELS:
        return None
    return (f"note: {multi} of the {len(label_ids)} labels are several tokens long; each is scored exactly, their "
            "tokens fed behind every text in extra forward passes. Shorter label names, or a tuned head (slimroute "
            "tune, then --head), answer in one pass.")


def truncation_note(count: int, truncate_tokens: int | None) -> str:
    """The summary's line on cut texts: a warning where the context cut them, a note where the task asked for it."""
    if truncate_tokens is None:
        return (f"[yellow]warning:[/] {count} text(s) were longer than the context and were truncated (their first "
                "tokens were kept)")
    return (f"{count} text(s) were longer than --truncate-tokens {truncate_tokens} (or the context): only their "
            "first tokens were read (truncated: true)")


def classify_on_ray(input, out, labels, instructions, task, model, dtype, text_column, id_column, label_column,
                    config, replicas, threads_per_replica, ray_address, examples=None, shots=None,
                    truncate_tokens=None):
    try:
        from slimroute.backends.ray import run_ray_job  # lazy: ray is an optional extra
    except ImportError as exc:
        ui.fail(f"the Ray backend needs Ray: pip install 'slimroute[ray]' ({exc})")
    try:
        the_task = build_task(labels, instructions, task, examples, shots, text_column, label_column,
                              truncate_tokens)
        recipe = Recipe(the_task, resolve_dtype(dtype, "cpu"), model, config)
        summary = run_ray_job(input, out, recipe, replicas, threads_per_replica, ray_address, text_column, id_column,
                              label_column)
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    ui.console.print_json(json.dumps(summary))


def run_with_progress(file_job: FileJob, classifier, batch_calibration: bool, calibration: dict | None):
    """FileJob.run behind a progress bar. Ctrl-C, a failed write or an input that turns out to be malformed part-way
    end the command, saying what is committed and what to do."""
    output, summary, start = file_job.output, file_job.summary, time.perf_counter()
    try:
        with ui.progress_bar() as bar:
            task_id = bar.add_task("classify", total=file_job.total, completed=output.record.rows_done, rate="-")

            def advance(n):
                done = bar.tasks[0].completed + n - summary.num_resumed  # in this run
                bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

            return file_job.run(classifier, advance, batch_calibration, calibration)
    except BrokenPipeError:  # --out - and the reader stopped reading (`| head`): stop quietly, as Unix tools do
        silence_stdout()
        ui.console.print(f"standard output was closed after {output.record.rows_done} rows; stopped")
        raise typer.Exit(141) from None
    except (KeyboardInterrupt, OSError, ValueError) as exc:  # ValueError: InputError, pyarrow's errors
        record = output.record
        if isinstance(output, StreamOutput):  # nothing kept to resume from
            ui.console.print(f"[yellow]stopped:[/] {exc or type(exc).__name__}; {record.rows_done} rows were "
                             "written to standard output")
            raise typer.Exit(130 if isinstance(exc, KeyboardInterrupt) else 1) from None
        windows = f"{record.windows_done} whole window{'' if record.windows_done == 1 else 's'}"
        committed = (f"{record.rows_done} rows ({windows}) are committed to {output.out}; "
                     "the window in progress was dropped")
        if isinstance(exc, KeyboardInterrupt):
            ui.console.print(f"[yellow]interrupted:[/] {committed}.\nresume with: {resume_command()}")
            raise typer.Exit(130) from None
        if isinstance(exc, InputError):
            ui.fail(f"{exc}\n{committed}; after fixing the input, start over with --overwrite")
        ui.fail(f"{exc}\n{committed}; once the cause is fixed, resume with: {resume_command()}", 1)


def resume_command() -> str:
    """The command line of this run, with --resume."""
    args = [arg for arg in sys.argv[1:] if arg != "--overwrite"]
    command = shlex.join(["slimroute", *args, *([] if "--resume" in args else ["--resume"])])
    return command + (" (with the same input piped in again)" if "-" in args else "")
