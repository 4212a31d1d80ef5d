"""`slimroute tune`: a head from labelled rows (cross-validated) or from the task's label descriptions."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.table import Table

from slimroute.accuracy import tune as tuning
from slimroute.accuracy.head import check_out
from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.cli.build import build_task, engine_config, load, read_input
from slimroute.cli.report import print_description_head
from slimroute.runtime.packaged import ModelNotFoundError
from slimroute.task import DEFAULT_INSTRUCTIONS, Task


def tune(
    input: Path = typer.Argument(None, help="Labelled CSV, JSONL or Parquet file (none with --from-descriptions)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the head (head.safetensors + head.json)."),
    text_column: str = opt.TEXT_COL,
    label_column: str = typer.Option("label", "--label-column", help="The column with each row's label."),
    labels: str = opt.LABELS, instructions: str = opt.INSTRUCTIONS, task: Path = opt.TASK,
    truncate_tokens: int = opt.TRUNCATE,
    model: str = opt.MODEL, dtype: str = opt.DTYPE, threads: int = opt.THREADS, device: str = opt.DEVICE,
    batch_size: int = opt.BATCH, max_batch_tokens: int = opt.MAX_TOKENS, no_prefix_cache: bool = opt.NO_PREFIX,
    with_label_logprobs: bool = typer.Option(False, "--with-label-logprobs",
                                             help="Also use the task labels' log-probs as features (the task's "
                                                  "labels must then be the rows' labels)."),
    prompt: str = typer.Option("represent", "--prompt",
                               help="The prompt the features are read through: represent (a raw prompt written for "
                                    "representation, prompts.REPRESENTATION_TEMPLATE), task (the task's chat "
                                    "prompt), auto (both, chosen by cross-validation: twice the reading), or a "
                                    "template of your own holding {text}."),
    label_rows: str = typer.Option("auto", "--label-rows",
                                   help="Add each label's name (and description) as one more training row: auto "
                                        "(by cross-validation), none or names."),
    per_label: int = typer.Option(None, "--per-label",
                                  help="Tune on N rows of each label only: the first N in file order."),
    sample_seed: int = typer.Option(None, "--sample-seed",
                                    help="With --per-label: a random N of each label, drawn with this seed."),
    states: str = typer.Option("auto", "--states",
                               help="Hidden states as features: 'last' (the item's last token), 'last+mean' "
                                    "(also their mean over the item's tokens; same forward pass) or auto (last+mean "
                                    "for a chat prompt, last for a template)."),
    classifier: str = typer.Option("auto", "--classifier",
                                   help="auto (the best in cross-validation), logistic or lda."),
    layer: str = typer.Option("auto", "--layer",
                              help="Also use the mean of one decoder layer's output over the item's tokens: auto "
                                   "(a chat prompt: none, or the layer a quarter, half or three quarters up, by "
                                   "cross-validation; a template: none), none, or a layer number. Same forward "
                                   "pass."),
    folds: int = typer.Option(5, "--folds", help="Cross-validation folds (each label needs this many rows)."),
    from_descriptions: bool = typer.Option(False, "--from-descriptions",
                                           help="No labelled rows: build the head from the label descriptions of "
                                                "--task (cosine similarity of mean hidden states)."),
    limit: int = opt.LIMIT,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the head already in --out."),
):
    """Tune a head on labelled rows: a linear classifier (logistic regression at a few regularisation
    strengths, or shrinkage LDA, chosen by cross-validation) on the model's final hidden states, read through
    --prompt. Prints the cross-validated accuracy and macro-F1 and writes OUT.

    The task is --task/--labels if given, else the rows' labels (sorted) with --instructions.
    With --from-descriptions and no input, the head comes from --task's label descriptions instead."""
    if from_descriptions:
        return tune_from_descriptions(input, out, labels, instructions, task, model, dtype, threads, device,
                                      engine_config(batch_size, max_batch_tokens, no_prefix_cache, False, "greedy"),
                                      overwrite, truncate_tokens)
    try:
        if input is None:
            raise ValueError("no input: give a labelled file to tune on, or --from-descriptions with a --task "
                             "whose labels are described")
        check_out(out, overwrite)
        if states not in ("auto", "last", "last+mean"):
            raise ValueError(f"--states must be 'auto', 'last' or 'last+mean', got {states!r}")
        if sample_seed is not None and per_label is None:
            raise ValueError("--sample-seed draws --per-label rows; give --per-label N too")
        config = tuning.TuneConfig(folds=folds, with_label_logprobs=with_label_logprobs,
                                   with_mean=None if states == "auto" else states == "last+mean",
                                   classifier=classifier, layer=tuning.parse_layer(layer), prompt=prompt,
                                   label_rows=label_rows)
        texts, golds = tuning.labelled_rows(read_input(input, text_column, "id", label_column, limit), label_column)
        if per_label is not None:
            texts, golds = picked_rows(texts, golds, per_label, sample_seed)
        classes = tuning.check_labelled(texts, golds, config.folds)
        the_task = (build_task(labels, instructions, task, truncate_tokens=truncate_tokens) if labels or task
                    else Task(tuple(classes), instructions or DEFAULT_INSTRUCTIONS).truncated_to(truncate_tokens))
        tuning.check_label_features(the_task, classes, with_label_logprobs)
        settings = engine_config(batch_size, max_batch_tokens, no_prefix_cache, False, "greedy")
        router = load(model, the_task, settings, dtype, threads, device)
        engine, loaded = router.engine, router.loaded
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    with ui.progress_bar() as bar:
        task_id = bar.add_task("features", total=tuning.feature_rows(the_task, config, classes, len(texts)), rate="-")
        start = time.perf_counter()

        def advance(n):
            done = bar.tasks[0].completed + n
            bar.update(task_id, advance=n, rate=f"{done / (time.perf_counter() - start):.1f}")

        meta = tuning.head_meta(model, loaded.precision, input)
        head, report = tuning.tune_head(engine, texts, golds, config, classes, meta, advance)
    head.save(out, overwrite)
    table = Table(title=f"tuned head ({report.folds}-fold cross-validation)", show_header=False)
    for name, value in tuning.summary_rows(head, report, golds):
        table.add_row(name, value)
    ui.console.print(table)
    ui.console.print(f"wrote {out / 'head.safetensors'} and {out / 'head.json'}")


