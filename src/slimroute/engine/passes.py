"""The engine's forward passes, on the model's own forward or on its fused decoder: one class each, the same methods.

A batch pass runs right-padded items behind the cached prompt prefix; a long item runs alone in chunks, each chunk's
keys kept for the next (chunked prefill); a label's continuation runs its tokens behind each item of a batch, on
copies of the batch's rows, leaving the batch's keys unchanged. `passes_for(model, prefix_ids)` picks the fused
decoder where fuse() gave the model one (int8 with slimroute's native kernels: runtime/fused.py), else the model's
own forward (transformers' modules: every dtype, every architecture). The engine never asks which.

A pass returns the final-norm hidden states the engine reads: at each item's last token `last` (B, H), every
token's `final` (B, L, H) when asked (a head averaging states), and the decoder layers' outputs it asks for; and a
state (its keys) for the continuations.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from slimroute.engine.prefix_cache import PrefixCache, continue_cache, new_cache
from slimroute.runtime.attention import segments
from slimroute.runtime.fused import Attend, FusedDecoder, KeyBuffers, fused_decoder
from slimroute.runtime.native import Tokens


@dataclass
class Pass:
    last: torch.Tensor  # (B, H): the final-norm hidden state at each item's last token
    final: torch.Tensor | None  # (B, L, H): every token's, when asked for
    layers: tuple[torch.Tensor, ...]  # (B, L, H) each: the outputs asked for (the model's hidden_states[k])
    state: object  # what continuation() needs: the batch's keys


def passes_for(model, prefix_ids: list[int] | None):
    """The passes for this model (module docstring); prefix_ids None: no prefix cache (each item carries it)."""
    decoder = fused_decoder(model)
    return FusedPasses(decoder, model, prefix_ids) if decoder is not None else ModelPasses(model, prefix_ids)


class ModelPasses:
    """The passes through the model's own forward (transformers), with its cache objects (prefix_cache.py)."""

    def __init__(self, model, prefix_ids: list[int] | None):
        self.model = model
        self.prefix = PrefixCache(model, prefix_ids) if prefix_ids is not None else None
        layers = decoder_layers(model)
        self.last_mlp = getattr(layers[-1], "mlp", None) if layers else None
        self.device = next(model.parameters()).device

    @property
    def prefix_length(self) -> int:
        return self.prefix.length if self.prefix else 0

    def batch(self, input_ids, item_mask, lengths, every_token: bool, layers: tuple[int, ...],
              segment_start: int = 0) -> Pass:
        """input_ids, item_mask (B, L) right-padded; lengths (B,). segment_start: without the prefix cache, where the
        item starts in each sequence (the batch-invariant attention tiles its queries afresh there: segments)."""
        batch, width = input_ids.shape
        offset = self.prefix_length
        cache = self.prefix.expand(batch) if self.prefix else new_cache(self.model.config)
        mask = torch.cat([torch.ones(batch, offset, dtype=item_mask.dtype, device=self.device), item_mask], dim=1)
        positions = offset + torch.arange(width, device=self.device).expand(batch, -1)  # (B, L)
        rows = torch.arange(batch, device=self.device)
        # the last layer's MLP runs on the rows read after it alone, unless every token's state is
        last_rows = None if every_token else rows * width + lengths - 1
        with rows_only(self.last_mlp, last_rows), (segments() if self.prefix else segments(segment_start)):
            out = self.model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                        cache=cache, use_cache=True, output_hidden_states=bool(layers))
        final = out.last_hidden_state
        return Pass(final[rows, lengths - 1], final if every_token else None,
                    tuple(out.hidden_states[k] for k in layers), _ModelState(cache, mask, lengths + offset))

    def chunk(self, state, chunk_ids, start: int, total: int, every_token: bool, layers: tuple[int, ...]) -> Pass:
        """One chunk (1, C) of a long item, its tokens from `start` on (state: the last chunk's, None for the first),
        behind the prefix cache; its keys stay in the state's cache for the next chunk."""
        cache = state.cache if state is not None else self.prefix.expand(1)
        seen = self.prefix_length + start + chunk_ids.shape[1]
        mask = torch.ones(1, seen, dtype=torch.long, device=self.device)
        positions = self.prefix_length + start + torch.arange(chunk_ids.shape[1], device=self.device)[None]
        last_row = None if every_token else torch.tensor([chunk_ids.shape[1] - 1], device=self.device)
        with rows_only(self.last_mlp, last_row), segments():
            out = self.model.base_model(input_ids=chunk_ids, attention_mask=mask, position_ids=positions,
                                        cache=cache, use_cache=True, output_hidden_states=bool(layers))
        final = out.last_hidden_state
        return Pass(final[:, -1], final if every_token else None, tuple(out.hidden_states[k] for k in layers),
                    _ModelState(cache, mask, torch.tensor([seen], device=self.device)))

    def continuation(self, state: _ModelState, runs: list[tuple[int, ...]], pad_id: int) -> list[torch.Tensor]:
        """For each run of tokens, the final hidden states (B, n, H) after each of its tokens, fed behind each item,
        in one pass: each run gets its own copy of the batch's rows (right-padded to the longest run), so each row
        sees what the run's own pass would show it (its keys in the same order, its queries in the same tiles:
        attention.segments). The batch cache is left unchanged."""
        mask, ends = state.mask, state.ends
        batch, copies = mask.shape[0], len(runs)
        tokens, fed = _run_tokens(runs, batch, pad_id, mask.dtype, self.device)  # (C, B, n) each
        steps = tokens.shape[2]
        positions = (ends[:, None] + torch.arange(steps, device=self.device)).repeat(copies, 1)  # (C * B, n)
        mask = torch.cat([mask.repeat(copies, 1), fed.view(copies * batch, steps)], dim=1)
        with segments(continuation=0):  # every query of this pass continues a label (attention.segments)
            out = self.model.base_model(
                input_ids=tokens.view(copies * batch, steps), attention_mask=mask, position_ids=positions,
                cache=continue_cache(state.cache, self.model.config, copies, state.shared), use_cache=True,
            )
        hidden = out.last_hidden_state.view(copies, batch, steps, -1)
        return [hidden[j, :, :len(run)] for j, run in enumerate(runs)]


