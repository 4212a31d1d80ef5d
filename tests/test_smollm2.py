"""End to end on the packaged SmolLM2-135M (a real Llama-architecture model loaded from GGUF)."""

import pytest
import torch

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.io.synth import synthetic_tickets
from slimroute.task import Prompt, Task, encode, render_prompt

pytestmark = pytest.mark.slow
TICKETS = synthetic_tickets(600, 0)


def test_prompt_split_is_exact_on_the_real_tokenizer(smollm2):
    tok = smollm2.tokenizer
    task = Task(("billing", "technical", "account"))
    prompt = Prompt(task, tok)
    for ticket in TICKETS:
        assert encode(tok, render_prompt(tok, task, ticket["text"])) == prompt.prefix_ids + prompt.item_ids(
            ticket["text"]
        )


@pytest.mark.parametrize("labels", [("billing", "technical", "account"), ("Technical Support", "Technical Sales",
                                                                           "Billing question")])
def test_reference_greedy_equals_constrained_generate(smollm2, labels):
    """The reference's greedy decision is what HF generate outputs under a mask allowing only label tokens."""
    model, tok = smollm2.model, smollm2.tokenizer
    task = Task(labels)
    ref = ReferenceClassifier(model, tok, task)
    label_ids = ref.label_ids

    def allowed(batch_id, sent):
        done = sent.tolist()[prompt_len:]
        nxt = {ids[len(done)] for ids in label_ids if len(ids) > len(done) and list(ids[: len(done)]) == done}
        return sorted(nxt) or [tok.eos_token_id]

    for ticket in TICKETS[:4]:
        pred = ref.classify_one(ticket["text"])
        ids = torch.tensor([encode(tok, render_prompt(tok, task, ticket["text"]))])
        prompt_len = ids.shape[1]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), prefix_allowed_tokens_fn=allowed,
                             max_new_tokens=max(map(len, label_ids)), do_sample=False, pad_token_id=tok.eos_token_id)
        generated = out[0, prompt_len:].tolist()
        chosen = next(i for i, ids in enumerate(label_ids) if generated[: len(ids)] == list(ids))
        assert pred.label == labels[chosen]
        assert all(lp <= 0 for lp in pred.logprobs.values()) and set(pred.logprobs) == set(labels)


def test_engine_equals_reference_on_real_tickets(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    task = Task(("Technical Support", "Technical Sales", "billing", "account"))
    texts = [t["text"] for t in TICKETS[:12]]
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    for config in (EngineConfig(batch_size=8), EngineConfig(max_batch_tokens=600, decision="greedy")):
        fast = Engine(model, tok, task, config).classify(texts)
        assert [p.label for p in fast] == [p.label for p in ref]
        diffs = [abs(a.logprobs[k] - b.logprobs[k]) for a, b in zip(ref, fast, strict=True) for k in a.logprobs]
        assert max(diffs) < 1e-3


def test_a_tuned_head_on_the_fast_path_equals_the_reference(smollm2):
    """BANKING77 intents: a head tuned on the engine's hidden states gives the reference's log-probs."""
    from test_tune import banking_rows

    from slimroute.accuracy.tune import TuneConfig, tune_head

    model, tok = smollm2.model, smollm2.tokenizer
    rows = banking_rows(10)
    train, held_out = [r for i, r in enumerate(rows) if i % 5], [r for i, r in enumerate(rows) if not i % 5]
    task = Task(tuple(sorted({r["intent"] for r in rows})), "Classify the online-banking customer query.")
    head, report = tune_head(Engine(model, tok, task), [r["text"] for r in train], [r["intent"] for r in train],
                             TuneConfig(folds=4))
    assert report.accuracy > 0.5  # four intents, eight examples each: far above chance (0.25)
    task = head.task  # the prompt the head reads: tune's representation template
    assert task.template is not None
    texts = [r["text"] for r in held_out]
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    for config in (EngineConfig(batch_size=3), EngineConfig(prefix_cache=False), EngineConfig(chunk_tokens=32)):
        fast = Engine(model, tok, task, config, head=head).classify(texts)
        assert [p.label for p in fast] == [p.label for p in ref]
        assert max(abs(a.logprobs[k] - b.logprobs[k]) for a, b in zip(ref, fast, strict=True) for k in a.logprobs) \
            <= 1e-4
