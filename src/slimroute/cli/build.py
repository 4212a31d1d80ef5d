"""What a command's flags build: the task (and head), the engine config, the calibration, the router."""

from __future__ import annotations

from dataclasses import replace

from slimroute.accuracy.calibration import CalibrationSettings
from slimroute.accuracy.calibration import calibrated as calibrate_classifier
from slimroute.accuracy.examples import with_examples_from
from slimroute.accuracy.head import Head
from slimroute.cli import ui
from slimroute.config import EngineConfig
from slimroute.io.rows import read_rows
from slimroute.router import Router
from slimroute.router import load as load_router
from slimroute.runtime.dtypes import DtypeChoice, choose_dtype
from slimroute.task import Task


def build_task(labels, instructions, task_file, examples=None, shots=None, text_column="text", label_column=None,
               truncate_tokens=None) -> Task:
    if task_file and labels:
        ui.fail("give either --task or --labels, not both")
    if task_file:
        task = Task.from_file(task_file)
    elif labels is None:
        ui.fail("no labels: pass --labels a,b,c or --task task.yaml")
    else:
        task = Task.from_labels(labels, instructions)
    return with_examples_from(task.truncated_to(truncate_tokens), examples, shots, text_column, label_column or "label")


def calibration_settings(calibrate, calibration_data, text_column, label_column) -> CalibrationSettings:
    return CalibrationSettings(calibrate, calibration_data, text_column, label_column or "label")


def calibrated(classifier, calibration: CalibrationSettings, stored: dict | None = None):
    """accuracy.calibration.calibrated behind a status line."""
    if not calibration.on or stored is not None:
        return calibrate_classifier(classifier, calibration, stored)
    with ui.console.status(f"calibrating ({calibration.mode})"):
        return calibrate_classifier(classifier, calibration, stored)


def task_and_head(labels, instructions, task_file, head_dir, examples=None, shots=None, text_column="text",
                  label_column=None, truncate_tokens=None):
    """(task, head or None, answer labels); with a head and neither --labels nor --task, the head's own task.
    --examples go into either prompt (a head then only fits if it was tuned with the same examples)."""
    head = Head.load(head_dir) if head_dir else None
    if head is not None and labels is None and task_file is None:
        the_task = head.task if instructions is None else replace(head.task, instructions=instructions)
        the_task = with_examples_from(the_task.truncated_to(truncate_tokens), examples, shots, text_column,
                                      label_column or "label")
    else:
        the_task = build_task(labels, instructions, task_file, examples, shots, text_column, label_column,
                              truncate_tokens)
    return the_task, head, list(head.labels if head else the_task.labels)


def engine_config(batch_size, max_batch_tokens, no_prefix_cache, no_sort, decision, max_padding=0.0,
                  recheck_margin=None, min_prob=None, fallback_label=None, chunk_tokens=None) -> EngineConfig:
    return EngineConfig(
        batch_size=batch_size, max_batch_tokens=max_batch_tokens or None, prefix_cache=not no_prefix_cache,
        sort=not no_sort, decision=decision, max_padding=max_padding or None, recheck_margin=recheck_margin or None,
        min_prob=min_prob, fallback_label=fallback_label, chunk_tokens=chunk_tokens or None,
    )


def check_fallback(config: EngineConfig, answers) -> None:
    """A fallback label that is one of the answers: ValueError, before the model loads."""
    if config.fallback is not None:
        config.fallback.check(answers)


def resolve_dtype(dtype: str, device: str) -> DtypeChoice:
    """--dtype -> DtypeChoice; a dtype this CPU cannot run raises UnsupportedDtypeError (exit 2)."""
    return choose_dtype(dtype, device=device)


def load(model, task: Task, config: EngineConfig, dtype: str | DtypeChoice, threads, device, head=None) -> Router:
    """The router for these flags, behind a status line; the dtype is chosen here unless it already was."""
    choice = dtype if isinstance(dtype, DtypeChoice) else resolve_dtype(dtype, device)
    with ui.console.status(f"loading {model} ({choice})"):
        return load_router(model, task, dtype=choice, head=head, config=config, threads=threads, device=device)


def read_input(path, text_column, id_column, label_column, limit):
    rows = read_rows(path, text_column, id_column, label_column)
    return rows[:limit] if limit else rows
