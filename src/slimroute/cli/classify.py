"""`slimroute classify`: a file of rows in, one prediction per row out, committed window by window (local engine, a
server, or Ray)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from itertools import islice
from pathlib import Path

import typer

from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.cli.build import (
    build_task,
    calibrated,
    calibration_settings,
    check_fallback,
    engine_config,
    load,
    make_classifier,
    resolve_dtype,
    task_and_head,
)
from slimroute.models import ModelNotFoundError
from slimroute.report import print_summary


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
    from slimroute.data import count_rows, iter_rows
    from slimroute.jobs import JobConfig, JobSummary, job_settings
    from slimroute.models import physical_cores
    from slimroute.output import DurableOutput, input_fingerprint
    from slimroute.stdio import STDIO, StreamOutput, spooled_stdin

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
    try:
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding,
                               recheck_margin, min_prob, fallback_label)
    except ValueError as exc:
        ui.fail(str(exc))
    if backend == "ray" and STDIO in (str(input), str(out)):
        ui.fail("--backend ray reads and writes files: give INPUT and --out as paths, not -")
    if backend == "ray":
        return classify_on_ray(input, out, labels, instructions, task, model, dtype, text_column, id_column,
                               label_column, config, replicas, threads_per_replica, ray_address, examples, shots,
                               truncate_tokens)
    try:
        remote = None
        if server:
            from slimroute.client import RemoteClassifier
            from slimroute.task import Task

            remote = RemoteClassifier(server, server_task, api_key=api_key)
            served = Task(remote.labels())  # checks the address, the key and the task before anything is written
            the_task = build_task(labels, instructions, task) if (labels or task) else served
            the_head, answers = None, list(the_task.labels)
        else:
            the_task, the_head, answers = task_and_head(labels, instructions, task, head, examples, shots,
                                                        text_column, label_column, truncate_tokens)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        calibration.check_data(answers, the_head)  # before the model loads
        check_fallback(config, answers)
        job = JobConfig(window, limit, resume, overwrite, errors)
        if str(input) == STDIO:  # read to its end into a temporary file, removed when the command ends
            input = ctx.with_resource(spooled_stdin(text_column=text_column))
        rows = iter_rows(input, text_column, id_column, label_column)
        choice = None if server else resolve_dtype(dtype, device)
        settings = job_settings(
            task=the_task, config=config, model=model, dtype=choice.name if choice else dtype, device=device,
            threads=threads or physical_cores(), reference=reference, window=job.window,
            columns=(text_column, id_column, label_column), limit=job.limit, errors=job.errors,
            server=server, server_task=server_task, head=the_head.digest if the_head else None,
            calibration=calibration.fingerprint(), served=remote.answer_settings() if remote else None,
        )
        routed = bool(config.fallback or remote and remote.fallback())
        if str(out) == STDIO:
            output = StreamOutput(answers, input_fingerprint(input), settings, resume=job.resume, errors=job.errors,
                                  raw_columns=calibration.on, routed_column=routed)
        else:
            output = DurableOutput.prepare(out, answers, input_fingerprint(input), settings,
                                           resume=job.resume, overwrite=job.overwrite, errors=job.errors,
                                           raw_columns=calibration.on, routed_column=routed)
        classifier = remote or make_classifier(load(model, dtype, threads, device), the_task, config, reference,
                                               the_head)
        if (note := multi_token_note(getattr(classifier, "label_ids", []), the_head)) is not None:
            ui.console.print(note)
        classifier, offsets = calibrated(classifier, calibration, output.record.calibration)
        output.record.calibration = offsets.to_dict() if offsets is not None else None
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    except KeyboardInterrupt:
        ui.console.print("interrupted before the first row; nothing was written")
        raise typer.Exit(130) from None
    if job.limit:
        rows = islice(rows, job.limit)
    total = count_rows(input)
    if total is not None and job.limit:
        total = min(total, job.limit)
    summary = JobSummary.from_state(answers, output.record.summary, remote.fallback() if remote else config.fallback)
    summary.dtype = str(choice) if choice else None
    if output.resuming:
        ui.console.print(f"resuming: {output.record.rows_done} rows ({output.record.windows_done} windows) "
                      f"are already committed to {output.out}")
    elif job.resume:
        ui.console.print(f"nothing to resume for {out}; starting from the first row")
    summary.seconds = run_job_with_progress(classifier, rows, output, summary, job.window, total,
                                            calibration.mode == "batch")
    stats = getattr(classifier, "stats", None)
    if stats is not None:
        summary.padding_overhead = stats.padding.overhead
    cut = remote.task_info().get("truncate_tokens") if remote else the_task.truncate_tokens  # how far texts were read
    if summary.num_truncated:
        ui.console.print(truncation_note(summary.num_truncated, cut))
    record = print_summary(ui.console, summary, classifier, output.record.calibration, cut)
    if summary_json:
        summary_json.write_text(json.dumps(record, indent=2))
    if job.errors:
        ui.console.print(f"wrote {summary.num_items - summary.num_errors} predictions to {output.out} "
                      f"and {summary.num_errors} failed rows to {job.errors}")
    else:
        ui.console.print(f"wrote {summary.num_items} predictions to {output.out}")


MANY_MULTI_TOKEN_LABELS = 8  # BANKING77's 77 intents as labels, all several tokens: 0.74 items/s zero-shot (AMD
# EPYC Zen 4, int8), where a tuned head answers in one pass


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
        from slimroute.backends.ray import run_ray_job
    except ImportError as exc:
        ui.fail(f"the Ray backend needs Ray: pip install 'slimroute[ray]' ({exc})")
    try:
        the_task = build_task(labels, instructions, task, examples, shots, text_column, label_column,
                              truncate_tokens)
        summary = run_ray_job(input, out, the_task, model, config, replicas,
                              threads_per_replica, ray_address, text_column, id_column, label_column, dtype)
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    ui.console.print_json(json.dumps(summary))


def run_job_with_progress(classifier, rows, output, summary, window: int, total: int | None,
                          batch_calibration: bool = False) -> float:
    """jobs.run_job behind a progress bar; seconds taken. Ctrl-C, a failed write or an input that turns
    out to be malformed part-way end the command, saying what is committed and what to do."""
    from slimroute.data import InputError
    from slimroute.jobs import run_job
    from slimroute.stdio import StreamOutput, silence_stdout

    start = time.perf_counter()
    try:
        with output, ui.progress_bar() as bar:
            task_id = bar.add_task("classify", total=total, completed=output.record.rows_done, rate="-")

            def advance(n):
                done = bar.tasks[0].completed + n - summary.num_resumed  # in this run
                bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

            run_job(classifier, rows, output, summary, window, advance, batch_calibration)
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
    return time.perf_counter() - start


def resume_command() -> str:
    """The command line of this run, with --resume."""
    args = [arg for arg in sys.argv[1:] if arg != "--overwrite"]
    command = shlex.join(["slimroute", *args, *([] if "--resume" in args else ["--resume"])])
    return command + (" (with the same input piped in again)" if "-" in args else "")
