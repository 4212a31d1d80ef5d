"""Batch-invariant attention: each query's output has the same bits whatever the batch, the padding, the cached
prefix or the number of queries computed with it. The int8 model uses it (int8 rounds whole rows: a 1e-7 difference
in attention would become a different integer somewhere downstream, and a different answer).

Why the usual kernels are not: SDPA's CPU kernel picks its blocks from the sequence lengths, and a GEMM's summation
order can follow its shapes, so a query's sum over keys rounds differently when the batch is padded, when the prefix
comes from a cache, or when a label's continuation sits behind a batch's padding instead of right after the text.

What this does instead, with a fixed reduction order that depends only on the key positions a query sees:
1. keys no query of a row can see (a batch's padding) move behind the visible ones, order kept, so a query's
   visible keys always start at index 0 in position order, as in the one-at-a-time prompt;
2. queries and keys are cut into tiles of TILE positions (zero-padded); scores and weighted sums are products of
   fixed-shape tiles whatever the lengths: a query tile holds the TILE positions of all G query heads that share
   a key head (grouped-query attention), so each score GEMM is (G*TILE x D) @ (D x TILE) and each weighted sum
   (G*TILE x TILE) @ (TILE x D), the shared key tile read once for its G heads;
3. softmax runs over the padded key rows (masked keys get -inf added, so they are exact zeros: trailing tiles add
   +0 to every partial sum);
4. the tiles' partial sums over keys are added in key order, one tile after another.
Each GEMM also gets its operands in one layout whatever the batch (MKL's AVX2 kernels round a transposed key
tile differently from a contiguous one), and a query sits in the same row of its tile whichever path computes it
(so a kernel that rounded a row by where it sits could not tell the paths apart either): query tiles start where
the fast path's forward passes start, at the cached prefix's end and at a label's continuation. The one-at-a-time
path, which runs prefix, item and continuation as one sequence, says where those are (`segments`), and its queries
are tiled segment by segment, each segment from a fresh tile. A label's continuation (the few tokens of a
multi-token label fed behind the item, in a pass of their own for a whole batch) has its queries tiled
CONTINUATION_TILE positions at a time in both paths: a 32-position tile would hold one real query of a two-token
label and 31 of padding, 32 times the work of its few scores (on the packaged 0.5B model, with three two-token
labels, the continuation passes were then over a quarter of the time, mostly attention tiles).
The mask's share of this (the key order, the padded additive mask) is the same in every layer of a forward pass,
so it is worked out once per mask and reused. A batch's continuation passes all read the batch's cached keys: those
are cut into tiles once per batch and layer (CachedKeys), and a pass copies only the tiles its new keys go into.
About 4% of an item's FLOPs on a 0.5B model at ticket lengths.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from slimroute.runtime.int8 import Int8Linear

NAME = "slimroute_invariant"
NATIVE = "slimroute_native"  # an attention module carrying native.Native here runs the native kernel (fused.fuse)
FUSED = "slimroute_fused"  # where fused.fuse keeps a model's FusedDecoder
ATTENTION = ("auto", "eager", "sdpa", "invariant")  # the choices of --attention / load_model(attention=)
TILE = 32  # key positions per tile, and query positions per tile but in a label's continuation
CONTINUATION_TILE = 1  # query positions per tile in a label's continuation
QUERY_TILES = 4  # query tiles of TILE positions per pass (memory only: the bits do not depend on it)
# (the positions where a new segment of queries starts, where a label's continuation starts or None)
_SEGMENTS: ContextVar[tuple[tuple[int, ...], int | None]] = ContextVar("slimroute_attention_segments",
                                                                     default=((), None))


@contextmanager
def segments(*starts: int, continuation: int | None = None):
    """While inside, a forward pass tiles its queries afresh at each of these positions (where the fast path starts
    a forward pass: the prefix's length), and the queries from position `continuation` on (a label's tokens
    behind the item) CONTINUATION_TILE at a time, so every query sits in the row of its tile the fast path puts it
    in. For the one-at-a-time path; the fast path's passes each start a segment by themselves, and its
    continuation passes say so with continuation=0 (every query of the pass)."""
    token = _SEGMENTS.set((tuple(sorted(set(starts))), continuation))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def _tiles(x: torch.Tensor, length: int, tile: int = TILE) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, n, tile, D), zero-padded to n * tile positions."""
    pad = length - x.shape[2]
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    b, h, _, d = x.shape
    return x.reshape(b, h, length // tile, tile, d)


def invariant_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """query (B, H, Lq, D); key, value (B, Hkv, Lk, D); attention_mask (B, 1, Lq, Lk), True where a query may
    attend (an additive float mask, 0 where allowed, works too). Returns ((B, Lq, H, D), None). softcap (Gemma 2):
    the scores go through softcap * tanh(scores / softcap) before the mask, as in the model's own attention."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("the batch-invariant attention has no attention sinks (s_aux); load this model "
                                  "with --dtype float32 or bfloat16")
    if (kernels := getattr(module, NATIVE, None)) is not None:  # a fused model's: the kernel its FusedDecoder runs
        if hasattr(key, CachedKeys.MARK) or kwargs.get("softcap") is not None:
            raise NotImplementedError("a fused model's native attention reads whole keys without a soft cap; its "
                                      "engine passes go through its FusedDecoder (engine/passes.py)")
        return _native_attention(kernels, query, key, value, attention_mask, scaling), None
    scaling = (scaling, kwargs.get("softcap"))
    starts, continuation = _SEGMENTS.get()
    cached: CachedKeys | None = getattr(key, CachedKeys.MARK, None)  # a continuation pass's new keys only
    cache = key.shape[2] + (cached.length if cached else 0) - query.shape[2]  # the keys before the first query
    num_queries = query.shape[2]
    cuts = [start - cache for start in starts if 0 < start - cache < num_queries]  # starts, as query indices
    split = num_queries if continuation is None else min(max(continuation - cache, 0), num_queries)
    if split == 0:  # a continuation pass
        return _attention(query, key, value, attention_mask, scaling, CONTINUATION_TILE), None
    if cached:
        key, value = cached.extended(key), cached.extended(value, values=True)
    if split == num_queries:
        return _segmented_attention(query, key, value, attention_mask, scaling, cuts), None
    # a sequence and a label's tokens behind it (the one-at-a-time path): each part tiled as its own
    mask = _allowed(attention_mask, query.shape[0], num_queries, key.shape[2], query.device)
    head = _segmented_attention(query[:, :, :split], key, value, mask[:, :, :split], scaling,
                                [cut for cut in cuts if cut < split])
    tail = _attention(query[:, :, split:], key, value, mask[:, :, split:], scaling, CONTINUATION_TILE)
    return torch.cat([head, tail], dim=1), None


def _native_attention(kernels, query, key, value, attention_mask, scaling: float) -> torch.Tensor:
    """The native kernel's attention (kernels.c sr_attention: one query at a time, its keys in position order, one
    fixed order of operations) for a mask under which each query sees the keys [0, n) (causal, right-padded rows,
    as the model's own forward gets them in slimroute): (B, Lq, H, D)."""
    batch, heads, num_queries, head_dim = query.shape
    num_keys = key.shape[2]
    allowed = _allowed(attention_mask, batch, num_queries, num_keys, query.device)[:, 0]  # (B, Lq, Lk)
    counts = allowed.sum(dim=-1)  # (B, Lq)
    if not torch.equal(allowed, torch.arange(num_keys, device=query.device) < counts[..., None]):
        raise ValueError("the native attention needs each query's keys to be the first n of its row (a causal mask, "
                         "right padding); this mask is not")
    pad = -num_keys % 16  # the kernel's key buffers hold whole blocks of 16 positions
    keys_t = F.pad(key.transpose(-1, -2), (0, pad)).contiguous()  # (B, Hkv, D, Lk')
    values = F.pad(value, (0, 0, 0, pad)).contiguous()  # (B, Hkv, Lk', D)
    queries = query.transpose(1, 2).reshape(batch * num_queries, heads, head_dim).contiguous()  # each row's in turn
    row_starts = torch.arange(0, batch * num_queries + 1, num_queries, device=query.device)
    out = kernels.attention(queries, row_starts, key.shape[1], scaling,
                            [None, (keys_t, values, counts.reshape(-1).to(torch.int64).contiguous())])
    return out.view(batch, num_queries, heads, head_dim)


def _segmented_attention(query, key, value, attention_mask, scaling, cuts: list[int]) -> torch.Tensor:
    """_attention with the queries tiled TILE at a time, afresh at each of the query indices `cuts`."""
    if cuts:
        query, attention_mask, real = _segment_aligned(query, attention_mask, key.shape[2], cuts)
        return _attention(query, key, value, attention_mask, scaling).index_select(1, real)
    return _attention(query, key, value, attention_mask, scaling)


def _attention(query, key, value, attention_mask, scaling, q_tile: int = TILE) -> torch.Tensor:
    """invariant_attention for queries tiled from the first, q_tile positions a tile: (B, Lq, H, D). key and value
    may be a continuation pass's new ones only, marked with the batch's cached ones (CachedKeys)."""
    batch, heads, num_queries, head_dim = query.shape
    cached: CachedKeys | None = getattr(key, CachedKeys.MARK, None)
    kv_heads, num_keys = key.shape[1], key.shape[2] + (cached.length if cached else 0)
    groups = heads // kv_heads
    plan = _mask_plan(attention_mask, batch, num_queries, num_keys, query.device, q_tile)
    q_len, k_len = -(-num_queries // q_tile) * q_tile, -(-num_keys // TILE) * TILE
    tiles = cached.tiles(key, value, plan, k_len) if cached else None
    if tiles is None:
        if cached:  # its layout is not one CachedKeys handles: the keys in full
            key, value = cached.extended(key), cached.extended(value, values=True)
        tiles = _tiled(key, value, plan.order, k_len)

    # 2. tiles: queries (B, Hkv, G, nq, T, D); keys and values (B, Hkv, nk, T, D). Long inputs run QUERY_TILES
    # query tiles at a time (rows are independent; this only bounds the scores' memory).
    nq = q_len // q_tile
    q_tiles = _tiles(query, q_len, q_tile).view(batch, kv_heads, groups, nq, q_tile, head_dim)
    chunks = []
    step = QUERY_TILES * TILE // q_tile  # query tiles at a time
    for a in range(0, nq, step):
        nk = max(plan.key_tiles[a:a + step])  # key tiles behind the last one these queries see: skipped
        chunks.append(_attend(q_tiles[:, :, :, a:a + step], tiles, nk,
                              plan.bias[:, :, a:a + step, :, :, :nk * TILE], scaling))
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)  # (B, Hkv, nq, G, T, D)
    out = out.permute(0, 2, 4, 1, 3, 5).reshape(batch, q_len, heads, head_dim)  # head h = kv head h // G, as GQA
    return out[:, :num_queries].contiguous()


class _Tiles:
    """Key tile j (B, Hkv, D, T: transposed) and value tile j (B, Hkv, T, D) of a pass's keys in attention order."""

    def __init__(self, k_tiles: torch.Tensor, v_tiles: torch.Tensor):
        self.k_tiles, self.v_tiles = k_tiles, v_tiles  # (B, Hkv, nk, D, T), (B, Hkv, nk, T, D)

    def key(self, j: int) -> torch.Tensor:
        return self.k_tiles[:, :, j]

    def value(self, j: int) -> torch.Tensor:
        return self.v_tiles[:, :, j]


def _tiled(key, value, order, k_len: int) -> _Tiles:
    """1. visible keys first, in position order (order: None when they are), cut into tiles. The key tiles go in
    transposed and contiguous whatever the chunk (matmul copies a broadcast operand, so a transposed view would
    reach MKL as a transposed operand for one query tile and as a contiguous one for more: on AVX2 the two round
    differently)."""
    if order is not None:
        batch, kv_heads, num_keys, head_dim = key.shape
        gather = order[..., None].expand(batch, kv_heads, num_keys, head_dim)
        key, value = key.gather(2, gather), value.gather(2, gather)
    return _Tiles(_tiles(key, k_len).transpose(-1, -2).contiguous(), _tiles(value, k_len))


class CachedKeys:
    """A batch's cached keys and values (B, Hkv, P, D) as every continuation pass over the batch reads them: cut
    into attention's tiles once (keys transposed), instead of copied behind each pass's rows (a pass of C copies
    of the batch, C * B rows, its keys the cache's then its own) and put in attention order and tiles again in
    every layer of every pass (on BANKING77's 77 labels, with a 394-token prefix, those copies were a quarter of
    the time). A pass's layer hands attention its new keys only, marked with this (MARK); a key tile that holds
    no visible new key is the cached tile itself, and one that does is a copy of it with the new keys written in
    where attention order puts them (right behind the row's visible cached keys). Same tiles, same bits."""

    MARK = "slimroute_cached"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.length = keys.shape[2]
        self._tiles: _CachedTiles | None = None

    def mark(self, new_keys: torch.Tensor) -> torch.Tensor:
        setattr(new_keys, self.MARK, self)
        return new_keys

    def extended(self, new: torch.Tensor, values: bool = False) -> torch.Tensor:
        """The cached keys (or values) repeated for each copy of the batch in new's rows, then new behind them."""
        cached = self.values if values else self.keys
        return extended(cached, new, new.shape[0] // cached.shape[0])

    def tiles(self, new_keys, new_values, plan: _Plan, k_len: int) -> _PatchedTiles | None:
        """The pass's key and value tiles, or None when its attention order moves a visible cached key (the cached
        keys of a row are not all in front of the others: only right-padded batches are handled)."""
        patches = plan.continuation_patches(self.length)
        if patches is None:
            return None
        if self._tiles is None or self._tiles.k_tiles.shape[2] * TILE < k_len:
            self._tiles = _CachedTiles(self.keys, self.values, k_len + TILE)  # a longer run may come
        return _PatchedTiles(self._tiles, new_keys, new_values, patches)


class _CachedTiles(_Tiles):
    """A cache's tiles up to k_len keys (zero-padded): the keys' transposed (a copy, as _tiled makes them); the
    values' read in place where a tile is whole (the same layout as a tile of _tiled's), copied only for the last."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, k_len: int):
        rows_in_order = values.stride()[-2:] == (values.shape[-1], 1)  # else every tile a copy, as _tiled's
        self.values, self.whole = values, values.shape[2] // TILE if rows_in_order else 0
        rest = self.whole * TILE
        super().__init__(_tiles(keys, k_len).transpose(-1, -2).contiguous(), _tiles(values[:, :, rest:], k_len - rest))

    def value(self, j: int) -> torch.Tensor:
        if j < self.whole:
            return self.values[:, :, j * TILE:(j + 1) * TILE]
        return self.v_tiles[:, :, j - self.whole]


class _PatchedTiles:
    """The cached tiles for each copy of the batch, with a pass's new keys written into the tiles that hold them."""

    def __init__(self, cached: _CachedTiles, new_keys: torch.Tensor, new_values: torch.Tensor, patches: dict):
        self.cached, self.new_keys, self.new_values, self.patches = cached, new_keys, new_values, patches
        self.copies = new_keys.shape[0] // cached.k_tiles.shape[0]

    def key(self, j: int) -> torch.Tensor:
        return self._tile(self.cached.key(j), self.new_keys, j, transposed=True)  # (C * B, Hkv, D, T)

    def value(self, j: int) -> torch.Tensor:
        return self._tile(self.cached.value(j), self.new_values, j, transposed=False)  # (C * B, Hkv, T, D)

    def _tile(self, cached: torch.Tensor, new_states: torch.Tensor, j: int, transposed: bool) -> torch.Tensor:
        """Tile j for every row: the cached one (itself when the batch is not copied), or a copy of it with the
        pass's new keys (or values) that fall in it written where attention order puts them."""
        if j not in self.patches:
            return cached if self.copies == 1 else cached.repeat(self.copies, 1, 1, 1)
        rows, at, new = self.patches[j]
        tile = cached.repeat(self.copies, 1, 1, 1)
        (tile.transpose(-1, -2) if transposed else tile)[rows, :, at, :] = new_states[rows, :, new, :]
        return tile


def _allowed(attention_mask, batch: int, num_queries: int, num_keys: int, device) -> torch.Tensor:
    """The mask as booleans (B, 1, Lq, Lk), True where a query may attend."""
    if attention_mask is None:
        return torch.ones(batch, 1, num_queries, num_keys, dtype=torch.bool, device=device)
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask[:, :, :, :num_keys]
    else:
        allowed = attention_mask[:, :, :, :num_keys] == 0
    return allowed.expand(batch, 1, num_queries, num_keys)


def _segment_aligned(query, attention_mask, num_keys: int, cuts: list[int]):
    """query (B, H, Lq, D) and its mask with each segment between cuts zero-padded to whole tiles (padding
    queries see key 0 alone), and the indices of the real queries among the padded ones."""
    batch, _, num_queries, _ = query.shape
    attention_mask = _allowed(attention_mask, batch, num_queries, num_keys, query.device)
    queries, masks, real, at = [], [], [], 0
    for start, end in zip([0, *cuts], [*cuts, num_queries], strict=True):
        pad = -(end - start) % TILE
        queries.append(F.pad(query[:, :, start:end], (0, 0, 0, pad)))
        seg_mask = F.pad(attention_mask[:, :, start:end], (0, 0, 0, pad))
        seg_mask[:, :, end - start:, 0] = True
        masks.append(seg_mask)
        real.append(torch.arange(at, at + end - start, device=query.device))
        at += end - start + pad
    return torch.cat(queries, dim=2), torch.cat(masks, dim=2), torch.cat(real)


class _Plan:
    """What attention needs of a mask, the same in every layer of a forward pass (_mask_plan)."""

    def __init__(self, order, bias, key_tiles: list[int], visible: torch.Tensor):
        self.order, self.bias, self.key_tiles = order, bias, key_tiles
        self.visible = visible  # (B,): how many keys stay in front in attention order (all the row's seen ones)
        self._patches: dict[int, dict | None] = {}

    def continuation_patches(self, cached: int) -> dict | None:
        """For keys that are `cached` cached ones then a pass's own: {key tile j: (rows, places in the tile, new
        key indices)} of the new keys some query sees, in attention order; None when a visible cached key does
        not keep its own index there."""
        if cached not in self._patches:
            batch = self.visible.shape[0]
            num_keys = self.bias.shape[-1]  # padded to whole tiles; attention order's real keys come first
            index = torch.arange(num_keys, device=self.visible.device).expand(batch, num_keys)
            source = index if self.order is None else F.pad(self.order[:, 0], (0, num_keys - self.order.shape[-1]))
            visible = index < self.visible[:, None]
            moved = visible & (source < cached) & (source != index)
            patches = None
            if not bool(moved.any()):
                rows, at = (visible & (source >= cached)).nonzero(as_tuple=True)
                new, tile = source[rows, at] - cached, at // TILE
                patches = {j: (rows[tile == j], at[tile == j] % TILE, new[tile == j]) for j in tile.unique().tolist()}
            self._patches[cached] = patches
        return self._patches[cached]


_plan: tuple = (None,)  # (weakref to a mask, shape, plan): the last mask's plan; a forward pass hands every layer
# the same mask object. The plan goes when its mask does (the bias is a float per query and key of the batch).


def _forget(ref) -> None:
    global _plan
    if _plan[0] is ref:
        _plan = (None,)


def _mask_plan(attention_mask, batch: int, num_queries: int, num_keys: int, device, q_tile: int = TILE) -> _Plan:
    """The plan of a mask: order (B, 1, Lk) puts the keys no query of a row sees (a batch's padding) behind the
    visible ones, order kept (None when none is in front of a visible one); bias (B, 1, nq, 1, q_tile, Lk'), 0
    where a query may attend and -inf elsewhere, in the keys' new order, padded to whole tiles; key_tiles[a]: how
    many key tiles hold a key some query of query tile a sees (in any row; a causal mask's later tiles are all
    hidden from early queries: their softmax terms and products would be exact zeros); visible (B,): how many
    keys stay in front (the row's seen keys, and any hidden before the first of them)."""
    global _plan
    edits = 0 if attention_mask is None or attention_mask.is_inference() else attention_mask._version  # in place
    shape = (batch, num_queries, num_keys, str(device), edits, q_tile)
    cached, *rest = _plan
    if attention_mask is not None and cached is not None and cached() is attention_mask and rest[0] == shape:
        return rest[1]
    allowed = _allowed(attention_mask, batch, num_queries, num_keys, device)
    hidden = ~allowed.any(dim=2)  # (B, 1, Lk): no query of the row sees it
    # Keys hidden before the row's first seen one (a sliding window's, behind it) keep their places: which keys a
    # query sees is its own window's doing, not the other queries' of the pass, and moving them would shift the
    # later keys into other tiles than the one-at-a-time prompt's. The hidden keys after it (padding) move behind.
    behind = hidden & (torch.cumsum(~hidden, dim=-1) > 0)
    order = None
    if bool((behind[..., :-1] & ~behind[..., 1:]).any()):  # a key to move in front of one that stays
        order = torch.sort(behind.to(torch.uint8), dim=-1, stable=True).indices  # (B, 1, Lk)
        allowed = allowed.gather(3, order[:, :, None, :].expand(batch, 1, num_queries, num_keys))
    q_len, k_len = -(-num_queries // q_tile) * q_tile, -(-num_keys // TILE) * TILE
    mask = F.pad(allowed, (0, k_len - num_keys, 0, q_len - num_queries))  # (B, 1, Lq', Lk')
    mask[:, :, num_queries:, 0] = True  # padded queries may see key 0 (their rows are dropped, but stay finite)
    bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
    seen = mask.any(dim=0)[0].view(q_len // q_tile, q_tile, k_len).any(dim=1)  # (nq, Lk'): a key some query sees
    last_seen = (seen * torch.arange(1, k_len + 1, device=device)).amax(dim=1)  # 1 + the last such key's index
    key_tiles = (-(-last_seen // TILE)).clamp_(min=1).tolist()  # a tile of queries that see nothing: 1 (all -inf)
    plan = _Plan(order, bias.view(batch, 1, q_len // q_tile, 1, q_tile, k_len), key_tiles,
                 (~behind[:, 0]).sum(dim=-1))
    if attention_mask is not None:
        _plan = (weakref.ref(attention_mask, _forget), shape, plan)
    return plan


def _attend(q_tiles, tiles, nk: int, bias, scaling) -> torch.Tensor:
    """Queries (B, Hkv, G, c, Tq, D) against the first nk key tiles (tiles.key(j): (B, Hkv, D, T), transposed;
    tiles.value(j): (B, Hkv, T, D)), bias (B, 1, c, 1, Tq, nk * T) -> (B, Hkv, c, G, Tq, D). scaling: (the scores'
    scale, the soft cap or None)."""
    scaling, softcap = scaling
    batch, kv_heads, groups, c, q_tile, head_dim = q_tiles.shape
    q = q_tiles.transpose(2, 3).reshape(batch, kv_heads, c, groups * q_tile, head_dim)  # G heads x Tq positions
    # scores tile by tile, one key tile at a time, straight into (query, key) order
    scores = q.new_empty(batch, kv_heads, c, groups * q_tile, nk, TILE)
    for j in range(nk):
        scores[:, :, :, :, j] = _tile_scores(q, tiles.key(j)[:, :, None])
    # 3. softmax over padded key rows (masked keys: -inf added, exact zeros after it)
    scores = scores.view(batch, kv_heads, c, groups, q_tile, nk * TILE).mul_(scaling)
    if softcap is not None:  # elementwise: each score's bits its own
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.add_(bias)
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, c, groups * q_tile, nk, TILE)
    # 4. per-tile weighted sums, added in key order: out = p_0 @ v_0, then out += p_j @ v_j in the GEMM's epilogue
    # (baddbmm_: no product tensor; the same bits as adding it, 9% less time on captured real shapes)
    out = q.new_empty(batch * kv_heads * c, groups * q_tile, head_dim)
    for j in range(nk):
        v = tiles.value(j)[:, :, None].expand(batch, kv_heads, c, TILE, head_dim).reshape(-1, TILE, head_dim)
        _add_weighted_sum(out, probs[:, :, :, :, j].reshape(-1, groups * q_tile, TILE), v, first=not j)
    return out.view(batch, kv_heads, c, groups, q_tile, head_dim)


# The tiles' two GEMMs (a test swaps in GEMMs that round a row by where it sits, as MKL's AVX2 kernels do)
def _tile_scores(q: torch.Tensor, k_transposed: torch.Tensor) -> torch.Tensor:
    return torch.matmul(q, k_transposed)


def _add_weighted_sum(out: torch.Tensor, probs: torch.Tensor, v: torch.Tensor, first: bool) -> None:
    out.baddbmm_(probs, v, beta=0 if first else 1)


def register() -> str:
    """Make NAME a valid `attn_implementation` (with boolean masks, never skipped); returns NAME."""
    AttentionInterface.register(NAME, invariant_attention)
    AttentionMaskInterface.register(NAME, _boolean_mask)
    return NAME


def _boolean_mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False  # always a mask: the kernel above has no implicit causal mode
    return sdpa_mask(*args, **kwargs)


def extended(cached: torch.Tensor, new: torch.Tensor, repeats: int) -> torch.Tensor:
    """cached (B, H, P, D) repeated to (repeats * B, ...), then new (repeats * B, H, L, D) behind it: one copy."""
    batch, heads, length, dim = cached.shape
    out = new.new_empty(repeats * batch, heads, length + new.shape[2], dim)
    out[:, :, :length].view(repeats, batch, heads, length, dim).copy_(cached)
    out[:, :, length:] = new
    return out


def pick_attention(device: torch.device | str, dtype: torch.dtype, attention: str = "auto", int8: bool = False) -> str:
    """"auto": the batch-invariant kernel (attention.py) for int8, eager for bf16 on CPU, else sdpa.

    Why: bf16 results must not depend on the batch. Its GEMMs (oneDNN, fp32 accumulation) give each row
    the same bits whatever the other rows, but SDPA's CPU flash kernel picks its block sizes from the
    sequence lengths, so a cached prefix or a padded batch rounds differently from the one-at-a-time
    prompt. Eager attention (bf16 matmuls, fp32 softmax; padded keys add exact zeros) gives the reference's
    bits. int8 needs more: every fp32 op must give the same bits, or a row quantises differently; eager's
    matmuls still follow the padded shapes on AVX2, the invariant kernel does not. fp32 differences are ~1e-5
    either way, so fp32 keeps the faster kernel."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if attention != "auto":
        return attention
    if int8:
        return "invariant"
    return "eager" if torch.device(device).type == "cpu" and dtype == torch.bfloat16 else "sdpa"


def invariant_in_use(model: nn.Module) -> bool:
    """Whether the model runs the batch-invariant attention (set_attention)."""
    return getattr(model.config, "_attn_implementation", None) == NAME


def set_attention(model: nn.Module, attention: str = "auto") -> str:
    """Set the attention implementation (the reference and the engine share it); returns the one in use."""
    param = next(model.parameters())
    int8 = any(isinstance(m, Int8Linear) for m in model.modules())
    used = pick_attention(param.device, param.dtype, attention, int8)
    if used == "sdpa" and not getattr(model, "_supports_sdpa", True):
        used = "eager"  # Gemma 2: torch's sdpa cannot soft-cap its scores
    for module in model.modules():  # a fused model's native attention goes with its decoder (fused.fuse again)
        if hasattr(module, NATIVE):
            delattr(module, NATIVE)
    if hasattr(model, FUSED):
        delattr(model, FUSED)
    if used == "invariant":
        model.set_attn_implementation(register())
    else:
        model.set_attn_implementation(used)
    return used
