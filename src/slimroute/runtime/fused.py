"""The int8 decoder as a few native kernels per layer, between its GEMMs: what the engine runs (the reference runs the
model's own modules, and the two give the same bits).

Per layer, four GEMMs (q/k/v stacked, o_proj, gate/up stacked, down_proj) and between them one pass each
(kernels.c): the residual add + RMSNorm + row quantisation; the q/k/v scaling and bias + rotary embedding + the keys
and values written straight into the pass's buffers; attention + the quantisation for o_proj; the residual add +
RMSNorm + quantisation again; the gated MLP's middle. The down projection's residual add is folded into the next
layer's first pass (or the final norm). Nothing is copied or concatenated per layer: a batch's keys sit in buffers of
its own beside the prefix's, which every row reads in place.

`fuse(model)` gives an int8 model (quantize.py) with the batch-invariant attention this decoder, where slimroute's
native kernels run here and the model's layers are of the form it computes (pre-norm residual blocks with RMSNorm,
rotary q/k, grouped-query attention without soft caps, windows or sinks, a gated SiLU MLP: Qwen2, Llama, Mistral):
it marks the model's attention modules to run the native attention too, and checks the decoder against the model's
own forward on a probe prompt, bit for bit (every hidden state), before the engine may use it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from slimroute.runtime.attention import FUSED, NATIVE, invariant_in_use
from slimroute.runtime.int8 import ACTIVATIONS, Int8GatedMLP, Int8Linear, Int8Slice
from slimroute.runtime.native import KEY_BLOCK, Native, Tokens, native

log = logging.getLogger(__name__)

@dataclass
class KeyBuffers:
    """Keys (transposed) and values of `rows` rows, `capacity` positions each, for every layer:
    keys_t (layers, rows, kv_heads, D, capacity), values (layers, rows, kv_heads, capacity, D)."""

    keys_t: torch.Tensor
    values: torch.Tensor

    @property
    def rows(self) -> int:
        return self.keys_t.shape[1]

    def run(self, layer: int, counts) -> tuple:
        return self.keys_t[layer], self.values[layer], counts


@dataclass
class Attend:
    """What a pass's tokens (native.Tokens: R rows, M tokens) attend to, in order: the prefix's keys (all
    `prefix_count` of them), the first row_counts[m] keys of row r % rows.rows of `rows` (r: token m's row), then
    the first own_counts[m] of its row in `own`. The pass writes its keys into `own` where given, else into `rows`,
    row r's from position slots[r] on."""

    prefix: KeyBuffers | None
    prefix_count: int
    rows: KeyBuffers | None
    row_counts: torch.Tensor | None  # (M,) int64
    slots: torch.Tensor  # (R,) int64
    own: KeyBuffers | None = None
    own_counts: torch.Tensor | None = None  # (M,) int64

    def runs(self, layer: int, tokens: torch.Tensor | None = None) -> list:
        """The kernel's runs of keys for one layer (native.Native.attention), for the pass's tokens or those given."""
        prefix = None
        if self.prefix is not None and self.prefix_count:
            prefix = (self.prefix.keys_t[layer, 0], self.prefix.values[layer, 0], self.prefix_count)
        pick = (lambda counts: counts) if tokens is None else (lambda counts: counts.index_select(0, tokens))
        return [prefix, self.rows.run(layer, pick(self.row_counts)) if self.rows is not None else None,
                self.own.run(layer, pick(self.own_counts)) if self.own is not None else None]

    def written(self) -> KeyBuffers:
        return self.own if self.own is not None else self.rows


@dataclass
class _Layer:
    in_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    qkv: Int8Linear
    qkv_bias: torch.Tensor | None
    o_proj: Int8Linear
    gate_up: Int8Linear
    down: Int8Linear


class FusedDecoder:
    """The model's decoder layers as native kernels (module docstring). run() is a forward pass over a padded batch."""

    def __init__(self, model: nn.Module, kernels: Native):
        base = model.get_decoder()
        attention = base.layers[0].self_attn
        self.kernels = kernels
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.final_norm = _norm(base.norm)
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, float(attention.scaling)
        self.hidden = model.config.hidden_size
        self.layers = [_layer(layer) for layer in base.layers]
        self.act_max, self.shift = ACTIVATIONS[self.layers[0].o_proj.kernel]

    def new_keys(self, rows: int, capacity: int) -> KeyBuffers:
        capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        shape = (len(self.layers), rows, self.kv_heads)
        return KeyBuffers(torch.empty(*shape, self.head_dim, capacity), torch.empty(*shape, capacity, self.head_dim))

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, tokens: Tokens, attend: Attend,
            last: torch.Tensor | None = None, layers: tuple[int, ...] = ()):
        """A forward pass over a pass's tokens, packed without padding: ids, positions (M,), tokens (their rows and
        steps) -> (final, states): final = the final norm's output (M, H), or only at the tokens `last` (R',) when
        given, one per row in row order (the last layer's attention and MLP run on those alone: its other tokens'
        outputs are never read, and its keys and values are still written); states[k] for k in `layers` =
        the model's hidden_states[k] (M, H): the embeddings for 0, the output of layer k - 1 after. The pass's keys
        go into attend.written() at attend.slots."""
        k = self.kernels
        x = self.embed(ids).contiguous()  # (M, H): the residual stream
        cos, sin = (t[0].contiguous() for t in self.rotary(x[None], positions[None]))  # (M, D)
        written, states = attend.written(), {}
        if 0 in layers:
            states[0] = x.clone()
        delta = None  # the last GEMM's output still to be added to x: (products, row scales, bias)
        for i, layer in enumerate(self.layers):
            ints, scale = k.add_norm_to_ints(x, *layer.in_norm, self.act_max, self.shift, delta)
            queries = k.qkv_rotary(layer.qkv.integer_product(ints), scale, layer.qkv_bias, cos, sin, self.heads,
                                   self.kv_heads, tokens, written.keys_t[i], written.values[i], attend.slots)
            runs, row_starts = attend.runs(i), tokens.row_starts
            if last is not None and i == len(self.layers) - 1:  # the rest of the last layer: the tokens read alone
                queries, x, runs = queries.index_select(0, last), x.index_select(0, last), attend.runs(i, last)
                row_starts = torch.arange(last.shape[0] + 1)
            ints, scale = k.attention(queries, row_starts, self.kv_heads, self.scaling, runs, self.act_max,
                                      self.shift)
            delta = (layer.o_proj.integer_product(ints), scale, layer.o_proj.bias)
            ints, scale = k.add_norm_to_ints(x, *layer.post_norm, self.act_max, self.shift, delta)
            products = layer.gate_up.integer_product(ints)
            half = products.shape[1] // 2
            ints, scale = k.gated_to_ints(products[:, :half], products[:, half:], scale, self.act_max, self.shift)
            delta = (layer.down.integer_product(ints), scale, layer.down.bias)
            if i + 1 in layers and i + 1 < len(self.layers):
                k.add(x, *delta)
                delta = None
                states[i + 1] = x.clone()
        final = k.add_norm(x, *self.final_norm, delta)
        if len(self.layers) in layers:
            states[len(self.layers)] = final
        return final, states


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        raise ValueError(f"{type(module).__name__} is not an RMSNorm of the form the native kernels compute")
    return weight.detach().float().contiguous(), eps


