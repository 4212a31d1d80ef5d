"""Tiny random models with a real chat-templated tokenizer, built in milliseconds at test time."""

from __future__ import annotations

import functools

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM = (  # Gemma 2's: no system turn
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = [
    "billing technical account Technical Support Technical Sales refund invoice charge card payment",
    "my password reset login error crash app server timeout subscription plan upgrade cancel",
    "Classify the support ticket into one category. Answer with exactly one of the labels.",
    "hello thanks please help I was charged twice the app keeps crashing cannot log in",
]


@functools.cache
def _tokenizer_json(style: str) -> str:
    specials = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if style == "chatml"
        else ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok.to_str()


def tiny_tokenizer(style: str = "chatml") -> PreTrainedTokenizerFast:
    """style: chatml, no-system (ChatML tokens, a template that refuses a system turn, as Gemma 2's) or llama3."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(
        "llama3" if style == "llama3" else "chatml")))
    if style in ("chatml", "no-system"):
        tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
        tok.chat_template = CHATML if style == "chatml" else NO_SYSTEM
    else:
        tok.add_special_tokens({"eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"})
        tok.chat_template = LLAMA3
    return tok


# Other decoders, each with what sets it apart: (config class, model class, config extras). Their windows are shorter
# than the test texts, so the sliding layers cut.
OTHER_ARCHS = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # soft-capped scores and logits, (1 + w) norms, no sdpa
               dict(head_dim=8, sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8, sliding_window=16)),  # q/k norms too
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # norms after attention and MLP, none in front
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=4.0, residual_multiplier=0.5)),  # logits / 4
}


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype=torch.float32):
    """(model, tokenizer): qwen2 uses a ChatML template, llama a Llama-3 style one; OTHER_ARCHS a ChatML one (gemma2:
    one without a system turn, as Gemma 2's)."""
    tok = tiny_tokenizer("llama3" if arch == "llama" else "no-system" if arch == "gemma2" else "chatml")
    common = dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.3, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif arch in OTHER_ARCHS:
        config_class, model_class, extra = OTHER_ARCHS[arch]
        ids = dict(bos_token_id=None, eos_token_id=tok.eos_token_id)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**common, **ids, **extra))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    return model.to(dtype).eval(), tok


WORDS = "billing refund card app crash login password account plan upgrade error server please help".split()


def make_text(rng, num_words: int) -> str:
    """A ticket-like text of num_words words from the tiny tokenizer's vocabulary."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))
