"""`slimroute bench`: the speed rows (every dtype this CPU runs, checked against the reference) or, with --accuracy,
the accuracy rows (bench/)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from slimroute.bench import accuracy as accuracy_bench
from slimroute.bench.speed import markdown, run_bench, write_outputs
from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.runtime.packaged import ModelNotFoundError


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
    profile: bool = typer.Option(False, "--profile", help="Also where each dtype's time goes: the top ops by self "
                                                          "time and the decoder GEMMs' share (torch profiler)."),
    accuracy: bool = typer.Option(False, "--accuracy", help="Accuracy rows instead: descriptions, calibration, "
                                                            "few-shot, heads (first --dtype; default auto)."),
):
    """The seed experiment on this CPU: baseline, reference and all techniques combined, for every dtype."""
    command = "slimroute " + " ".join(sys.argv[1:])
    if accuracy:
        return bench_accuracy(min(n, 100) if quick else n, model, (dtype or ["auto"])[0], threads, batch_size,
                              max_batch_tokens, out, command)
    try:
        record = run_bench(n, batch_size, tuple(dtype or ()), model, threads, max_batch_tokens, quick, recheck_margin,
                           ablation, log=lambda line: ui.console.print(line, highlight=False), profile=profile)
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    paths = write_outputs(record, out, command, plot)
    print(markdown(record, command))
    ui.console.print("wrote " + ", ".join(str(p) for p in paths.values()))


def bench_accuracy(n, model, dtype, threads, batch_size, max_batch_tokens, out, command):
    try:
        record = accuracy_bench.run_accuracy_bench(n, model, dtype, threads, batch_size, max_batch_tokens,
                                             log=lambda line: ui.console.print(line, highlight=False))
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    paths = accuracy_bench.write_outputs(record, out, command)
    print(accuracy_bench.markdown(record, command))
    ui.console.print("wrote " + ", ".join(str(p) for p in paths.values()))
