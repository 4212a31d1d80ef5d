"""`slimroute eval` (a predictions file against gold labels) and `slimroute bench` (speed or accuracy rows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.models import ModelNotFoundError


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
    from slimroute.evaluate import evaluate_files
    from slimroute.metrics import check_plotting, plot_confusion
    from slimroute.report import print_evaluation
    from slimroute.stdio import STDIO, spooled_stdin

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


def bench(
    n: int = typer.Option(600, "--n", help="Tickets from the bundled sample."),
    batch_size: int = opt.BATCH, max_batch_tokens: int = opt.MAX_TOKENS, model: str = opt.MODEL,
    threads: int = opt.THREADS,
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
                           ablation, log=lambda line: ui.console.print(line, highlight=False))
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    paths = write_outputs(record, out, command, plot)
    print(markdown(record, command))
    ui.console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def bench_accuracy(n, model, dtype, threads, batch_size, max_batch_tokens, out, command):
    from slimroute import bench_accuracy as accuracy

    try:
        record = accuracy.run_accuracy_bench(n, model, dtype, threads, batch_size, max_batch_tokens,
                                             log=lambda line: ui.console.print(line, highlight=False))
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    paths = accuracy.write_outputs(record, out, command)
    print(accuracy.markdown(record, command))
    ui.console.print("wrote " + ", ".join(str(p) for p in paths.values()))