def _layer(layer: nn.Module) -> _Layer:
    """A decoder layer's parts, or ValueError naming what is not of the form FusedDecoder computes."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    expected = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    if set(dict(layer.named_children())) != expected:
        raise ValueError(f"{type(layer).__name__} has parts {sorted(dict(layer.named_children()))}, not "
                         f"{sorted(expected)}")
    if not isinstance(mlp, Int8GatedMLP):
        raise ValueError(f"its MLP ({type(mlp).__name__}) is not a gated SiLU MLP")
    slices = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(s, Int8Slice) for s in slices) or len({id(s.shared) for s in slices}) != 1 or [
            s.start for s in slices] != sorted(s.start for s in slices) or slices[0].start != 0:
        raise ValueError("its q/k/v projections are not one int8 GEMM in q, k, v order")
    if set(dict(attention.named_children())) - {"q_proj", "k_proj", "v_proj", "o_proj"}:
        raise ValueError(f"its attention has more parts ({sorted(dict(attention.named_children()))}: a q/k norm?)")
    if getattr(attention, "sliding_window", None) is not None or not isinstance(attention.o_proj, Int8Linear):
        raise ValueError("its attention has a sliding window or a float o_proj")
    biases = [s.bias if s.bias is not None else torch.zeros(s.out_features) for s in slices]
    bias = torch.cat(biases).contiguous() if any(s.bias is not None for s in slices) else None
    return _Layer(_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm), slices[0].stacked, bias,
                  attention.o_proj, mlp.gate_up, mlp.down_proj)


def fused_decoder(model: nn.Module) -> FusedDecoder | None:
    """The model's FusedDecoder (fuse), or None."""
    return getattr(model, FUSED, None)


def fuse(model: nn.Module) -> str | None:
    """Give the model a FusedDecoder and the native attention (module docstring); returns why not (None: done)."""
    kernels = native()
    if kernels is None:
        return "slimroute's native kernels do not run here"
    if not invariant_in_use(model):
        return "the model's attention is not the batch-invariant kernel"
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "attn_logit_softcapping",
                                                                         None):
        return "the model soft-caps its scores"
    try:
        decoder = FusedDecoder(model, kernels)
    except (ValueError, AttributeError, TypeError) as exc:
        return f"its layers are not of the form the native kernels compute ({exc})"
    attentions = [layer.self_attn for layer in model.get_decoder().layers]
    for module in attentions:
        setattr(module, NATIVE, kernels)
    if problem := _probe(model, decoder):
        for module in attentions:
            delattr(module, NATIVE)
        return problem
    setattr(model, FUSED, decoder)
    return None


def _probe(model: nn.Module, decoder: FusedDecoder) -> str:
    """"" when the decoder gives the model's own hidden states on a probe prompt, bit for bit, else what differs."""
    generator = torch.Generator().manual_seed(0)
    length = 37  # past a few of ATen's vector widths
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator)
    with torch.inference_mode():
        own = model.get_decoder()(input_ids=ids[None], use_cache=False, output_hidden_states=True)
        tokens = Tokens.of_lengths(torch.tensor([length]))
        attend = Attend(None, 0, decoder.new_keys(1, length), tokens.steps + 1, torch.zeros(1, dtype=torch.int64))
        final, states = decoder.run(ids, tokens.steps, tokens, attend, layers=tuple(range(len(decoder.layers) + 1)))
    for k, state in sorted(states.items()):
        if not torch.equal(state, own.hidden_states[k][0]):
            return f"its hidden state {k} differs from the model's own forward on a probe prompt"
    if not torch.equal(final, own.last_hidden_state[0]):
        return "its final hidden states differ from the model's own forward on a probe prompt"
    return ""