@dataclass
class _ModelState:
    cache: object  # the batch's transformers cache, behind the prefix's keys
    mask: torch.Tensor  # (B, P + L): which keys each row holds
    ends: torch.Tensor  # (B,): where each row's next token goes
    shared: list = field(default_factory=list)  # its keys as every continuation pass reads them (continue_cache)

    @property
    def num_keys(self) -> int:
        return self.mask.shape[1]


class FusedPasses:
    """The passes through the model's FusedDecoder: each pass's tokens packed without padding, the batch's keys in
    buffers beside the prefix's, read in place."""

    def __init__(self, decoder: FusedDecoder, model, prefix_ids: list[int] | None):
        self.decoder, self.model = decoder, model
        self.prefix = _FusedPrefix(decoder, prefix_ids) if prefix_ids is not None else None

    @property
    def prefix_length(self) -> int:
        return self.prefix.length if self.prefix else 0

    def _attend(self, keys: KeyBuffers, counts: torch.Tensor, slots: torch.Tensor) -> Attend:
        return Attend(self.prefix.keys if self.prefix else None, self.prefix_length, keys, counts, slots)

    def batch(self, input_ids, item_mask, lengths, every_token: bool, layers: tuple[int, ...],
              segment_start: int = 0) -> Pass:
        batch, width = input_ids.shape
        tokens = Tokens.of_lengths(lengths)
        keys = self.decoder.new_keys(batch, width)
        attend = self._attend(keys, tokens.steps + 1, torch.zeros(batch, dtype=torch.int64))  # step t: keys 0..t
        last = tokens.row_starts[1:] - 1
        final, states = self.decoder.run(input_ids[item_mask.bool()], self.prefix_length + tokens.steps, tokens,
                                         attend, None if every_token else last, layers)
        padded = item_mask.bool()
        return Pass(final.index_select(0, last) if every_token else final,
                    _unpacked(final, padded) if every_token else None,
                    tuple(_unpacked(states[k], padded) for k in layers),
                    _FusedState(keys, lengths, self.prefix_length + lengths, self.prefix_length + width))

    def chunk(self, state, chunk_ids, start: int, total: int, every_token: bool, layers: tuple[int, ...]) -> Pass:
        size = chunk_ids.shape[1]
        keys = state.keys if state is not None else self.decoder.new_keys(1, total)
        tokens = Tokens.of_lengths(torch.tensor([size]))
        attend = self._attend(keys, start + tokens.steps + 1, torch.tensor([start]))
        last = torch.tensor([size - 1])
        final, states = self.decoder.run(chunk_ids[0], self.prefix_length + start + tokens.steps, tokens, attend,
                                         None if every_token else last, layers)
        seen = torch.tensor([start + size])
        return Pass(final[-1:], final[None] if every_token else None, tuple(states[k][None] for k in layers),
                    _FusedState(keys, seen, self.prefix_length + seen, self.prefix_length + start + size))

    def continuation(self, state: _FusedState, runs: list[tuple[int, ...]], pad_id: int) -> list[torch.Tensor]:
        """As ModelPasses.continuation, each run's tokens packed behind its copy of the rows: each copy reads the
        batch's keys in place (the first `lengths` of its row), then its own."""
        batch, copies = state.lengths.shape[0], len(runs)
        sizes = torch.tensor([len(run) for run in runs for _ in range(batch)])  # row j * B + b: run j behind item b
        tokens = Tokens.of_lengths(sizes)
        ids = torch.tensor([token for run in runs for _ in range(batch) for token in run])
        item = tokens.rows % batch  # the batch row each token continues
        own = self.decoder.new_keys(copies * batch, max(map(len, runs)))
        attend = Attend(self.prefix.keys if self.prefix else None, self.prefix_length, state.keys,
                        state.lengths.index_select(0, item).to(torch.int64).contiguous(),
                        torch.zeros(copies * batch, dtype=torch.int64), own, tokens.steps + 1)
        final, _ = self.decoder.run(ids, state.ends.index_select(0, item) + tokens.steps, tokens, attend)
        return [final[tokens.row_starts[j * batch]:tokens.row_starts[(j + 1) * batch]].view(batch, len(run), -1)
                for j, run in enumerate(runs)]


