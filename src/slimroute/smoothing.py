"""SmoothQuant-style smoothing for the int8 model (Xiao et al. 2023): move activation outliers into the weights.

A few input channels of each linear layer carry activations 10-100x larger than the rest; with one scale per row
they take the whole 7- or 8-bit range (int8.ACTIVATIONS) and round the other channels to a few levels. Dividing
channel j of the input by s_j = max|X_j|^ALPHA / max|W_:j|^(1-ALPHA) and multiplying column j of the weight by s_j
changes nothing in exact arithmetic, and every division is folded into the layer before, so it costs nothing at run
time:
  q/k/v_proj and gate/up_proj: into the RMSNorm's weight in front of them;
  o_proj: into v_proj's rows (attention output is a weighted sum of values; a factor per value channel, shared by
          the query heads of one key/value head);
  down_proj: into up_proj's rows (the MLP's activation is silu(gate) * up).
The activation maxima come from one fp32 pass over fixed calibration prompts (CALIBRATION), not from the user's
data, so the int8 weights are a function of the checkpoint alone and can be cached.
"""

from __future__ import annotations

import torch
from torch import nn

ALPHA = 0.5
CALIBRATION = (
    "I was charged twice for my subscription this month and need a refund.",
    "The app crashes with an error every time I open the dashboard after the update.",
    "How do I change the email address on my account and reset my password?",
    "Our invoices show the wrong VAT number; please send corrected copies to the finance team.",
    "The API returns a 502 for every request since this morning, our integration is down.",
    "Please close my account and delete all of my personal data.",
    "Can I pay by bank transfer instead of card, and when is the next payment due?",
    "Login with single sign-on fails for users in the new workspace; they see a blank page.",
)


def _layers(model: nn.Module):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for layer in getattr(decoder, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in names):
            continue
        if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            continue
        yield layer


@torch.inference_mode()
def _input_maxima(model: nn.Module, tokenizer) -> dict[nn.Module, torch.Tensor]:
    """max |x_j| over the calibration tokens, per input channel, for every linear layer of the decoder."""
    maxima: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        maxima[module] = torch.maximum(maxima[module], x) if module in maxima else x

    hooks = [m.register_forward_pre_hook(record) for layer in _layers(model) for m in layer.modules()
             if isinstance(m, nn.Linear)]
    device = next(model.parameters()).device
    try:
        for text in CALIBRATION:
            messages = [{"role": "system", "content": "Classify the text into one category."},
                        {"role": "user", "content": text}]
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(text)["input_ids"]
            model.base_model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _factor(x_max: torch.Tensor, w_max: torch.Tensor) -> torch.Tensor:
    s = x_max.clamp(min=1e-5).pow(ALPHA) / w_max.clamp(min=1e-5).pow(1 - ALPHA)
    return s.clamp(min=1e-3, max=1e3)


def _column_max(*linears: nn.Linear) -> torch.Tensor:
    return torch.stack([lin.weight.detach().abs().amax(dim=0).float() for lin in linears]).amax(dim=0)


def _per_kv(x: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """(H*D,) over query heads -> (Hkv*D,): the max over the query heads that share a key/value head."""
    return x.view(-1, groups, head_dim).amax(dim=1).reshape(-1)


def smoothing_factors(model: nn.Module, tokenizer) -> tuple[dict[str, tuple], dict[str, torch.Tensor]]:
    """({linear name: (multiply columns by, divide rows by)}, {parameter name: new value}) for the decoder's
    layers; the new values are the norms' weights and v_proj's bias with the divisions folded in."""
    maxima = _input_maxima(model, tokenizer)
    names = {module: name for name, module in model.named_modules()}
    factors: dict[str, tuple] = {}
    params: dict[str, torch.Tensor] = {}
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for norm, linears in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                              (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            s = _factor(maxima[linears[0]], _column_max(*linears))
            params[f"{names[norm]}.weight"] = norm.weight.detach().float() / s
            for lin in linears:
                factors[names[lin]] = (s, None)
        # o_proj: one factor per value channel; query heads sharing a key/value head share it
        groups, head_dim = attn.o_proj.in_features // attn.v_proj.out_features, attn.head_dim
        t = _factor(_per_kv(maxima[attn.o_proj], groups, head_dim), _per_kv(_column_max(attn.o_proj), groups, head_dim))
        expanded = t.view(-1, 1, head_dim).expand(-1, groups, head_dim).reshape(-1)  # (Hkv*D,) -> (H*D,)
        factors[names[attn.v_proj]] = (factors[names[attn.v_proj]][0], t)
        factors[names[attn.o_proj]] = (expanded, None)
        if attn.v_proj.bias is not None:
            params[f"{names[attn.v_proj]}.bias"] = attn.v_proj.bias.detach().float() / t
        # down_proj: into up_proj's rows
        s = _factor(maxima[mlp.down_proj], _column_max(mlp.down_proj))
        factors[names[mlp.up_proj]] = (factors[names[mlp.up_proj]][0], s)
        factors[names[mlp.down_proj]] = (s, None)
        if mlp.up_proj.bias is not None:
            params[f"{names[mlp.up_proj]}.bias"] = mlp.up_proj.bias.detach().float() / s
    return factors, params


def smoothed_weight(weight: torch.Tensor, factor: tuple | None) -> torch.Tensor:
    """(N, K) weight with its columns multiplied and its rows divided by the layer's factors."""
    weight = weight.detach().float()
    if factor is None:
        return weight
    columns, rows = factor
    if columns is not None:
        weight = weight * columns[None, :]
    if rows is not None:
        weight = weight / rows[:, None]
    return weight
