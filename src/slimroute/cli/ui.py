"""What the commands print to: one stderr console, the one-line usage error (exit 2), progress bars."""

import typer
from rich.console import Console

from slimroute.cli import report

console = Console(stderr=True)


def fail(message: str, code: int = 2):
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # one line, whatever the terminal's width
    raise typer.Exit(code)


def progress_bar():
    return report.progress_bar(console)


def run_with_progress(classifier, rows, label="classify"):
    return report.run_with_progress(console, classifier, rows, label)
