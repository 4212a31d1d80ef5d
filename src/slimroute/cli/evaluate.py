"""`slimroute eval`: a predictions file (from classify) against gold labels: accuracy, macro-F1, per-label scores, the
confusion matrix, and the floors --min-prob would set."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from slimroute.accuracy.evaluate import evaluate_files
from slimroute.accuracy.metrics import check_plotting, plot_confusion
from slimroute.cli import ui
from slimroute.cli.report import print_evaluation
from slimroute.io.stdio import STDIO, spooled_stdin


def evaluate(
    ctx: typer.Context,
    predictions: Path = typer.Argument(..., help="Predictions from classify (CSV, JSONL or Parquet; - reads "
                                                 "JSONL from standard input, as classify --out - writes it)."),
    gold: Path = typer.Option(..., "--gold", help="File with the gold labels (e.g. classify's input), joined by id."),
    id_column: str = typer.Option("id", "--id-column", help="Id column of --gold (else the row number)."),
    label_column: str = typer.Option("label", "--label-column", help="Gold-label column of --gold."),
    plot: Path = typer.Option(None, "--plot", help="Also write a confusion-matrix PNG (needs matplotlib)."),
    json_out: Path = typer.Option(None, "--json", help="Also write the metrics as JSON."),
    target_accuracy: float = typer.Option(None, "--target-accuracy",
                                          help="Also name the --min-prob that answers the most rows with at least "
                                               "this share of them right (e.g. 0.9)."),
):
    """Accuracy, macro-F1, per-label precision / recall / F1 / support and the confusion matrix."""
    try:
        if plot is not None:
            check_plotting(plot)
        if str(predictions) == STDIO:
            predictions = ctx.with_resource(spooled_stdin(text_column="label"))
        evaluation = evaluate_files(predictions, gold, id_column, label_column, target_accuracy)
    except ValueError as exc:
        ui.fail(str(exc))
    print_evaluation(Console(), evaluation)
    if json_out:
        json_out.write_text(json.dumps(evaluation.to_dict(), indent=2))
    if plot:
        plot_confusion(evaluation.metrics, plot, predictions.name)
    written = [str(p) for p in (json_out, plot) if p]
    if written:
        ui.console.print("wrote " + ", ".join(written))
