"""`slimroute data synth`: the synthetic support tickets (billing / technical / account) with gold labels."""

from __future__ import annotations

from pathlib import Path

import typer

from slimroute.cli import ui
from slimroute.io.records import write_records
from slimroute.io.synth import synthetic_tickets


def data_synth(
    out: Path = typer.Option(..., "--out", "-o"),
    n: int = typer.Option(600, "--n"),
    seed: int = typer.Option(0, "--seed"),
):
    """Write synthetic support tickets (billing / technical / account) with gold labels."""
    tickets = synthetic_tickets(n, seed)
    if out.suffix not in (".jsonl", ".ndjson", ".csv", ".parquet"):
        ui.fail(f"--out must end in .jsonl, .csv or .parquet, got {out.name!r}")
    write_records(out, tickets)
    ui.console.print(f"wrote {len(tickets)} tickets to {out}")
