"""What the commands print: the run summary, classification metrics and the confusion matrix (rich tables)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from slimroute.accuracy.calibration import Offsets
from slimroute.accuracy.metrics import Metrics
from slimroute.backends.local import classify_rows


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def metrics_rows(table: Table, metrics: Metrics, fallback: str | None = None) -> None:
    table.add_row("accuracy", f"{pct(metrics.accuracy)} of {metrics.num_items}")
    macro = metrics.macro_f1_except(fallback)
    table.add_row("macro-F1", "-" if macro is None else f"{macro:.3f}")


def print_metrics(console: Console, metrics: Metrics, per_label: bool = True, fallback: str | None = None) -> None:
    """The per-label scores (when asked) and the confusion matrix. A fallback label that no item has as gold
    is an answer column only (no scores row, no gold row)."""
    route = fallback if metrics.is_route(fallback) else None
    if per_label:
        scores = Table(title="per label")
        for column in ("label", "precision", "recall", "F1", "support"):
            scores.add_column(column, justify="left" if column == "label" else "right")
        for label, s in metrics.per_label.items():
            if label != route:
                scores.add_row(label, f"{s.precision:.3f}", f"{s.recall:.3f}", f"{s.f1:.3f}", str(s.support))
        console.print(scores)
    matrix = Table(title="confusion (rows: gold, columns: predicted)")
    matrix.add_column("gold")
    for label in metrics.labels:
        matrix.add_column(label, justify="right")
    for label, row in zip(metrics.labels, metrics.confusion, strict=True):
        if label != route:
            matrix.add_row(label, *map(str, row))
    console.print(matrix)


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} items/s"), TimeRemainingColumn(), console=console,
    )


def run_with_progress(console: Console, classifier, rows, label="classify"):
    """(predictions, seconds) of jobs.classify_rows behind a progress bar."""
    start = time.perf_counter()
    with progress_bar(console) as bar:
        task_id = bar.add_task(label, total=len(rows), rate="-")

        def advance(n):
            done = bar.tasks[0].completed + n
            bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

        preds = classify_rows(classifier, rows, advance)
    return preds, time.perf_counter() - start


def print_summary(console: Console, summary, classifier=None, calibration: dict | None = None,
                  truncate_tokens: int | None = None) -> dict:
    """classify's summary: counts, speed, the prompt prefix, calibration, and metrics when gold labels
    exist. truncate_tokens: how far the task read each text (the local task's or the server's; None: whole texts).
    Returns it as a record (for --summary-json)."""
    prompt = getattr(classifier, "prompt", None)  # a remote classifier has none
    prefix_tokens = len(prompt.prefix_ids) if prompt is not None else None
    offsets = Offsets.from_dict(calibration) if calibration else None
    table = Table(title="summary", show_header=False)
    table.add_row("items", str(summary.num_items))
    if summary.dtype:
        table.add_row("dtype", summary.dtype)
    if summary.num_resumed:
        table.add_row("resumed after", f"{summary.num_resumed} (done by the interrupted run)")
    table.add_row("seconds", f"{summary.seconds:.2f}")
    table.add_row("items/s", f"{summary.items_per_s:.2f}")
    table.add_row("row errors", str(summary.num_errors))
    read = f" (texts read up to {truncate_tokens} tokens)" if truncate_tokens else ""
    table.add_row("truncated", str(summary.num_truncated) + read)
    if summary.padding_overhead is not None:
        table.add_row("padding overhead", pct(summary.padding_overhead))
    if prefix_tokens is not None:
        table.add_row("prompt prefix", f"{prefix_tokens} tokens (computed once, cached)")
    if offsets is not None:
        values = ", ".join(f"{label} {value:+.3f}" for label, value in offsets.totals().items())
        table.add_row("calibration", f"{offsets.mode} from {offsets.num_inputs} texts ({offsets.source}); "
                                     f"offsets {values}")
    fallback = summary.fallback.label if summary.fallback is not None else None
    if summary.fallback is not None:
        share = pct(summary.num_fallback / summary.num_items) if summary.num_items else "-"
        table.add_row("fallback", f"{summary.num_fallback} rows ({share}) answered {summary.fallback.label!r}: "
                                  f"probability below {summary.fallback.min_prob:g}")
    metrics = summary.metrics()
    if metrics.num_items:
        metrics_rows(table, metrics, fallback)
        answered = summary.answered_metrics()
        if answered is not None:
            table.add_row("accuracy answered", f"{pct(answered.accuracy)} of {answered.num_items} (the rest: "
                                               f"{fallback!r})")
    console.print(table)
    if metrics.num_items:
        print_metrics(console, metrics, per_label=False, fallback=fallback)
    return {**summary.to_dict(), "prefix_tokens": prefix_tokens, "truncate_tokens": truncate_tokens,
            "calibration": calibration}


def print_evaluation(console: Console, evaluation) -> None:
    table = Table(title="eval", show_header=False)
    metrics_rows(table, evaluation.metrics, evaluation.fallback_label)
    table.add_row("prediction rows", str(evaluation.num_predictions))
    table.add_row("errors (not scored)", str(evaluation.num_errors))
    table.add_row("gold rows without a prediction", str(evaluation.num_missing))
    table.add_row("predictions without a gold label", str(evaluation.num_without_gold))
    cut = evaluation.truncation()
    if cut is not None and cut["rows"]:
        table.add_row("truncated rows", f"{cut['rows']}, {pct(cut['accuracy'])} right (the other "
                                        f"{cut['rest_rows']}: {pct(cut['rest_accuracy'])})")
    answered = evaluation.answered
    if answered is not None:
        label = repr(evaluation.fallback_label) if evaluation.fallback_label else "the fallback label"
        table.add_row("routed to the fallback", f"{evaluation.num_fallback} ({label})")
        table.add_row("accuracy answered", f"{pct(answered.accuracy)} of {answered.num_items}")
    console.print(table)
    print_metrics(console, evaluation.metrics, fallback=evaluation.fallback_label)
    if evaluation.floors:
        floors = Table(title="floors: what --min-prob P would answer (by the probability of the model's choice)")
        for column in ("coverage", "--min-prob", "answered", "accuracy answered"):
            floors.add_column(column, justify="right")
        for point in evaluation.floors:
            floors.add_row(pct(point.coverage), f"{point.min_prob:.3f}", f"{point.answered} of {point.total}",
                           pct(point.accuracy))
        console.print(floors)
    if evaluation.target_accuracy is not None:
        point, wanted = evaluation.target_floor, pct(evaluation.target_accuracy)
        if not evaluation.floors:
            console.print(f"no --min-prob for {wanted}: no scored row has the probability of its label (p_<label>)")
        elif point is None:
            console.print(f"no --min-prob gets the answered rows to {wanted} here (see the floors above)")
        else:
            console.print(f"for {wanted} or better: --min-prob {point.min_prob:.3f} answers {point.answered} of "
                          f"{point.total} rows ({pct(point.coverage)}), {pct(point.accuracy)} of them right")


def print_description_head(console: Console, head, out, scale: float) -> None:
    """What `tune --from-descriptions` made (head.Head, written to the folder out)."""
    table = Table(title="head from label descriptions (nothing fitted)", show_header=False)
    for name, value in [("labels", ", ".join(head.labels)), ("features", f"{head.features} ({head.weight.shape[1]}),"
                        " centred on content-free texts, unit length"),
                        ("prompt", "the task's labels and instructions; the descriptions are the prototypes"),
                        ("scores", f"{scale:g} x cosine similarity to each description")]:
        table.add_row(name, value)
    console.print(table)
    console.print(f"wrote {out / 'head.safetensors'} and {out / 'head.json'}; measure it: slimroute classify ... "
                  f"--head {out} then slimroute eval")
