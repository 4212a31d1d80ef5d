"""Few-shot examples from a labelled file: K per label, chosen deterministically, into the cached prefix.

Selection: the first K rows of each label in file order; they are placed label by label, round robin in
the task's label order (a1 b1 c1 a2 b2 c2 ...), so no label always sits next to the item. A label in the
file that is not a task label, an empty file, or fewer than K rows for a label is an error.
"""

from __future__ import annotations

from dataclasses import replace

from slimroute.io.rows import read_labelled
from slimroute.task import Example, Task

DEFAULT_SHOTS = 2


def select_examples(pairs: list[tuple[str, str]], labels, shots: int) -> tuple[Example, ...]:
    """`shots` examples per label from (text, label) pairs, in the order described above."""
    if not isinstance(shots, int) or shots < 1:
        raise ValueError(f"shots must be an integer >= 1, got {shots!r}")
    labels = tuple(labels)
    if not pairs:
        raise ValueError("the examples file has no rows")
    unknown = sorted({label for _, label in pairs if label not in labels})
    if unknown:
        raise ValueError(f"examples file: label {unknown[0]!r} is not one of the task's labels {list(labels)}")
    chosen = {label: [text for text, gold in pairs if gold == label][:shots] for label in labels}
    short = [label for label in labels if len(chosen[label]) < shots]
    if short:
        have = len(chosen[short[0]])
        raise ValueError(f"examples file has {have} example(s) of {short[0]!r}; --shots {shots} needs {shots} of "
                         "every label (add rows or lower --shots)")
    return tuple(Example(chosen[label][k], label) for k in range(shots) for label in labels)


def read_examples(path, labels, shots: int = DEFAULT_SHOTS, text_column: str = "text",
                  label_column: str = "label") -> tuple[Example, ...]:
    return select_examples(read_labelled(path, text_column, label_column, "examples file"), labels, shots)


def with_examples_from(task: Task, path, shots: int | None = None, text_column: str = "text",
                       label_column: str = "label") -> Task:
    """The task with `shots` (default 2) examples per label from `path` in its prompt; the task itself
    when `path` is None."""
    if path is None:
        if shots is not None:
            raise ValueError("--shots needs --examples labelled.csv")
        return task
    shots = DEFAULT_SHOTS if shots is None else shots
    if task.examples:
        raise ValueError("the task file already has examples; give examples there or with --examples, not both")
    return replace(task, examples=read_examples(path, task.labels, shots, text_column, label_column))
