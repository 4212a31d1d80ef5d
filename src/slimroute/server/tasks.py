"""The server's task file: one task, or several named tasks served by one process.

Two shapes are accepted (YAML or JSON, chosen by the file extension as in `slimroute classify`):

    # one task, named after the file (tickets.yaml -> "tickets")
    labels: [billing, technical, account]   # or {name, description} mappings
    instructions: Classify the support ticket into one category.
    examples:
      - {text: "I was charged twice", label: billing}

    # several tasks; `default` names the one behind POST /v1/classify (else the first)
    default: tickets
    tasks:
      tickets:
        labels: [billing, technical, account]
        instructions: ...
        examples: [...]
      urgency:
        labels: [low, high]

Each task's fields are exactly those of `Task.from_dict` (labels required; instructions and
examples optional). Task names appear in URLs, so they are limited to letters, digits, `_`, `-`, `.`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slimroute.accuracy.calibration import check_head
from slimroute.accuracy.examples import with_examples_from
from slimroute.task import Task, load_task_file

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class TaskSet:
    tasks: dict[str, Task]
    default: str

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("tasks: no task given")
        for name in self.tasks:
            check_task_name(name)
        if self.default not in self.tasks:
            raise ValueError(f"default: task {self.default!r} is not one of {sorted(self.tasks)}")


def check_task_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(f"task name {name!r} must be 1-64 letters, digits, '_', '-' or '.'")
    return name


def task_set_from_dict(data: dict, file_stem: str = "default") -> TaskSet:
    if not isinstance(data, dict):
        raise ValueError(f"task file: expected a mapping, got {type(data).__name__}")
    if "tasks" not in data:
        name = check_task_name(str(data.get("name", file_stem)))
        return TaskSet({name: Task.from_dict(data, name)}, name)
    unknown = set(data) - {"tasks", "default"}
    if unknown:
        raise ValueError(f"task file: unknown top-level field(s) {sorted(unknown)}; allowed: tasks, default")
    entries = data["tasks"]
    if not isinstance(entries, dict) or not entries:
        raise ValueError("tasks: expected a non-empty mapping of task name -> task")
    tasks = {}
    for name, entry in entries.items():
        check_task_name(name)
        try:
            tasks[name] = Task.from_dict({**entry, "name": name} if isinstance(entry, dict) else entry, name)
        except ValueError as exc:
            raise ValueError(f"tasks.{name}: {exc}") from exc
    return TaskSet(tasks, str(data.get("default", next(iter(tasks)))))


def load_task_set(path: str | Path) -> TaskSet:
    return task_set_from_dict(load_task_file(path), Path(path).stem)


def with_accuracy_options(task_set: TaskSet, examples=None, shots: int | None = None, text_column: str = "text",
                          label_column: str = "label", calibration=None, head=None,
                          truncate_tokens: int | None = None) -> TaskSet:
    """The task set with `serve --examples` and `--truncate-tokens` (every task) applied, after checking
    `serve --calibrate` can run: the examples and calibration data need a single task, batch calibration needs
    data (offsets are estimated at startup, never from requests, so an answer does not depend on which
    requests came first), and the calibration data is read and checked here, before the model loads
    (calibration with a tuned `head`: refused, see calibration.check_head)."""
    check_head(head, calibration)
    has_data = calibration is not None and calibration.data is not None
    if (examples is not None or has_data) and len(task_set.tasks) > 1:
        raise ValueError(f"--examples and --calibration-data need a single task; the task file has "
                         f"{len(task_set.tasks)}")
    if calibration is not None and calibration.mode == "batch" and not has_data:
        raise ValueError("on a server, --calibrate batch needs --calibration-data: texts whose mean label "
                         "log-probs are estimated at startup (never from requests, so an answer does not "
                         "depend on who came first)")
    tasks = {name: with_examples_from(task.truncated_to(truncate_tokens), examples, shots, text_column, label_column)
             for name, task in task_set.tasks.items()}
    if calibration is not None:
        for task in tasks.values():
            calibration.check_data(task.labels)
    return TaskSet(tasks, task_set.default)
