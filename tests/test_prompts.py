"""The prompts a head may read its features through, and the label rows (accuracy/prompts.py)."""

from __future__ import annotations

import pytest

from slimroute.accuracy.prompts import (
    REPRESENTATION_TEMPLATE,
    check_label_rows,
    check_prompt,
    label_texts,
    prompt_tasks,
)
from slimroute.task import Example, Task

TASK = Task(("card_arrival", "exchange_rate", "top_up_failed"), "Route the banking query.",
            (Example("where is my card", "card_arrival"),), descriptions={"exchange_rate": "the rate we convert at"},
            truncate_tokens=64)


def test_each_prompt_names_its_tasks():
    assert prompt_tasks(TASK, "task") == {"task": TASK}
    represent = prompt_tasks(TASK, "represent")["represent"]
    assert represent.template == REPRESENTATION_TEMPLATE and represent.examples == ()  # chat turns dropped
    assert (represent.labels, represent.descriptions, represent.truncate_tokens) == (
        TASK.labels, TASK.descriptions, TASK.truncate_tokens)
    assert list(prompt_tasks(TASK, "auto")) == ["task", "represent"]  # ties go to the first: the task's own
    own = prompt_tasks(TASK, "Query: {text}\nIntent:")
    assert list(own) == ["template"] and own["template"].template == "Query: {text}\nIntent:"


def test_bad_prompts_and_label_rows_are_named():
    assert check_prompt("auto") == "auto" and check_label_rows("names") == "names"
    with pytest.raises(ValueError, match="--prompt must be one of auto, task, represent or a template"):
        check_prompt("chat")
    with pytest.raises(ValueError, match="must hold {text} exactly once"):
        check_prompt("{text} {text}")
    with pytest.raises(ValueError, match="--label-rows must be one of auto, none, names"):
        check_label_rows("labels")


def test_label_rows_are_the_names_then_the_descriptions():
    texts, labels = label_texts(TASK, ["card_arrival", "exchange_rate", "top_up_failed"])
    assert texts == ["card arrival", "exchange rate", "top up failed", "the rate we convert at"]
    assert labels == ["card_arrival", "exchange_rate", "top_up_failed", "exchange_rate"]
    assert label_texts(Task(("a b", "_")), ["a b", "_"]) == (["a b", "_"], ["a b", "_"])  # never an empty text