def _unpacked(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Packed tokens' rows (M, H) back into the padded batch (B, L, H) (zeros at the padding)."""
    out = packed.new_zeros(*mask.shape, packed.shape[-1])
    out[mask] = packed
    return out


@dataclass
class _FusedState:
    keys: KeyBuffers  # the batch's own keys, behind the prefix's
    lengths: torch.Tensor  # (B,): each row's real keys in them
    ends: torch.Tensor  # (B,): where each row's next token goes
    num_keys: int  # keys a row holds, padding included (the prefix's and the batch's)


class _FusedPrefix:
    """The prompt prefix's keys and values through the fused decoder, computed once."""

    def __init__(self, decoder: FusedDecoder, prefix_ids: list[int]):
        self.length = len(prefix_ids)
        self.keys = decoder.new_keys(1, max(self.length, 1))
        if prefix_ids:
            tokens = Tokens.of_lengths(torch.tensor([self.length]))
            attend = Attend(None, 0, self.keys, tokens.steps + 1, torch.zeros(1, dtype=torch.int64))
            decoder.run(torch.tensor(prefix_ids), tokens.steps, tokens, attend, last=torch.tensor([self.length - 1]))

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The keys (transposed) and values per layer: (1, Hkv, D, P'), (1, Hkv, P', D) (P' >= P: whole blocks)."""
        return list(zip(self.keys.keys_t, self.keys.values, strict=True))


def _run_tokens(runs, batch: int, pad_id: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs' tokens, one copy of the batch's rows per run, right-padded to the longest: (C, B, n) tokens and
    (C, B, n) fed (1 for a run's own tokens)."""
    steps = max(len(run) for run in runs)
    tokens = torch.full((len(runs), batch, steps), pad_id, device=device)
    fed = torch.zeros(len(runs), batch, steps, dtype=dtype, device=device)
    for j, run in enumerate(runs):
        tokens[j, :, :len(run)] = torch.tensor(run, device=device)
        fed[j, :, :len(run)] = 1
    return tokens, fed


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: its first ModuleList (`model.layers` in Qwen2, Llama, Mistral...); [] if none."""
    return next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [])


@contextmanager
def rows_only(module: torch.nn.Module | None, index: torch.Tensor | None):
    """While inside, module (a row-wise one: an MLP) runs only on the rows `index` of its flattened (..., H)
    input; the other rows of its output are zeros. Nothing changes when module or index is None. The hooks are
    the module's while inside, so one forward pass at a time per model (as the server's one worker thread runs
    them; int8's row quantisers already ask for that)."""
    if module is None or index is None:
        yield
        return
    shape: list[torch.Size | None] = []

    def take(_, args):
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):  # called another way: left whole
            shape.append(None)
            return None
        x = args[0]
        shape.append(x.shape)
        rows = x.reshape(-1, x.shape[-1]).index_select(0, index)
        return (rows.view(*[1] * (x.dim() - 2), *rows.shape),)  # as many dimensions as before (an MoE block's 3)

    def put(_, args, out):
        if (whole := shape.pop()) is None:
            return None
        rows = out[0] if isinstance(out, tuple) else out  # an MoE block's (hidden states, router logits)
        full = rows.new_zeros(*whole[:-1], rows.shape[-1])
        full.view(-1, rows.shape[-1]).index_copy_(0, index, rows.reshape(-1, rows.shape[-1]))
        return (full, *out[1:]) if isinstance(out, tuple) else full

    handles = (module.register_forward_pre_hook(take), module.register_forward_hook(put))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
