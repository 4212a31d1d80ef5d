import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slimroute.task import Example, Prompt, Task, encode, render_prompt

LABELS = ("billing", "technical", "account")


def test_prefix_plus_item_equals_whole_prompt(tiny):
    _, tok = tiny
    task = Task(LABELS, examples=(Example("I was charged twice", "billing"),))
    prompt = Prompt(task, tok)
    for text in ["hi", "  leading space", "trailing\n\n", "x" * 300, "émoji 🎉 ünïcode", "a\nb\n\nc"]:
        assert encode(tok, render_prompt(tok, task, text)) == prompt.prefix_ids + prompt.item_ids(text)


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=80).filter(lambda t: t.strip()))
def test_split_is_exact_for_any_text(text):
    from conftest import _cached

    for arch in ("qwen2", "llama"):
        _, tok = _cached(arch)
        prompt = Prompt(Task(LABELS), tok)
        assert encode(tok, render_prompt(tok, prompt.task, text)) == prompt.prefix_ids + prompt.item_ids(text)
        assert prompt.item_ids_batch([text]) == [prompt.item_ids(text)]


def test_prefix_ends_at_a_special_token(tiny):
    _, tok = tiny
    prompt = Prompt(Task(LABELS), tok)
    assert prompt.prefix_ids[-1] in tok.added_tokens_encoder.values()


def test_fit_text_truncates_to_context(tiny_qwen):
    _, tok = tiny_qwen
    prompt = Prompt(Task(LABELS), tok, max_positions=120)
    text, truncated = prompt.fit_text("billing " * 500)
    assert truncated and len(prompt.prefix_ids) + len(prompt.item_ids(text)) + 3 <= 120
    assert prompt.fit_text("short") == ("short", False)


@pytest.mark.parametrize(
    "labels, message",
    [((), "empty"), (("a", "a"), "twice"), (("a", ""), "non-empty"), ((" a", "b"), "whitespace")],
)
def test_bad_labels_are_rejected(labels, message):
    with pytest.raises(ValueError, match=message):
        Task(labels)


def test_task_from_dict_and_file(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text("labels: [billing, account]\ninstructions: Route it.\nexamples:\n"
                    "  - {text: refund please, label: billing}\n")
    task = Task.from_file(path)
    assert task.labels == ("billing", "account") and task.examples[0].label == "billing"
    with pytest.raises(ValueError, match="not one of the labels"):
        Task.from_dict({"labels": ["a", "b"], "examples": [{"text": "x", "label": "c"}]})
    with pytest.raises(ValueError, match="unknown field"):
        Task.from_dict({"labels": ["a", "b"], "label": "oops"})
    assert Task.from_labels("a, b ,c").labels == ("a", "b", "c")


def test_label_descriptions_go_into_the_system_prompt_only(tiny):
    _, tok = tiny
    plain = Task(LABELS)
    described = Task.from_dict({"labels": [
        {"name": "billing", "description": "charges, refunds,\n  invoices"},
        "technical",
        {"name": "account", "description": "signing in, passwords"},
    ]})
    assert described.labels == LABELS
    assert described.descriptions == (("billing", "charges, refunds, invoices"), ("account", "signing in, passwords"))
    assert described.system_prompt() == (
        "Classify the support ticket into one category.\nCategories:\n- billing: charges, refunds, invoices\n"
        "- technical\n- account: signing in, passwords\nAnswer with exactly one of: billing, technical, account.")
    assert plain.system_prompt() == (
        "Classify the support ticket into one category.\nAnswer with exactly one of: billing, technical, account.")
    assert Prompt(described, tok).label_ids == Prompt(plain, tok).label_ids  # the model still answers the name
    assert Task(LABELS, descriptions={"account": "signing in, passwords", "billing": "charges, refunds, invoices"}) \
        == described  # the Python API takes a dict too
    text = "I was charged twice"
    assert encode(tok, render_prompt(tok, described, text)) == (
        Prompt(described, tok).prefix_ids + Prompt(described, tok).item_ids(text))


@pytest.mark.parametrize("labels, message", [
    ([{"description": "no name"}, "b"], "needs a 'name'"),
    ([{"name": "a", "description": 3}, "b"], "description of 'a' must be a string"),
    ([{"name": "a", "description": "  "}, "b"], "description of 'a' is empty"),
    ([{"name": "a", "description": "x"}, {"name": "a"}], "label 'a' is given twice"),
    ([{"name": "a", "text": "x"}, "b"], "unknown field"),
    ([{"name": 5}, "b"], "non-empty string"),
])
def test_bad_label_mappings_are_rejected(labels, message):
    with pytest.raises(ValueError, match=message):
        Task.from_dict({"labels": labels})


def test_descriptions_of_unknown_labels_are_rejected():
    with pytest.raises(ValueError, match="'c' is not one of the labels"):
        Task(("a", "b"), descriptions={"c": "x"})


def test_truncate_tokens_reads_only_each_texts_first_tokens(tiny_qwen):
    _, tok = tiny_qwen
    whole = Prompt(Task(LABELS), tok)
    prompt = Prompt(Task(LABELS, truncate_tokens=5), tok)
    assert prompt.max_text_tokens == 5 and prompt.prefix_ids == whole.prefix_ids  # the prompt itself is unchanged
    long_text = "my invoice was charged twice and nobody answers my emails"
    text, truncated = prompt.fit_text(long_text)
    assert truncated and long_text.startswith(text) and len(encode(tok, text)) == 5
    assert prompt.fit_text("hi") == ("hi", False)
    assert whole.fit_text(long_text) == (long_text, False)
    tight = Prompt(Task(LABELS, truncate_tokens=10_000), tok, max_positions=120)  # the context still caps it
    assert tight.max_text_tokens == Prompt(Task(LABELS), tok, max_positions=120).max_text_tokens < 10_000


def test_truncate_tokens_from_a_task_file_and_from_the_flag():
    task = Task.from_dict({"labels": list(LABELS), "truncate_tokens": 128})
    assert task.truncate_tokens == 128
    assert task.truncated_to(None).truncate_tokens == 128  # no flag: the file's
    assert task.truncated_to(32).truncate_tokens == 32
    assert task.truncated_to(0).truncate_tokens is None  # 0: whole texts
    with pytest.raises(ValueError, match="--truncate-tokens: expected a number of tokens >= 1.*or 0"):
        task.truncated_to(-1)
    for bad in (0, -3, 2.5, "128", True):
        with pytest.raises(ValueError, match="truncate_tokens: expected a whole number of tokens >= 1"):
            Task(LABELS, truncate_tokens=bad)
    with pytest.raises(ValueError, match="allowed: labels, instructions, examples, truncate_tokens"):
        Task.from_dict({"labels": list(LABELS), "truncate": 5})


TEMPLATE = 'Customer message: "{text}"\nTopic (a few words): "'


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=80).filter(lambda t: t.strip()))
def test_a_template_renders_raw_and_its_split_is_exact(text):
    """A template is rendered as itself around the (stripped) text, no chat template; with no special token in it
    the prefix is empty, so prefix + item is tokenising the whole prompt, whatever the text's first characters."""
    from conftest import _cached

    for arch in ("qwen2", "llama"):
        _, tok = _cached(arch)
        task = Task(LABELS, template=TEMPLATE)
        assert render_prompt(tok, task, f" {text} ") == TEMPLATE.replace("{text}", text.strip())
        prompt = Prompt(task, tok)
        assert prompt.prefix_ids == []
        assert encode(tok, render_prompt(tok, task, text)) == prompt.item_ids(text)
        assert prompt.item_ids_batch([text]) == [prompt.item_ids(text)]


