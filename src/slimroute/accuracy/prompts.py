"""The prompts a tuned head may read its features through, and the label rows that may join its training rows.

The task's own chat prompt is written for the model to *answer* a label. A raw prompt written for
*representation* — the text in quotes, then the start of a short summary for the model to write, its last
token's state standing for the whole text (PromptEOL: Jiang et al. 2023) — separates intents far better with few
rows: on BANKING77 (qwen2.5-coder-0.5b, int8, valid split) REPRESENTATION_TEMPLATE's final states gave 70.0 / 78.6 /
85.5% at 5 / 10 / 20 rows per intent, where the chat prompt's gave ~73% at 8 (docs/accuracy.md). It has no special
token, so its prefix is empty (task.Prompt): nothing to cache, and nothing lost — the text starts four tokens in.

Label rows: each label's name (underscores as spaces) and, where the task describes it, its description, run
through the same prompt as one more training row of that label — only ever added to the rows a classifier is
fitted on, never to the rows it is scored on (fit.py).
"""

from __future__ import annotations

from dataclasses import replace

from slimroute.task import Task, check_template

REPRESENTATION_TEMPLATE = 'Customer message: "{text}"\nTopic (a few words): "'
PROMPTS = ("auto", "task", "represent")  # or a template holding {text}
LABEL_ROWS = ("auto", "none", "names")  # auto: with and without, by cross-validation


def check_prompt(prompt: str) -> str:
    """A PROMPTS name, or a template (exactly one {text})."""
    if prompt in PROMPTS:
        return prompt
    if not isinstance(prompt, str) or "{text}" not in prompt:
        raise ValueError(f"--prompt must be one of {', '.join(PROMPTS)} or a template holding {{text}}, got "
                         f"{prompt!r}")
    return check_template(prompt)


def check_label_rows(label_rows: str) -> str:
    if label_rows not in LABEL_ROWS:
        raise ValueError(f"--label-rows must be one of {', '.join(LABEL_ROWS)}, got {label_rows!r}")
    return label_rows


def prompt_tasks(task: Task, prompt: str) -> dict[str, Task]:
    """name -> the task whose prompt the features are read through: "task" (the task as given, chat or template),
    "represent" (REPRESENTATION_TEMPLATE), "template" (the template given as `prompt`); auto: task and represent.
    Another prompt keeps the task's labels, descriptions and truncate_tokens, and drops its few-shot examples."""
    def templated(template: str) -> Task:
        return replace(task, examples=(), template=template)

    prompt = check_prompt(prompt)
    if prompt == "task":
        return {"task": task}
    if prompt == "represent":
        return {"represent": templated(REPRESENTATION_TEMPLATE)}
    if prompt == "auto":
        return {"task": task, "represent": templated(REPRESENTATION_TEMPLATE)}
    return {"template": templated(prompt)}


def label_texts(task: Task, classes: list[str]) -> tuple[list[str], list[str]]:
    """(texts, labels) of the label rows: each class's name with underscores as spaces, then each description the
    task gives a class."""
    described = dict(task.descriptions)
    rows = [(" ".join(label.replace("_", " ").split()) or label, label) for label in classes]
    rows += [(described[label], label) for label in classes if label in described]
    return [text for text, _ in rows], [label for _, label in rows]
