"""The task (labels, their descriptions, instructions, few-shot examples) and how it becomes token ids.

`Task.messages(text)` is the one definition of the conversation; both the reference and the
fast path render it through the model's own chat template. Label descriptions only change the
system prompt; the model still answers the label's name. A task with a `template` (raw text with one
`{text}`, e.g. a prompt written for a head to read: "Customer message: ...") is rendered as that text
alone, no chat template. `Prompt` splits the rendered prompt right after the last special token before
the item text (a template has none: an empty prefix), so that `prefix_ids + item_ids(text)` equals
tokenising the whole prompt at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from slimroute.labels import label_token_ids

DEFAULT_INSTRUCTIONS = "Classify the support ticket into one category."
_SENTINEL = "\u2063SLIMROUTE_ITEM\u2063"


@dataclass(frozen=True)
class Example:
    text: str
    label: str


@dataclass(frozen=True)
class Task:
    """`labels` may mix names and mappings {name, description}; they are split into `labels` (names)
    and `descriptions` (label -> description, only the described ones, in label order)."""

    labels: tuple[str, ...]
    instructions: str = DEFAULT_INSTRUCTIONS
    examples: tuple[Example, ...] = ()
    name: str = "default"
    descriptions: tuple[tuple[str, str], ...] = ()  # (label, description) pairs; a dict is accepted too
    # Read only each text's first this many tokens (None: as many as the model's context leaves room for); a
    # longer text is cut, in the reference and the fast path alike, and marked truncated.
    truncate_tokens: int | None = None
    # A raw prompt with exactly one "{text}", rendered without the chat template (None: the chat prompt above). The
    # instructions then go unused; the labels are still scored after the template's end.
    template: str | None = None

    def __post_init__(self):
        check_truncate_tokens(self.truncate_tokens)
        check_template(self.template)
        if self.template is not None and self.examples:
            raise ValueError("examples: a task with a template takes no few-shot examples (they are chat turns); "
                             "write them into the template instead")
        labels, described = parse_labels(self.labels)
        given = self.descriptions.items() if isinstance(self.descriptions, dict) else self.descriptions
        for label, description in given:
            if label in described:
                raise ValueError(f"labels: label {label!r} is described twice")
            described[label] = check_description(label, description)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "examples", tuple(self.examples))
        if not labels:
            raise ValueError("labels: the label list is empty; give at least two labels, e.g. --labels a,b")
        for label in labels:
            if not isinstance(label, str) or not label.strip():
                raise ValueError(f"labels: every label must be a non-empty string, got {label!r}")
            if label != label.strip():
                raise ValueError(f"labels: label {label!r} has leading or trailing whitespace")
        seen = set()
        for label in labels:
            if label in seen:
                raise ValueError(f"labels: label {label!r} is given twice")
            seen.add(label)
        for ex in self.examples:
            if ex.label not in seen:
                raise ValueError(f"examples: example label {ex.label!r} is not one of the labels {list(labels)}")
        unknown = [label for label in described if label not in seen]
        if unknown:
            raise ValueError(f"descriptions: {unknown[0]!r} is not one of the labels {list(labels)}")
        object.__setattr__(self, "descriptions", tuple((label, described[label]) for label in labels
                                                       if label in described))

    @classmethod
    def from_labels(cls, labels: str | list[str], instructions: str | None = None, **kw) -> Task:
        if isinstance(labels, str):
            labels = [part.strip() for part in labels.split(",")] if labels.strip() else []
        return cls(tuple(labels), instructions or DEFAULT_INSTRUCTIONS, **kw)

    @classmethod
    def from_dict(cls, data: dict, name: str = "default") -> Task:
        if not isinstance(data, dict):
            raise ValueError(f"task: expected a mapping with 'labels', got {type(data).__name__}")
        unknown = set(data) - {"labels", "instructions", "examples", "name", "truncate_tokens", "template"}
        if unknown:
            raise ValueError(f"task: unknown field(s) {sorted(unknown)}; allowed: labels, instructions, examples, "
                             "truncate_tokens, template")
        if "labels" not in data:
            raise ValueError("task: field 'labels' is missing")
        examples = []
        for i, ex in enumerate(data.get("examples") or []):
            if not isinstance(ex, dict) or "text" not in ex or "label" not in ex:
                raise ValueError(f"task.examples[{i}]: each example needs 'text' and 'label'")
            examples.append(Example(str(ex["text"]), str(ex["label"])))
        labels = data["labels"]
        if not isinstance(labels, list):
            raise ValueError("task.labels: expected a list of names or {name, description} mappings")
        return cls(
            tuple(labels),
            data.get("instructions") or DEFAULT_INSTRUCTIONS,
            tuple(examples),
            str(data.get("name", name)),
            truncate_tokens=data.get("truncate_tokens"),
            template=data.get("template"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Task:
        return cls.from_dict(load_task_file(path), Path(path).stem)

    def truncated_to(self, tokens: int | None) -> Task:
        """This task reading each text's first `tokens` tokens (`--truncate-tokens`): None keeps the task's own
        setting, 0 reads whole texts."""
        if tokens is None:
            return self
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"--truncate-tokens: expected a number of tokens >= 1 (e.g. 128), or 0 for whole texts, "
                             f"got {tokens!r}")
        return replace(self, truncate_tokens=tokens or None)

    def description(self, label: str) -> str | None:
        return dict(self.descriptions).get(label)

    def system_prompt(self) -> str:
        """Instructions, then (when any label is described) one line per label, then the answer format."""
        choices = ", ".join(self.labels)
        lines = [self.instructions]
        if self.descriptions:
            described = dict(self.descriptions)
            lines.append("Categories:")
            lines += [f"- {label}: {described[label]}" if label in described else f"- {label}" for label in self.labels]
        lines.append(f"Answer with exactly one of: {choices}.")
        return "\n".join(lines)

    def messages(self, text: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.system_prompt()}]
        for ex in self.examples:
            msgs.append({"role": "user", "content": ex.text.strip()})
            msgs.append({"role": "assistant", "content": ex.label})
        msgs.append({"role": "user", "content": text.strip()})
        return msgs


def parse_labels(entries) -> tuple[tuple, dict[str, str]]:
    """Label entries (names, or mappings {name, description}) -> (names, {name: description})."""
    names, described = [], {}
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            unknown = set(entry) - {"name", "description"}
            if unknown:
                raise ValueError(f"labels[{i}]: unknown field(s) {sorted(unknown)}; a label mapping has "
                                 "'name' and optionally 'description'")
            if "name" not in entry:
                raise ValueError(f"labels[{i}]: a label mapping needs a 'name', got {entry!r}")
            name = entry["name"]
            if entry.get("description") is not None:
                if name in described:
                    raise ValueError(f"labels: label {name!r} is described twice")
                described[name] = check_description(name, entry["description"])
            names.append(name)
        else:
            names.append(entry)
    return tuple(names), described


def check_truncate_tokens(value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"truncate_tokens: expected a whole number of tokens >= 1 (e.g. 128), got {value!r}")
    return value


def check_template(template) -> str | None:
    if template is None:
        return None
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"template: expected a non-empty string with one {{text}}, got {template!r}")
    if template.count("{text}") != 1:
        raise ValueError(f"template: must hold {{text}} exactly once (where each text goes), got {template!r}")
    return template


def check_description(label, description) -> str:
    if not isinstance(description, str):
        raise ValueError(f"labels: the description of {label!r} must be a string, "
                         f"got {type(description).__name__} {description!r}")
    description = " ".join(description.split())  # one line in the system prompt
    if not description:
        raise ValueError(f"labels: the description of {label!r} is empty; leave it out or write one")
    return description


def load_task_file(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist")
    raw = path.read_text(encoding="utf-8")
    return json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)


def render_prompt(tokenizer, task: Task, text: str) -> str:
    """The whole prompt string, up to and including the start of the assistant turn; with a template, the template
    around the text (behind the tokenizer's BOS where it puts one before plain text: Llama's, Gemma's)."""
    if task.template is not None:
        return _bos_text(tokenizer) + task.template.replace("{text}", text.strip())
    return chat_prompt(tokenizer, task.messages(text))


def _bos_text(tokenizer) -> str:
    """The BOS token's text when the tokenizer adds one by itself (a raw prompt then starts as its chat template
    would), else ""."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    return bos if tokenizer("a")["input_ids"][:1] == [bos_id] else ""


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """messages through the tokenizer's chat template, up to and including the start of the assistant turn. A
    template without a system turn (Gemma 2's refuses one) gets the system prompt at the top of the first user
    turn, as Gemma 3's template puts it there itself."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        if len(messages) < 2 or messages[0]["role"] != "system":
            raise
    first = {"role": "user", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}
    return tokenizer.apply_chat_template([first, *messages[2:]], tokenize=False, add_generation_prompt=True)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Prompt:
    """Token ids of a task: the shared prefix, each item's part, and each label's tokens."""

    task: Task
    tokenizer: object
    max_positions: int = 32768
    prefix_ids: list[int] = field(init=False)
    label_ids: list[tuple[int, ...]] = field(init=False)

    def __post_init__(self):
        rendered = render_prompt(self.tokenizer, self.task, _SENTINEL)
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not place the user text exactly once")
        before, self._suffix = rendered.split(_SENTINEL)
        split = _last_special_end(self.tokenizer, before)
        self._prefix_text, self._head = before[:split], before[split:]
        self.prefix_ids = encode(self.tokenizer, self._prefix_text)
        self.label_ids = [label_token_ids(self.tokenizer, self._suffix, label) for label in self.task.labels]
        self._suffix_ids = encode(self.tokenizer, self._suffix)
        self._head_ids = encode(self.tokenizer, self._head)
        longest_label = max(len(ids) for ids in self.label_ids)
        room = self.max_positions - len(self.prefix_ids) - len(self._head_ids) - len(self._suffix_ids) - longest_label
        if room < 1:
            raise ValueError(
                f"the task's prompt ({len(self.prefix_ids)} tokens) leaves no room for the text in the "
                f"model's context of {self.max_positions} tokens; shorten the instructions or examples"
            )
        self.max_text_tokens = min(room, self.task.truncate_tokens or room)

    @property
    def max_item_tokens(self) -> int:
        """The most item tokens (the rest of the user turn, the text, the assistant-turn start) a text can take,
        give or take a token where the text's tokens merge with the template's."""
        return len(self._head_ids) + self.max_text_tokens + len(self._suffix_ids)

    def fit_text(self, text: str) -> tuple[str, bool]:
        """Keep the text's first tokens so the whole prompt fits the context and the text at most the task's
        truncate_tokens; (text, truncated)."""
        text = text.strip()
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) <= self.max_text_tokens:
            return text, False
        end = enc["offset_mapping"][self.max_text_tokens - 1][1]
        return text[:end], True

    def item_ids(self, text: str) -> list[int]:
        """Ids of everything after the prefix: rest of the user turn, text, assistant-turn start."""
        return encode(self.tokenizer, self._head + text.strip() + self._suffix)

    def item_ids_batch(self, texts: list[str]) -> list[list[int]]:
        strings = [self._head + t.strip() + self._suffix for t in texts]
        return self.tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else []


def _last_special_end(tokenizer, text: str) -> int:
    """Character index just after the last special token in `text` (0 when there is none)."""
    best = 0
    for token in getattr(tokenizer, "all_special_tokens", []) + list(
        getattr(tokenizer, "added_tokens_encoder", {}) or {}
    ):
        if token and (pos := text.rfind(token)) >= 0:
            best = max(best, pos + len(token))
    return best
