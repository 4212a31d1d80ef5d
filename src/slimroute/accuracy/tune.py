"""Tune a head on labelled texts: features from the fast engine, a cross-validated linear classifier (fit.py).

`tune_head(engine, texts, labels)`: every text runs once through the engine (batched, prefix cache) under the
prompt the config names (prompts.py: the task's own chat prompt, the representation template, or both for "auto"),
and its head features (engine.features) go to fit.fit_options, which chooses the prompt, the label rows and the
middle layer with LDA under stratified cross-validation, then the classifier (logistic regression over a grid of C,
or shrinkage LDA), all on these rows alone. The head records the chosen prompt in its task, so classify, verify,
the server and the estimator read texts through it.

Features by prompt (TuneConfig.resolved): the task's chat prompt reads the last state and the mean over the item's
tokens, and, by CV, the mean of a layer a quarter, half or three quarters up (on BANKING77 at 8 per intent the
quarter layer added 4 points of CV accuracy); a template reads the last state alone (under the representation
prompt, token means and middle layers scored lower).
"""

from __future__ import annotations

import random
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, replace
from importlib.metadata import version

import numpy as np
import torch

from slimroute.accuracy.calibration import CONTENT_FREE_TEXTS
from slimroute.accuracy.fit import Candidate, CVReport, fit_options
from slimroute.accuracy.head import Head, task_spec
from slimroute.accuracy.prompts import check_label_rows, check_prompt, label_texts, prompt_tasks
from slimroute.runtime.fingerprint import identity
from slimroute.runtime.packaged import PACKAGED_MODELS
from slimroute.task import Task

DEFAULT_CS = (0.01, 0.03, 0.1, 0.3, 1.0)
CLASSIFIERS = ("auto", "logistic", "lda")  # auto: whichever scores best in cross-validation
LAYER_DEPTHS = (0.25, 0.5, 0.75)  # where layer="auto" looks, as fractions of the model's depth


@dataclass(frozen=True)
class TuneConfig:
    folds: int = 5  # stratified cross-validation folds; every label needs at least this many examples
    cs: tuple[float, ...] = DEFAULT_CS  # inverse regularisation strengths tried
    with_label_logprobs: bool = False  # add the task labels' log-probs to the hidden state as features
    # add the mean of the item's hidden states to its last one (head.item_states); None: the prompt's own choice
    # (resolved: yes for a chat prompt, no for a template)
    with_mean: bool | None = None
    classifier: str = "auto"  # one of CLASSIFIERS
    # a decoder layer whose mean joins the features: "auto" (by CV for a chat prompt; none for a template), None, k
    layer: int | str | None = "auto"
    prompt: str = "represent"  # prompts.PROMPTS, or a template holding {text}
    label_rows: str = "auto"  # prompts.LABEL_ROWS: the label names (and descriptions) as training rows
    max_iter: int = 2000
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.folds, int) or self.folds < 2:
            raise ValueError(f"folds must be an integer >= 2, got {self.folds!r}")
        if not self.cs or any(not c > 0 for c in self.cs):
            raise ValueError(f"cs must be a non-empty list of positive numbers, got {self.cs!r}")
        object.__setattr__(self, "cs", tuple(float(c) for c in self.cs))
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {', '.join(CLASSIFIERS)}, got {self.classifier!r}")
        if not (self.layer in ("auto", None) or (isinstance(self.layer, int) and self.layer >= 1)):
            raise ValueError(f"layer must be 'auto', None or a decoder layer number >= 1, got {self.layer!r}")
        check_prompt(self.prompt)
        check_label_rows(self.label_rows)

    def resolved(self, task: Task) -> TuneConfig:
        """This config for features read through `task`'s prompt: with_mean None and layer "auto" settled (module
        docstring)."""
        template = task.template is not None
        with_mean = (not template) if self.with_mean is None else self.with_mean
        return replace(self, with_mean=with_mean, layer=None if template and self.layer == "auto" else self.layer)

    def layer_options(self, depth: int) -> list[tuple[int, ...]]:
        """The layer sets tried, in the order ties are broken: () is the final states alone. depth: the model's
        number of decoder layers (a layer must be below it: the last one's output is the final state)."""
        if self.layer is None:
            return [()]
        if self.layer != "auto":
            if self.layer >= depth:
                raise ValueError(f"layer {self.layer}: the model has {depth} decoder layers; give 1 to {depth - 1}")
            return [(self.layer,)]
        return [()] + [(k,) for k in sorted({max(1, round(depth * f)) for f in LAYER_DEPTHS}) if k < depth]

    @property
    def states(self) -> str:
        """The hidden states the head reads (head.item_states), once resolved."""
        return "last+mean" if self.with_mean else "last"

    @property
    def features(self) -> str:
        """The head's feature set (head.FEATURE_SETS)."""
        return "hidden" + ("+mean" if self.with_mean else "") + ("+label-logprobs" if self.with_label_logprobs else "")

    def candidates(self) -> dict[str, tuple[str, float | None]]:
        """name -> (classifier, C), in the order ties are broken (stronger regularisation first)."""
        found = {}
        if self.classifier in ("auto", "logistic"):
            found.update({f"logistic C={c:g}": ("logistic", c) for c in self.cs})
        if self.classifier in ("auto", "lda"):
            found["lda"] = ("lda", None)
        return found


