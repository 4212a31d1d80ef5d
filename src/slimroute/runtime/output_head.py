"""The output head as the int8 model holds it: on a weight held compactly, each output row its input row's alone.

The weight is held in the smallest form that gives back every fp32 value exactly (compact_head): a Q8_0 GGUF's
output.weight is int8 blocks of 32 times one fp16 scale each, so 0.15 GB instead of 0.54 GB for Qwen2.5-0.5B's
151936 x 896; bf16 weights keep their 16 bits; anything else stays fp32.

Q8Head, for a Q8_0 head: integer dot products per block, the activations int16 per block of 32, and the blocks'
exact sums scaled and added in one fixed order (the native kernel, or the same bits in torch ops where it does not
run): two to three times the fp32 GEMM's rate on VNNI CPUs, and a lone row costs one row. Every other head:
RowBlockedLinear runs fp32 GEMMs on rows in fixed-size blocks (HEAD_BLOCK rows, zero-padded) so that an output row
does not depend on how many rows share the call, turning a compact weight back into fp32 one slice of HEAD_CHUNK
vocabulary rows at a time (expand_head: the same values to the bit, so the same GEMMs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimroute.runtime.int8 import _to_ints
from slimroute.runtime.native import Native

HEAD_BLOCK = 32  # rows per output-head GEMM call
HEAD_CHUNK = 4096  # vocabulary rows of a compact head turned back into fp32 at a time (14.7 MB)
# (larger blocks run faster GEMMs, but the reference scores one row at a time, each in a whole block: docs/design.md)
Q8_BLOCK = 32  # a Q8_0 block: this many consecutive weights share one scale
Q8_LANES = 16  # vocabulary rows per tile of a packed Q8 head (kernels.c HEAD_LANES)
X_MAX = 32767  # Q8Head's activations: int16, |x16| <= X_MAX per block of Q8_BLOCK


class RowBlockedLinear(nn.Module):
    """An fp32 linear whose output rows do not depend on how many rows share the call: rows run through GEMMs
    of one fixed shape (HEAD_BLOCK rows, zero-padded). A GEMM's blocking, and so its rounding, may follow its row
    count (on AVX2 a row alone and the same row among 300 differ in the last bits). With onednn=True the blocks go
    through oneDNN's linear on the plain weight (about 2x MKL's GEMM for 16 rows of a 151936 x 896 head on AVX2;
    no packed copy, so a head tied to the embeddings is held once).

    compact: the weight's lossless compact form (compact_head); the GEMMs then run on HEAD_CHUNK vocabulary rows
    at a time, each slice turned back into the fp32 weight's exact values first, and the fp32 weight is not held."""

    def __init__(self, linear: nn.Linear, onednn: bool = False, compact: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.compact = compact
        self.weight = linear.weight if compact is None else None
        self.onednn = onednn
        self.dtype, self.device = linear.weight.dtype, linear.weight.device  # of the outputs (fp32, CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        padded = F.pad(rows, (0, 0, 0, (-num_rows) % HEAD_BLOCK))  # (M', K)
        out = torch.empty(padded.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        if self.compact is None:
            for start in range(0, padded.shape[0], HEAD_BLOCK):
                out[start:start + HEAD_BLOCK] = self._block(padded[start:start + HEAD_BLOCK], self.weight, self.bias)
        else:
            buffer = torch.empty(HEAD_CHUNK, self.in_features, device=rows.device)
            for lo in range(0, self.out_features, HEAD_CHUNK):  # each slice made once, used by every row block
                hi = min(lo + HEAD_CHUNK, self.out_features)
                weight = expand_head(self.compact, lo, hi, buffer)
                bias = None if self.bias is None else self.bias[lo:hi]
                for start in range(0, padded.shape[0], HEAD_BLOCK):
                    out[start:start + HEAD_BLOCK, lo:hi] = self._block(padded[start:start + HEAD_BLOCK], weight, bias)
        return out[:num_rows].view(*x.shape[:-1], self.out_features)

    def _block(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return F.linear(rows, weight, bias)


def compact_head(weight: torch.Tensor, release=None) -> dict[str, torch.Tensor] | None:
    """An fp32 (V, K) weight in the smallest form that gives back each of its values exactly, or None:
    {"head.q8", "head.q8_scale"}: int8 (V, K) and fp32 (V, K / Q8_BLOCK), when every block of Q8_BLOCK weights
    is an integer multiple, at most 127, of its block's max |w| / 127 (how a Q8_0 GGUF stores a tensor; the
    division gives the block's fp16 scale exactly); else {"head.bf16"} when every value is a bf16; else None.
    Checked HEAD_CHUNK rows at a time; release(rows) is then called on each slice read (FileMappedMemory)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    rows, cols = weight.shape
    parts: dict[str, list[torch.Tensor]] = {"head.q8": [], "head.q8_scale": []} if cols % Q8_BLOCK == 0 else {}
    bf16: list[torch.Tensor] | None = []
    for lo in range(0, rows, HEAD_CHUNK):
        piece = weight[lo:lo + HEAD_CHUNK].detach()
        if parts:
            blocks = piece.reshape(piece.shape[0], -1, Q8_BLOCK)  # (C, K/32, 32)
            scale = blocks.abs().amax(dim=2, keepdim=True) / 127  # (C, K/32, 1)
            q = torch.round(blocks / torch.where(scale > 0, scale, torch.ones_like(scale)))
            if torch.equal(q * scale, blocks) and bool((q.abs() <= 127).all()):
                parts["head.q8"].append(q.to(torch.int8).reshape(piece.shape))
                parts["head.q8_scale"].append(scale.reshape(piece.shape[0], -1))
            else:
                parts = {}
        if bf16 is not None:
            half = piece.to(torch.bfloat16)
            bf16 = bf16 + [half] if torch.equal(half.float(), piece) else None
        if not parts and bf16 is None:
            return None
        if release is not None:
            release(piece)
    if parts:
        return {name: torch.cat(values) for name, values in parts.items()}
    return {"head.bf16": torch.cat(bf16)}


def expand_head(compact: dict[str, torch.Tensor], lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows lo:hi of the fp32 weight a compact_head form holds: the very values it was made from (written into
    out[:hi - lo] when given: a buffer reused slice after slice costs no fresh pages)."""
    rows = hi - lo
    width = (compact["head.bf16"] if "head.bf16" in compact else compact["head.q8"]).shape[1]
    dest = torch.empty(rows, width) if out is None else out[:rows]
    if "head.bf16" in compact:
        return dest.copy_(compact["head.bf16"][lo:hi])
    q, scale = compact["head.q8"][lo:hi], compact["head.q8_scale"][lo:hi]  # (C, K), (C, K/32)
    dest.copy_(q)  # int8 -> fp32, then times the block's scale: exact
    dest.view(rows, -1, Q8_BLOCK).mul_(scale[:, :, None])
    return dest


class Q8Head(nn.Module):
    """The output head of a Q8_0 checkpoint (compact_head's "head.q8" form) as integer dot products. Each block of
    Q8_BLOCK inputs becomes int16 with its own scale (x_b = max |x| / X_MAX, 1 where that is not > 0; round half to
    even), each block's product with the weights' int8 block is an exact integer I_b, and a logit is
    sum_b float(I_b) * (w_b * x_b), added in block order from 0, one rounding per operation. So an output row is its
    input row's alone (no padding, no blocks of rows: a lone row costs a row), and the bits follow neither the ISA
    nor the build: the native kernel (kernels.c sr_q8_head; VNNI's vpdpwssd does 32 multiply-adds per instruction,
    twice fp32's FMA) and q8_logits's torch ops give the same. Against the fp32 GEMM on the same weights the logits
    differ in the 4th decimal (docs/dtypes.md, "The compact output head").

    kernels: the native kernels; the weights are then packed for them (pack_q8, in place: compact's "head.q8" is
    reordered) and the torch ops are not used."""

    def __init__(self, compact: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                 kernels: Native | None = None):
        super().__init__()
        q, scale = compact["head.q8"], compact["head.q8_scale"]
        self.out_features, self.in_features = q.shape
        self.bias, self.kernels = bias, kernels
        self.dtype, self.device = torch.float32, q.device
        if kernels is not None:
            self.packed, self.packed_scales = pack_q8(q, scale)
            self.q8 = self.q8_scale = None
        else:
            self.q8, self.q8_scale = q, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        if self.kernels is not None:
            out = self.kernels.q8_head(rows, self.packed, self.packed_scales)[:, :self.out_features]
        else:
            out = q8_logits(rows, self.q8, self.q8_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8 head (V, K) int8 and (V, K / Q8_BLOCK) scales as the native kernel reads them: tiles of Q8_LANES
    vocabulary rows, (tiles, K / 2, Q8_LANES, 2) (each pair of columns of a tile's rows side by side) and
    (tiles, K / Q8_BLOCK, Q8_LANES); V is padded with zero rows to whole tiles. Reordered in place, HEAD_CHUNK rows at
    a time, where V fills whole tiles (q is then that order: no second copy of the head is ever held)."""
    rows, width = q.shape
    if rows % Q8_LANES:
        pad = Q8_LANES - rows % Q8_LANES
        q, scale = F.pad(q, (0, 0, 0, pad)), F.pad(scale, (0, 0, 0, pad))
    tiles = q.shape[0] // Q8_LANES
    step = HEAD_CHUNK // Q8_LANES * Q8_LANES
    for lo in range(0, q.shape[0], step):
        part = q[lo:lo + step]
        part.copy_(part.view(-1, Q8_LANES, width // 2, 2).transpose(1, 2).contiguous().view(part.shape))
    scales = scale.reshape(tiles, Q8_LANES, -1).transpose(1, 2).contiguous()
    return q.view(tiles, width // 2, Q8_LANES, 2), scales


def q8_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q8Head's logits in torch ops, bit for bit the native kernel's: x (M, K) fp32, q (V, K) int8, scale (V, K / 32).
    The blocks' integer sums come from fp32 GEMMs, exact: x16 = 256 hi + lo (lo in [0, 255]) keeps every partial sum
    of 32 products below 2^24, so any summation order gives the integer."""
    rows, width = x.shape
    blocks = width // Q8_BLOCK
    q16, scales = _to_ints(x.reshape(rows * blocks, Q8_BLOCK), X_MAX, 0)  # each block as a row: int8.py's quantiser
    x16, x_scale = q16.view(rows, blocks, Q8_BLOCK), scales.view(rows, blocks)  # integers in [-X_MAX, X_MAX]
    hi = torch.floor(x16 / 256)
    lo = x16 - 256 * hi
    parts = torch.cat([hi, lo], dim=0).transpose(0, 1)  # (B, 2M, 32)
    out = torch.empty(rows, q.shape[0])
    for start in range(0, q.shape[0], HEAD_CHUNK):
        qc = q[start:start + HEAD_CHUNK].view(-1, blocks, Q8_BLOCK).permute(1, 2, 0).float()  # (B, 32, C)
        sums = torch.bmm(parts, qc).double()  # (B, 2M, C): exact integers
        ints = (sums[:, :rows] * 256 + sums[:, rows:]).float()  # (B, M, C): I_b, rounded to fp32 once
        ws = scale[start:start + HEAD_CHUNK].T  # (B, C)
        total = torch.zeros(rows, ws.shape[1])
        for b in range(blocks):
            total = total + ints[b] * (ws[b] * x_scale[:, b:b + 1])
        out[:, start:start + HEAD_CHUNK] = total
    return out
