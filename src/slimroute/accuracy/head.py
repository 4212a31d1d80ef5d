"""A tuned head: a linear classifier on each item's final hidden states (optionally + its label log-probs).

The features come from the forward pass the label scorer already makes, so a head costs no extra pass:
the final-norm hidden state at the item's last token ("hidden"), optionally beside the mean of the
final-norm hidden states over the item's own tokens (the text and its chat-template turn, not the shared
prefix: "+mean"), optionally the mean over the item's tokens of the output of one or more decoder layers in
the middle of the model (`layers`, hidden_states indices: a layer a quarter of the way up often separates
intents better than the last one; tune.py picks it by cross-validation), and the task labels' exact log-probs
("+label-logprobs"). The mean is taken in float64
over the same contiguous (tokens, H) slice in the fast path and the reference, so it adds no rounding of
its own between them. They are standardised with the training mean/std, then softmax(W z + b) over the
head's labels decides; both the fast path and the reference apply this same head, so `verify` compares the
hidden states behind it.

A description head (tune.description_head: no labelled rows) reads the mean state alone ("mean"), centred
on the mean state of content-free inputs and scaled to unit length (`normalize`); its rows of W point from
that centre to each label description's own mean state, so it scores the cosine similarity between an item
and each description.

On disk, a folder:
  head.safetensors  weight (C, F), bias (C,), mean (F,), std (F,) in float64
  head.json         labels, feature set, normalize, the task (prompt) it was tuned with, the identity of the model,
                    tokenizer and prompt (fingerprint.py), the cross-validated scores, version, command
A head loads only where that identity matches: anything else is a HeadMismatchError.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slimroute.runtime.fingerprint import identity
from slimroute.task import Example, Task

FORMAT = "slimroute-head"
FORMAT_VERSION = 1
FEATURE_SETS = ("hidden", "hidden+mean", "hidden+label-logprobs", "hidden+mean+label-logprobs", "mean")
STATES = ("last", "last+mean", "mean")  # which final hidden states item_states hands a head
WEIGHTS, META = "head.safetensors", "head.json"


class HeadMismatchError(ValueError):
    """The head was tuned for another model, tokenizer or prompt; the message says which."""


@dataclass(frozen=True)
class Head:
    labels: tuple[str, ...]
    weight: torch.Tensor  # (C, F) on standardised features
    bias: torch.Tensor  # (C,)
    mean: torch.Tensor  # (F,)
    std: torch.Tensor  # (F,)
    features: str = "hidden"
    meta: dict = field(default_factory=dict)  # identity, task, cv, version, command (see module docstring)
    normalize: bool = False  # scale each standardised feature row to unit length first (a description head)
    layers: tuple[int, ...] = ()  # decoder layers (hidden_states indices) whose item-token means follow the states

    def __post_init__(self):
        for name in ("weight", "bias", "mean", "std"):  # float64 on the CPU: the head's own rounding stays negligible
            object.__setattr__(self, name, torch.as_tensor(getattr(self, name)).to("cpu", torch.float64))
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "layers", tuple(int(k) for k in self.layers))
        if any(k < 1 for k in self.layers):
            raise ValueError(f"layers are decoder layer outputs (hidden_states indices >= 1), got {list(self.layers)}")
        if self.features not in FEATURE_SETS:
            raise ValueError(f"features must be one of {', '.join(FEATURE_SETS)}, got {self.features!r}")
        num_classes, num_features = self.weight.shape
        if len(self.labels) != num_classes or len(set(self.labels)) != num_classes or num_classes < 2:
            raise ValueError(f"labels: expected {num_classes} distinct labels (>= 2), got {list(self.labels)}")
        if self.bias.shape != (num_classes,) or self.mean.shape != (num_features,) or self.std.shape != (
            num_features,
        ):
            raise ValueError(f"head tensors do not fit together: weight {tuple(self.weight.shape)}, bias "
                             f"{tuple(self.bias.shape)}, mean {tuple(self.mean.shape)}, std {tuple(self.std.shape)}")

    @property
    def uses_label_logprobs(self) -> bool:
        return self.features.endswith("+label-logprobs")

    @property
    def states(self) -> str:
        return feature_states(self.features)

    @property
    def answer_ids(self) -> list[tuple[int, ...]]:
        """One distinct pseudo-token per head label: both decision rules then take the argmax (first on ties)."""
        return [(j,) for j in range(len(self.labels))]

    @property
    def task(self) -> Task:
        """The task (prompt) the head was tuned with."""
        spec = self.meta["task"]
        examples = tuple(Example(text, label) for text, label in spec.get("examples", []))
        described = {"descriptions": tuple(map(tuple, spec["descriptions"]))} if spec.get("descriptions") else {}
        return Task(tuple(spec["labels"]), spec["instructions"], examples, **described,
                    truncate_tokens=spec.get("truncate_tokens"), template=spec.get("template"))

    def logprobs(self, hidden: torch.Tensor, label_logprobs: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) or, with +mean, (N, 2H) item states (item_states, with the means of `layers` after them)
        [+ (N, L) label log-probs] -> (N, C) float64 log-probs over the head's labels."""
        z = (head_features(hidden, label_logprobs) - self.mean) / self.std  # (N, F)
        if self.normalize:  # row by row: W z is then a cosine similarity, times the length of W's rows
            z = z / z.norm(dim=1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)
        # One matrix-vector product per row: a GEMM's rounding may follow its row count, and a row's answer must
        # not depend on the batch it came in (int8 is compared bitwise with the one-at-a-time reference).
        logits = torch.stack([self.weight @ row for row in z]) if len(z) else z.new_empty(0, len(self.labels))
        return torch.log_softmax(logits + self.bias, dim=-1)  # (N, C)

    def token_logprobs(self, hidden: torch.Tensor, label_token_logprobs: list | None = None) -> list:
        """The engine's per-row shape: [row][head label][0], one step per label (see answer_ids)."""
        totals = label_totals(label_token_logprobs) if self.uses_label_logprobs else None
        return [[[lp] for lp in row] for row in self.logprobs(hidden, totals).tolist()]

    def check(self, model, tokenizer, task: Task) -> None:
        """Raise HeadMismatchError unless the model, tokenizer and prompt are the ones the head was tuned with."""
        check_identity(self.meta.get("identity", {}), identity(model, tokenizer, task), self.meta.get("model"))
        depth = getattr(model.config, "num_hidden_layers", None)
        if depth is not None and any(k >= depth for k in self.layers):
            raise HeadMismatchError(f"the head reads decoder layers {list(self.layers)}; this model has {depth}")
        if self.uses_label_logprobs and len(task.labels) != self.num_label_features:
            raise HeadMismatchError(f"the head uses {self.num_label_features} label log-probs as features; "
                                    f"the task has {len(task.labels)} labels")

    @property
    def digest(self) -> str:
        """A short hash of the whole head (tensors and metadata), for a job's resume fingerprint."""
        layers = [list(self.layers)] if self.layers else []  # a head without layers keeps its earlier digest
        digest = hashlib.sha256(json.dumps([self.labels, self.features, self.meta, self.normalize, *layers],
                                           sort_keys=True).encode())
        for tensor in (self.weight, self.bias, self.mean, self.std):
            digest.update(tensor.to(torch.float64).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    @property
    def num_label_features(self) -> int:
        return len(self.meta["task"]["labels"]) if self.uses_label_logprobs else 0

    def save(self, folder: str | Path, overwrite: bool = False) -> Path:
        """Write both files into a fresh temporary folder, then rename it into place."""
        from safetensors.torch import save_file

        folder = Path(folder)
        check_out(folder, overwrite)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
        try:
            tensors = {"weight": self.weight, "bias": self.bias, "mean": self.mean, "std": self.std}
            save_file({k: v.to(torch.float64).contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS))
            meta = {"format": FORMAT, "version": FORMAT_VERSION, "labels": list(self.labels),
                    "features": self.features, "normalize": self.normalize, "layers": list(self.layers), **self.meta}
            (tmp / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            umask = os.umask(0)
            os.umask(umask)
            for path in (tmp / WEIGHTS, tmp / META):
                path.chmod(0o666 & ~umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp made it private
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Head:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / META).is_file() or not (folder / WEIGHTS).is_file():
            raise ValueError(f"head {str(folder)!r} is not a head folder (needs {META} and {WEIGHTS}); "
                             "make one with `slimroute tune`")
        try:
            meta = json.loads((folder / META).read_text(encoding="utf-8"))
            tensors = load_file(str(folder / WEIGHTS))
        except (ValueError, SafetensorError) as exc:
            raise ValueError(f"head {str(folder)!r} is unreadable: {exc}") from None
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"head {str(folder)!r} has format {meta.get('format')!r} version "
                             f"{meta.get('version')!r}; this slimroute reads {FORMAT} version {FORMAT_VERSION}")
        meta = {k: v for k, v in meta.items() if k not in ("format", "version")}
        labels, features, normalize = tuple(meta.pop("labels")), meta.pop("features"), meta.pop("normalize", False)
        layers = tuple(meta.pop("layers", ()))  # absent in heads saved before layers existed
        return cls(labels, tensors["weight"], tensors["bias"], tensors["mean"], tensors["std"], features, meta,
                   bool(normalize), layers)


def check_out(folder: Path, overwrite: bool = False) -> None:
    """A head goes into a new or empty folder, or replaces a head with --overwrite; never other files."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file; give a folder for the head")
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if names - {WEIGHTS, META}:
        raise ValueError(f"--out {str(folder)!r} holds other files; give a new or empty folder for the head")
    if names and not overwrite:
        raise ValueError(f"--out {str(folder)!r} already holds a head; pass --overwrite to replace it")


def feature_states(features: str) -> str:
    """The hidden states (STATES) a feature set reads."""
    return "mean" if features == "mean" else "last+mean" if features.startswith("hidden+mean") else "last"


def item_states(hidden: torch.Tensor, lasts: list[int], counts: list[int], states: str = "last",
                layer_hidden: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The head's view of each row of (B, T, H) final-norm hidden states: "last" (B, H) at position lasts[b];
    "mean" (B, H) float64, the mean of the counts[b] positions up to and including lasts[b]; "last+mean"
    (B, 2H) float64, both side by side. Each of layer_hidden (B, T, H), a decoder layer's output (Head.layers),
    adds its mean over the same positions (float64) after them.

    Each row's mean sums one contiguous (count, H) slice in float64, the same slice, with the same shape, that
    the reference (one item, no padding) sums, so padding and batch size change none of its bits."""
    if states not in STATES:
        raise ValueError(f"states must be one of {', '.join(STATES)}, got {states!r}")
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    last = hidden[rows, torch.as_tensor(lasts, device=hidden.device)]  # (B, H)
    extra = [_means(h, lasts, counts) for h in layer_hidden]  # each (B, H)
    if states == "last":
        return torch.cat([last.to(torch.float64), *extra], dim=1) if extra else last
    means = _means(hidden, lasts, counts)  # (B, H)
    return torch.cat(([] if states == "mean" else [last.to(torch.float64)]) + [means, *extra], dim=1)


def _means(hidden: torch.Tensor, lasts: list[int], counts: list[int]) -> torch.Tensor:
    return torch.stack([hidden[b, end - count + 1: end + 1].to(torch.float64).sum(dim=0) / count
                        for b, (end, count) in enumerate(zip(lasts, counts, strict=True))])  # (B, H)


def head_features(hidden: torch.Tensor, label_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """(N, H or 2H) item states [+ (N, L)] -> (N, F) float64: the states, then each task label's total log-prob."""
    hidden = hidden.to("cpu", torch.float64)
    if label_logprobs is None:
        return hidden
    return torch.cat([hidden, label_logprobs.to("cpu", torch.float64)], dim=1)


def label_totals(token_logprobs: list) -> torch.Tensor:
    """token_logprobs[row][label][k] -> (N, L) float64 totals (each label's log-prob, summed over its tokens)."""
    return torch.tensor([[sum(lps) for lps in row] for row in token_logprobs], dtype=torch.float64)


def task_spec(task: Task) -> dict:
    """The task as head.json keeps it (Head.task rebuilds it)."""
    spec = {"labels": list(task.labels), "instructions": task.instructions,
            "examples": [[ex.text, ex.label] for ex in task.examples]}
    if getattr(task, "descriptions", ()):  # label descriptions, where the task has them
        spec["descriptions"] = [list(pair) for pair in task.descriptions]
    if task.truncate_tokens is not None:  # the features were read from each text's first tokens only
        spec["truncate_tokens"] = task.truncate_tokens
    if task.template is not None:  # a raw prompt, no chat template (the features were read through it)
        spec["template"] = task.template
    return spec


_WHAT = {"model_fingerprint": "model", "tokenizer_fingerprint": "tokenizer", "prompt_fingerprint": "prompt",
         "hidden_size": "hidden size"}


def check_identity(tuned: dict, here: dict, tuned_model: str | None = None) -> None:
    for key, what in _WHAT.items():
        if tuned.get(key) != here[key]:
            named = f" ({tuned_model!r})" if tuned_model else ""
            hint = {"model": f"load the model it was tuned with{named} or tune a new head",
                    "tokenizer": "load the model it was tuned with or tune a new head",
                    "prompt": "leave out --labels/--task/--instructions to use the head's own task, or tune again",
                    "hidden size": "tune a new head for this model"}[what]
            raise HeadMismatchError(f"the head was tuned for another {what} ({key} {tuned.get(key)!r}, "
                                    f"here {here[key]!r}); {hint}")