def labelled_rows(rows, label_column: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of input rows (data.Row); a row without a usable text or label is a ValueError."""
    texts, labels = [], []
    for row in rows:
        if row.error:
            raise ValueError(f"row {row.index} (id {row.id}): {row.error}; every row needs a text to tune on")
        if row.gold is None:
            raise ValueError(f"row {row.index} (id {row.id}) has no label in column {label_column!r}")
        texts.append(row.text)
        labels.append(row.gold)
    return texts, labels


def check_labelled(texts: list[str], labels: list[str], folds: int) -> list[str]:
    """The distinct labels, sorted; ValueError naming the problem when tuning cannot work on these rows."""
    if len(texts) != len(labels):
        raise ValueError(f"got {len(texts)} texts but {len(labels)} labels")
    if not texts:
        raise ValueError("no labelled rows: the input is empty")
    for i, (text, label) in enumerate(zip(texts, labels, strict=True)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"row {i}: the text is empty or not a string ({text!r})")
        if not isinstance(label, str) or not label.strip():
            raise ValueError(f"row {i}: the label is empty or not a string ({label!r})")
    counts = Counter(labels)
    if len(counts) < 2:
        raise ValueError(f"only one label ({next(iter(counts))!r}) in the rows; a head needs at least two")
    label, fewest = min(counts.items(), key=lambda kv: (kv[1], kv[0]))
    if fewest < folds:
        raise ValueError(f"label {label!r} has {fewest} example{'s' if fewest != 1 else ''}; tuning needs at least "
                         f"{folds} per label ({folds}-fold cross-validation)")
    return sorted(counts)


def per_label(labels: list[str], n: int, seed: int | None = None) -> tuple[list[int], dict[str, int]]:
    """(indices, short): n rows of each label, in file order — its first n, or with a seed a seeded random n — and
    {label: its number of rows} for each label that has fewer than n (all of its rows are taken)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--per-label must be a number of rows >= 1, got {n!r}")
    rows: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        rows.setdefault(label, []).append(i)
    rng = random.Random(seed)
    kept = [i for found in rows.values()
            for i in (found[:n] if seed is None else sorted(rng.sample(found, min(n, len(found)))))]
    return sorted(kept), {label: len(found) for label, found in sorted(rows.items()) if len(found) < n}


def tune_head(engine, texts: list[str], labels: list[str], config: TuneConfig | None = None,
              classes: list[str] | None = None, meta: dict | None = None, progress=None) -> tuple[Head, CVReport]:
    """Fit a head for `engine`'s model and tokenizer, reading texts through the prompt(s) config.prompt names for
    engine's task (prompts.prompt_tasks). classes: the head's labels in order (default: the distinct labels,
    sorted); meta: extra head.json fields (model spec, command); progress(n): n more texts read."""
    config = config or TuneConfig()
    found = check_labelled(texts, labels, config.folds)
    classes = list(classes or found)
    if set(classes) != set(found):
        raise ValueError(f"classes {classes} are not the labels found in the rows {found}")
    check_label_features(engine.task, classes, config.with_label_logprobs)
    index = {label: j for j, label in enumerate(classes)}
    extra_texts, extra_labels = label_texts(engine.task, classes) if config.label_rows != "none" else ([], [])
    depth, hidden = int(engine.model.config.num_hidden_layers), int(engine.model.config.hidden_size)
    tasks, candidates = prompt_tasks(engine.task, config.prompt), {}
    for name, task in tasks.items():
        reader = engine if task == engine.task else engine.with_task(task)
        resolved = config.resolved(task)
        options = resolved.layer_options(depth)
        layers = tuple(sorted({k for option in options for k in option}))
        features = reader.features(texts + extra_texts, config.with_label_logprobs, progress, resolved.states,
                                   layers).numpy()  # (N + M, F)
        candidates[name] = Candidate(features[:len(texts)], features[len(texts):], resolved, options, hidden)
    label_rows = ["none", "names"] if config.label_rows == "auto" else [config.label_rows]
    prompt, tensors, report = fit_options(candidates, np.array([index[label] for label in labels]),
                                          np.array([index[label] for label in extra_labels], dtype=int), label_rows)
    task = tasks[prompt]
    info = {"identity": identity(engine.model, engine.tokenizer, task), "task": task_spec(task),
            "cv": report.to_dict(), "num_examples": len(texts), "examples_per_label": dict(sorted(Counter(labels)
            .items())), "slimroute": version("slimroute"), **(meta or {})}
    if report.label_rows == "names":
        info["label_rows"] = extra_texts
    return (Head(tuple(classes), **tensors, features=candidates[prompt].config.features, meta=info,
                 layers=report.layers), report)


def feature_rows(task: Task, config: TuneConfig, classes: list[str], num_texts: int) -> int:
    """How many texts tune_head reads (its progress total): the rows and the label rows, under each prompt."""
    extra = len(label_texts(task, classes)[0]) if config.label_rows != "none" else 0
    return len(prompt_tasks(task, config.prompt)) * (num_texts + extra)


def parse_layer(text: str) -> int | str | None:
    """--layer: "auto", "none" or a decoder layer number."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--layer must be auto, none or a decoder layer number >= 1, got {text!r}")
    return int(text)


DESCRIPTION_SCALE = 100.0  # logits = scale x cosine similarity: sets the head's probabilities, not its decisions


def description_task(task: Task) -> Task:
    """The prompt a description head reads items through: the task's labels, instructions and examples, its
    label descriptions left out (they become the prototypes instead; in the system prompt too they cost
    accuracy: 88% against 98.5% on 200 sample tickets, int8). The task's truncate_tokens is left out too: the
    descriptions are read whole (description_head records the cap for the items)."""
    check_described(task.labels, dict(task.descriptions))
    return Task(task.labels, task.instructions, task.examples)


def description_head(engine, descriptions: dict[str, str], meta: dict | None = None,
                     scale: float = DESCRIPTION_SCALE, centre_texts: tuple[str, ...] = CONTENT_FREE_TEXTS,
                     truncate_tokens: int | None = None) -> Head:
    """A head from label descriptions alone, no labelled rows (`slimroute tune --from-descriptions`).

    engine: the model and prompt (description_task); descriptions: label -> text, for each of its task's labels.
    Each "label: description" runs through the engine as an item; the mean of its final hidden states over its
    tokens is the label's prototype. The content-free texts run too; their average is the centre. The head
    scores an item by the cosine similarity between its mean state and each prototype, both taken from the
    centre: features "mean", standardised with mean = centre and std = 1, normalised to unit length; weight
    rows = scale x the unit vectors from the centre to the prototypes; bias 0. truncate_tokens: the cap the head's
    task records for the items it will score (the descriptions themselves are read whole by the engine's task)."""
    labels = engine.task.labels
    check_described(labels, descriptions)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    texts = [f"{label}: {descriptions[label]}" for label in labels]
    prototypes = engine.features(texts, states="mean")  # (C, H)
    centre = engine.features(list(centre_texts), states="mean").mean(dim=0)  # (H,)
    directions = prototypes - centre
    weight = scale * directions / directions.norm(dim=1, keepdim=True)
    info = {"identity": identity(engine.model, engine.tokenizer, engine.task),
            "task": task_spec(replace(engine.task, truncate_tokens=truncate_tokens)),
            "from_descriptions": {"prototypes": texts, "centre_texts": list(centre_texts), "scale": scale},
            "slimroute": version("slimroute"), **(meta or {})}
    return Head(labels, weight, torch.zeros(len(labels), dtype=torch.float64), centre, torch.ones_like(centre),
                features="mean", meta=info, normalize=True)


def check_described(labels, descriptions: dict[str, str]) -> None:
    missing = [label for label in labels if not descriptions.get(label)]
    if missing:
        raise ValueError(f"--from-descriptions needs a description for every label; {', '.join(map(repr, missing))} "
                         "has none (give labels as {name, description} in the task file)")


def check_label_features(task: Task, classes: list[str], with_label_logprobs: bool) -> None:
    if with_label_logprobs and set(task.labels) != set(classes):
        raise ValueError(f"--with-label-logprobs needs the task's labels to be the head's labels; the task has "
                         f"{list(task.labels)}, the rows {sorted(classes)}")


def head_meta(model: str, dtype: str, input) -> dict:
    """What head.json records about how the head was made (beside its identity, task and scores)."""
    packaged = PACKAGED_MODELS.get(model)
    return {"model": model, "model_sha256": packaged.sha256 if packaged else None, "dtype": dtype,
            "input": str(input), "command": shlex.join(["slimroute", *sys.argv[1:]])}


def summary_rows(head: Head, report: CVReport, labels: list[str]) -> list[tuple[str, str]]:
    counts = Counter(labels)
    candidates = ", ".join(f"{name} {100 * acc:.1f}%" for name, acc in report.scores.items())
    layers = f" + mean of layer {', '.join(map(str, head.layers))}" if head.layers else ""
    template = head.task.template
    prompt = f"{report.prompt}: " + (repr(template) if template is not None else "the task's chat prompt")
    rows = [("rows", f"{len(labels)} ({len(counts)} labels, {min(counts.values())} to {max(counts.values())} "
                     "per label)"),
            ("prompt", prompt),
            ("label rows", "the label names as training rows" if report.label_rows == "names" else "none"),
            ("features", f"{head.features}{layers} ({head.weight.shape[1]})")]
    if report.option_scores:
        rows.append(("options (LDA CV)", ", ".join(f"{name} {100 * acc:.1f}%"
                                                    for name, acc in report.option_scores.items())))
    return rows + [("classifier", f"{report.chosen} (of {candidates})"),
                   ("CV accuracy", f"{100 * report.accuracy:.1f}%"),
                   ("CV macro-F1", f"{100 * report.macro_f1:.1f}%")]
