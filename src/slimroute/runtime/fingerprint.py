"""What a hidden state depends on, as short hashes: the model's weights, the tokenizer, the prompt.

A tuned head (head.py) is only valid for the exact combination it was fitted on, so it records these
and refuses any other. Each costs well under a second for a 0.5B model:
- model: the config's shape fields, every norm weight and a strided sample of embedding rows, rounded
  to bfloat16 first so that the same checkpoint loaded in float32 or bfloat16 (or from its packaged name
  or its converted folder) gives the same hash, while a fine-tune (which moves the norms) does not.
  load_model takes it before int8 folds its smoothing scales into the norms, so int8 matches too;
- tokenizer: its full serialised definition (vocabulary, merges, normaliser, pre-tokeniser, added
  tokens) without runtime padding/truncation settings, plus its chat template;
- prompt: the whole rendered prompt around a placeholder text (chat template, instructions, labels as
  listed in the system prompt, examples), i.e. every token before and after the item.
"""

from __future__ import annotations

import hashlib
import json

import torch

from slimroute.task import Task, render_prompt

_PLACEHOLDER = "\u2063SLIMROUTE_TEXT\u2063"
_CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings")
_EMBEDDING_ROWS = 64
_REMEMBERED = "_slimroute_fingerprint"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _bf16_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu", torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def model_fingerprint(model) -> str:
    """The checkpoint's hash; as remembered at load time when the weights were transformed since (int8)."""
    return getattr(model, _REMEMBERED, None) or _weights_fingerprint(model)


def remember_fingerprint(model) -> str:
    """Hash the weights now, as loaded, and keep the hash on the model for model_fingerprint."""
    fingerprint = _weights_fingerprint(model)
    object.__setattr__(model, _REMEMBERED, fingerprint)  # a plain attribute beside the module's parameters
    return fingerprint


def _weights_fingerprint(model) -> str:
    digest = hashlib.sha256()
    config = model.config
    digest.update(json.dumps({k: getattr(config, k, None) for k in _CONFIG_FIELDS}, sort_keys=True).encode())
    for name, param in sorted(model.named_parameters()):
        if "norm" in name:
            digest.update(name.encode() + _bf16_bytes(param))
    embedding = model.get_input_embeddings().weight  # (V, H)
    step = max(1, embedding.shape[0] // _EMBEDDING_ROWS)
    digest.update(_bf16_bytes(embedding[::step]))
    return digest.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        if backend.truncation is not None or backend.padding is not None:  # hash it as it is at rest
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        spec = backend.to_str()  # key order fixed by the serialiser; parsing 5 MB would take seconds
    else:  # a slow tokenizer: its vocabulary
        spec = json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha(json.dumps([spec, getattr(tokenizer, "chat_template", None)]).encode())


def prompt_fingerprint(tokenizer, task: Task) -> str:
    return _sha(render_prompt(tokenizer, task, _PLACEHOLDER).encode())


def hidden_size(model) -> int:
    return int(model.get_input_embeddings().weight.shape[1])


def identity(model, tokenizer, task: Task) -> dict:
    """Everything a head's inputs depend on, as recorded in head.json."""
    return {"model_fingerprint": model_fingerprint(model), "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "prompt_fingerprint": prompt_fingerprint(tokenizer, task), "hidden_size": hidden_size(model)}