def picked_rows(texts: list[str], golds: list[str], n: int, seed: int | None) -> tuple[list[str], list[str]]:
    """--per-label: n rows of each label (tune.per_label), saying which labels have fewer."""
    keep, short = tuning.per_label(golds, n, seed)
    if short:
        listed = ", ".join(f"{label!r} ({count})" for label, count in list(short.items())[:5])
        more = f" and {len(short) - 5} more" if len(short) > 5 else ""
        ui.console.print(f"note: {len(short)} label(s) have fewer than {n} rows, all of them taken: {listed}{more}")
    how = f"a random {n} (seed {seed})" if seed is not None else f"the first {n}"
    ui.console.print(f"tuning on {how} rows of each label: {len(keep)} of {len(texts)} rows")
    return [texts[i] for i in keep], [golds[i] for i in keep]


def tune_from_descriptions(input, out, labels, instructions, task, model, dtype, threads, device, config, overwrite,
                           truncate_tokens=None):
    try:
        if input is not None:
            raise ValueError("--from-descriptions takes no input file: it fits nothing. To measure the head on "
                             "labelled rows, classify them with --head and run `slimroute eval`")
        if task is None:
            raise ValueError("--from-descriptions needs --task: a task file whose labels have descriptions")
        check_out(out, overwrite)
        described = build_task(labels, instructions, task, truncate_tokens=truncate_tokens)
        prompt = tuning.description_task(described)
        router = load(model, prompt, config, dtype, threads, device)
        engine, loaded = router.engine, router.loaded
    except (ValueError, ModelNotFoundError) as exc:
        ui.fail(str(exc))
    with ui.console.status(f"scoring {len(prompt.labels)} descriptions"):
        head = tuning.description_head(engine, dict(described.descriptions), tuning.head_meta(model, loaded.precision,
                                                                                              task),
                                       truncate_tokens=described.truncate_tokens)
    head.save(out, overwrite)
    print_description_head(ui.console, head, out, tuning.DESCRIPTION_SCALE)
