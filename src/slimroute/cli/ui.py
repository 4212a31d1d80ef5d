"""What the commands print to: one stderr console, the one-line usage error (exit 2), progress bars."""

import typer
from rich.console import Console

console = Console(stderr=True)


def fail(message: str, code: int = 2):
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # one line, whatever the terminal's width
    raise typer.Exit(code)


def progress_bar():
    from slimroute.report import progress_bar as bar

    return bar(console)


def run_with_progress(classifier, rows, label="classify"):
    from slimroute.report import run_with_progress as run

    return run(console, classifier, rows, label)
