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

Each fold is made only where it is exact for the model at hand (other architectures than Qwen2 / Llama): a norm is
folded into only when its output is the layers' very input in the calibration pass (Olmo 2 has no norm in front of
q/k/v; Gemma 2 and 3 put pre_feedforward_layernorm, not post_attention_layernorm, before the MLP) and dividing its
weight divides its output (Llama's weight * f(x); for Gemma's f(x) * (1 + weight) the fold is (1 + weight) / s - 1);
up_proj's rows only when the MLP's output is unchanged (checked on a few rows). A group whose fold does not hold is
quantised as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from slimroute.task import chat_prompt, encode

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
    """max |x_j| over the calibration tokens, per channel, of every linear layer's input and every norm's output in
    the decoder's layers."""
    maxima: dict[nn.Module, torch.Tensor] = {}

    def keep_max(module, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        maxima[module] = torch.maximum(maxima[module], x) if module in maxima else x

    hooks = [m.register_forward_pre_hook(lambda module, args: keep_max(module, args[0]))
             for layer in _layers(model) for m in layer.modules() if isinstance(m, nn.Linear)]
    hooks += [norm.register_forward_hook(lambda module, args, out: keep_max(module, out[0] if isinstance(out, tuple)
                                                                             else out))
              for layer in _layers(model) for norm in _norms(layer)]
    device = next(model.parameters()).device
    try:
        for text in CALIBRATION:
            messages = [{"role": "system", "content": "Classify the text into one category."},
                        {"role": "user", "content": text}]
            if getattr(tokenizer, "chat_template", None):
                ids = encode(tokenizer, chat_prompt(tokenizer, messages))
            else:
                ids = tokenizer(text)["input_ids"]
            model.base_model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _norms(layer: nn.Module) -> list[nn.Module]:
    """The layer's own norms: its direct children, other than attention and MLP, with a weight vector."""
    return [module for name, module in layer.named_children() if name not in ("self_attn", "mlp")
            and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1]


def _feeding_norm(layer: nn.Module, linear: nn.Linear, maxima: dict) -> nn.Module | None:
    """The norm whose output was exactly `linear`'s input throughout the calibration pass, or None."""
    for norm in _norms(layer):
        if norm in maxima and linear in maxima and torch.equal(maxima[norm], maxima[linear]):
            return norm
    return None


@torch.no_grad()
def _divides_output(norm: nn.Module, weight: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether `norm` with `weight` gives its old output divided by s (y = weight * f(x), as Llama's RMSNorm)."""
    x = torch.randn(4, norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    x = x.to(norm.weight.device, norm.weight.dtype)
    old = norm.weight.detach().clone()
    before = norm(x).float()
    norm.weight.copy_(weight)
    try:
        after = norm(x).float()
    finally:
        norm.weight.copy_(old)
    return torch.allclose(after * s, before, rtol=1e-4, atol=1e-6)


@torch.no_grad()
def _mlp_unchanged(mlp: nn.Module, s: torch.Tensor) -> bool:
    """Whether dividing up_proj's rows by s and multiplying down_proj's columns by s leaves the MLP's output."""
    up, down = mlp.up_proj, mlp.down_proj
    x = torch.randn(4, up.in_features, generator=torch.Generator().manual_seed(0)).to(up.weight)
    saved = [p.detach().clone() for p in (up.weight, up.bias, down.weight) if p is not None]
    before = mlp(x).float()
    up.weight.div_(s[:, None].to(up.weight))
    if up.bias is not None:
        up.bias.div_(s.to(up.bias))
    down.weight.mul_(s[None, :].to(down.weight))
    try:
        after = mlp(x).float()
    finally:
        for param, value in zip([p for p in (up.weight, up.bias, down.weight) if p is not None], saved, strict=True):
            param.copy_(value)
    return bool((after - before).norm() <= 1e-4 * before.norm() + 1e-6)


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
        for linears in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            norm = _feeding_norm(layer, linears[0], maxima)
            if norm is None:
                continue
            s = _factor(maxima[linears[0]], _column_max(*linears))
            old = norm.weight.detach().float()
            weight = next((w for w in (old / s, (1 + old) / s - 1) if _divides_output(norm, w, s)), None)
            if weight is None:  # neither Llama's weight * f(x) nor Gemma's f(x) * (1 + weight)
                continue
            params[f"{names[norm]}.weight"] = weight
            for lin in linears:
                factors[names[lin]] = (s, None)
        # o_proj: one factor per value channel; query heads sharing a key/value head share it
        groups, head_dim = attn.o_proj.in_features // attn.v_proj.out_features, attn.head_dim
        t = _factor(_per_kv(maxima[attn.o_proj], groups, head_dim), _per_kv(_column_max(attn.o_proj), groups, head_dim))
        expanded = t.view(-1, 1, head_dim).expand(-1, groups, head_dim).reshape(-1)  # (Hkv*D,) -> (H*D,)
        if getattr(attn, "v_norm", None) is None:  # a norm on the values would undo the fold
            factors[names[attn.v_proj]] = (factors.get(names[attn.v_proj], (None,))[0], t)
            factors[names[attn.o_proj]] = (expanded, None)
            if attn.v_proj.bias is not None:
                params[f"{names[attn.v_proj]}.bias"] = attn.v_proj.bias.detach().float() / t
        # down_proj: into up_proj's rows
        s = _factor(maxima[mlp.down_proj], _column_max(mlp.down_proj))
        if _mlp_unchanged(mlp, s):
            factors[names[mlp.up_proj]] = (factors.get(names[mlp.up_proj], (None,))[0], s)
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
