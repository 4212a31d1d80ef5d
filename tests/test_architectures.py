"""Decoders other than Qwen2 and Llama, each with what sets it apart (tiny.OTHER_ARCHS): Gemma 2 (soft-capped scores
and logits, sliding windows, (1 + w) norms, no sdpa, no system turn), Gemma 3 (sliding windows, q/k norms), Olmo 2
(norms after attention and MLP) and Granite (logits divided by logits_scaling). The fast path equals the reference
in fp32 and, bit for bit, in int8; int8's smoothing changes nothing in exact arithmetic."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from test_equivalence import assert_equal
from tiny import OTHER_ARCHS, make_text, tiny_model

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.prefix_cache import smallest_window
from slimroute.engine.reference import ReferenceClassifier
from slimroute.engine.scoring import logit_transform
from slimroute.runtime.attention import set_attention
from slimroute.runtime.cpu import detect
from slimroute.runtime.dtypes import int8_kernels_available
from slimroute.runtime.smoothing import smoothed_weight, smoothing_factors
from slimroute.task import Example, Task, render_prompt

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

ARCHS = sorted(OTHER_ARCHS)
LABELS = ("Technical Support", "Technical Sales", "billing", "account")  # shared first token, multi-token
TEXTS = [make_text(random.Random(i), n) for i, n in enumerate((1, 5, 30, 90, 12, 3, 44, 8))]  # windows are 16
needs_int8 = pytest.mark.skipif(not int8_kernels_available(detect()),
                                reason=f"int8 needs x86 AVX2 and torch's fbgemm kernels; this is {detect().describe()}")


@functools.cache
def fp32_model(arch: str):
    model, tok = tiny_model(arch)
    set_attention(model)
    return model, tok


@functools.cache
def int8_model(arch: str):
    """As load_model makes it: quantised, the batch-invariant attention, fused where the fused decoder's form fits
    (none of these: their norms, windows, caps or multipliers are not what it computes)."""
    from slimroute.runtime.fused import fuse
    from slimroute.runtime.quantize import quantize_model

    model, tok = tiny_model(arch)
    quantize_model(model, tokenizer=tok)  # with smoothing, as load_model does
    assert set_attention(model) == "invariant"
    fuse(model)
    return model, tok


@needs_int8
@pytest.mark.parametrize("arch, why", [("gemma2", "soft-caps"), ("gemma3", "not of the form"),
                                       ("olmo2", "not of the form"), ("granite", "differs from the model's own")])
def test_the_fused_decoder_refuses_what_it_does_not_compute(arch, why):
    """Gemma's (1 + w) norms, q/k norms and windows, Olmo 2's norms after the blocks, Granite's multipliers: fuse
    says why not (Granite's layers have Llama's parts: only the bitwise probe against the model's own forward
    tells), and the model keeps its own modules."""
    from slimroute.runtime.fused import fuse, fused_decoder
    from slimroute.runtime.native import native

    if native() is None:
        pytest.skip("slimroute's native kernels do not build here")
    model, _ = int8_model(arch)
    assert fused_decoder(model) is None and why in fuse(model)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix", "no-prefix"])
def test_fast_path_equals_the_reference_in_fp32(arch, prefix_cache):
    model, tok = fp32_model(arch)
    task = Task(LABELS, examples=(Example("refund my card", "billing"),))
    ref = ReferenceClassifier(model, tok, task).classify(TEXTS)
    for batch_size in (1, 4):
        config = EngineConfig(batch_size=batch_size, prefix_cache=prefix_cache)
        assert_equal(ref, Engine(model, tok, task, config).classify(TEXTS))


@needs_int8
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix", "no-prefix"])
def test_int8_fast_path_gives_the_int8_references_bits(arch, prefix_cache):
    model, tok = int8_model(arch)
    task = Task(LABELS)
    ref = ReferenceClassifier(model, tok, task).classify(TEXTS)
    for batch_size in (1, 3, 8):
        fast = Engine(model, tok, task, EngineConfig(batch_size=batch_size, prefix_cache=prefix_cache)).classify(TEXTS)
        assert [p.logprobs for p in fast] == [p.logprobs for p in ref]  # bitwise


@pytest.mark.parametrize("arch", [*ARCHS, "qwen2", "llama"])
def test_smoothing_changes_nothing_in_exact_arithmetic(arch):
    """Each fold into a norm is made as that norm computes (Llama's w * f(x), Gemma's f(x) * (1 + w)) and only into
    the norm that feeds the layers (Gemma's pre_feedforward_layernorm; none in Olmo 2)."""
    model, tok = tiny_model(arch)
    ids = torch.tensor([tok("refund my card please, the app crash after login")["input_ids"]])
    with torch.no_grad():
        before = model(ids).logits
        factors, params = smoothing_factors(model, tok)
        assert factors  # v_proj/o_proj and up_proj/down_proj fold in every one of them
        for name, module in model.named_modules():
            if name in factors:
                module.weight.copy_(smoothed_weight(module.weight, factors[name]))
        for name, value in params.items():
            model.get_parameter(name).copy_(value)
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-4), (arch, (before - after).abs().max())
    norms = {name.rsplit(".", 2)[-2] for name in params if name.endswith("norm.weight")}
    assert norms == {"gemma2": {"input_layernorm", "pre_feedforward_layernorm"},  # (1 + w) norms, folded as such
                     "gemma3": {"input_layernorm", "pre_feedforward_layernorm"},
                     "olmo2": set()}.get(arch, {"input_layernorm", "post_attention_layernorm"})  # no norm in front