def test_a_template_starts_with_the_bos_a_tokenizer_adds_itself(tiny_llama):
    """Llama's and Gemma's tokenizers put a BOS before plain text, as their chat templates do: so does a template,
    and the prefix is then that BOS alone."""
    import copy

    from tokenizers import processors

    _, tok = tiny_llama
    with_bos = copy.deepcopy(tok)
    with_bos.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", with_bos.bos_token_id)])
    task = Task(LABELS, template=TEMPLATE)
    assert render_prompt(with_bos, task, "hi").startswith("<|begin_of_text|>Customer")
    assert not render_prompt(tok, task, "hi").startswith("<|begin_of_text|>")
    prompt = Prompt(task, with_bos)
    assert prompt.prefix_ids == [with_bos.bos_token_id]
    assert encode(with_bos, render_prompt(with_bos, task, "hi")) == prompt.prefix_ids + prompt.item_ids("hi")


def test_the_labels_are_scored_after_the_templates_end(tiny_qwen):
    _, tok = tiny_qwen
    chat, templated = Prompt(Task(LABELS), tok), Prompt(Task(LABELS, template=TEMPLATE), tok)
    assert templated._suffix == '"\nTopic (a few words): "' and len(templated.label_ids) == len(LABELS)
    assert all(ids for ids in templated.label_ids) and chat.prefix_ids


@pytest.mark.parametrize("template, message", [
    ("", "template: expected a non-empty string"), ("   ", "template: expected a non-empty string"),
    (3, "template: expected a non-empty string"), ("no text here", "must hold {text} exactly once"),
    ("{text} and {text}", "must hold {text} exactly once")])
def test_bad_templates_are_rejected(template, message):
    with pytest.raises(ValueError, match=message):
        Task(LABELS, template=template)


def test_a_template_from_a_task_file_takes_no_examples(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text('labels: [billing, account]\ntemplate: "Ticket: {text}\\nQueue:"\n')
    task = Task.from_file(path)
    assert task.template == "Ticket: {text}\nQueue:" and task.examples == ()
    with pytest.raises(ValueError, match="a task with a template takes no few-shot examples"):
        Task.from_dict({"labels": ["a", "b"], "template": "{text}", "examples": [{"text": "x", "label": "a"}]})