def test_what_sets_each_apart_is_seen():
    """The windows, the soft caps and the missing sdpa the tests above rely on."""
    gemma2, _ = fp32_model("gemma2")
    assert smallest_window(gemma2.config) == 16 and smallest_window(fp32_model("olmo2")[0].config) is None
    assert gemma2.config._attn_implementation == "eager"  # torch's sdpa cannot soft-cap
    assert fp32_model("gemma3")[0].config._attn_implementation == "sdpa"


def test_a_batch_reaching_past_a_sliding_window_goes_row_by_row():
    model, tok = fp32_model("gemma3")
    engine = Engine(model, tok, Task(LABELS), EngineConfig(batch_size=8, batch_overhead_tokens=10**6))  # full
    engine._window = engine.prefix.length + 20  # the tiny prefix alone is longer than the model's 16
    fits = 20 - max(len(ids) for ids in engine.label_ids)  # the longest item a batch may hold
    batches = list(engine._batches([1, 2, fits, fits + 1, 40]))
    assert sorted(map(sorted, batches)) == [[0, 1, 2], [3], [4]]
    engine._window = None  # no sliding layer: one batch
    assert list(engine._batches([1, 2, fits, fits + 1, 40])) == [[0, 1, 2, 3, 4]]


def test_a_template_without_a_system_turn_gets_the_instructions_in_the_first_user_turn():
    _, tok = tiny_model("gemma2")
    plain = render_prompt(tok, Task(("billing", "technical")), "I was charged")
    assert plain.startswith("<|im_start|>user\nClassify the support ticket") and "system" not in plain
    assert plain.endswith("billing, technical.\n\nI was charged<|im_end|>\n<|im_start|>model\n")
    shots = render_prompt(tok, Task(("billing", "technical"), examples=(Example("refund me", "billing"),)), "hi")
    assert "technical.\n\nrefund me<|im_end|>\n<|im_start|>model\nbilling<|im_end|>\n<|im_start|>user\nhi" in shots


def test_the_scorer_transforms_logits_as_the_models_forward_does():
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, Qwen2Config

    logits = torch.tensor([[-40.0, 0.5, 12.0]])
    assert logit_transform(Qwen2Config()) is None
    assert torch.equal(logit_transform(Gemma2Config(final_logit_softcapping=30.0))(logits),
                       torch.tanh(logits / 30.0) * 30.0)
    assert torch.equal(logit_transform(GraniteConfig(logits_scaling=8.0))(logits), logits / 8.0)
    assert torch.equal(logit_transform(CohereConfig(logit_scale=0.0625))(logits), logits * 0.0625)


def test_a_model_whose_logits_the_scorer_cannot_reproduce_is_refused(monkeypatch):
    """Rather than answering with log-probs that are not the model's (what Gemma 2 got before its soft cap)."""
    import slimroute.engine.scoring as scoring

    model, tok = fp32_model("gemma2")
    monkeypatch.setattr(scoring, "logit_transform", lambda config: None)  # as if the soft cap were unknown
    with pytest.raises(ValueError, match=r"label scorer does not reproduce this model's log-probabilities \(gemma2"):
        Engine(model, tok, Task(LABELS))


def test_a_mixture_of_experts_model_runs_its_last_layer_on_the_read_rows_only(caplog):
    """An MoE block takes (B, L, H) and returns (hidden states, router logits): the last layer's rows-only run keeps
    both forms. Its experts are 3-D weights, not linear layers: int8 leaves them fp32 and says so."""
    import transformers

    model, tok = tiny_model("qwen2")
    config = transformers.MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, initializer_range=0.3, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    set_attention(model)
    task = Task(LABELS)
    ref = ReferenceClassifier(model, tok, task).classify(TEXTS)
    assert_equal(ref, Engine(model, tok, task, EngineConfig(batch_size=4)).classify(TEXTS))
    if int8_kernels_available(detect()):
        from slimroute.runtime.quantize import quantize_model

        quantize_model(model, tokenizer=tok)
        set_attention(model)
        assert "mixture-of-experts weight(s)" in caplog.text and "not bit for bit" in caplog.text
        ref = ReferenceClassifier(model, tok, task).classify(TEXTS)
        assert_equal(ref, Engine(model, tok, task, EngineConfig(batch_size=4)).classify(TEXTS))


def test_verify_a_gemma2_folder_from_the_command_line(tmp_path, monkeypatch):
    """The whole load_model path (its kernels, int8's cache file and kernel choice, the attention it sets) on a
    model folder of the architecture that needed the most: every dtype this CPU runs agrees with its reference."""
    import json

    from typer.testing import CliRunner

    from slimroute.cli import app
    from slimroute.runtime.dtypes import supported_dtypes

    monkeypatch.setenv("SLIMROUTE_CACHE", str(tmp_path / "cache"))
    model, tok = tiny_model("gemma2")
    model.save_pretrained(tmp_path / "gemma2")
    tok.save_pretrained(tmp_path / "gemma2")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    for dtype in supported_dtypes(detect()):
        result = CliRunner().invoke(app, ["verify", str(src), "--model", str(tmp_path / "gemma2"), "--labels",
                                          ",".join(LABELS), "--dtype", dtype, "--threads", "1"])
        assert result.exit_code == 0, result.output
        assert f"label agreement 100.00% ({len(TEXTS)}/{len(TEXTS)})" in " ".join(result.output.split())
