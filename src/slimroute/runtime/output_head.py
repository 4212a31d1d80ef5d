"""The output head as the int8 model holds it: fp32 GEMMs of one fixed shape, on a weight held compactly.

RowBlockedLinear runs rows in fixed-size blocks (HEAD_BLOCK rows, zero-padded) so that an output row does not depend
on how many rows share the call. Its weight is held in the smallest form that gives back every fp32 value exactly
(compact_head): a Q8_0 GGUF's output.weight is int8 blocks of 32 times one fp16 scale each, so 0.15 GB instead of
0.54 GB for Qwen2.5-0.5B's 151936 x 896; bf16 weights keep their 16 bits; anything else stays fp32. Each call turns
it back into fp32 one slice of HEAD_CHUNK vocabulary rows at a time (expand_head: the same values to the bit, so
the same GEMMs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HEAD_BLOCK = 32  # rows per output-head GEMM call
HEAD_CHUNK = 4096  # vocabulary rows of a compact head turned back into fp32 at a time (14.7 MB)
# (larger blocks run faster GEMMs, but the reference scores one row at a time, each in a whole block: docs/design.md)
Q8_BLOCK = 32  # a Q8_0 block: this many consecutive weights share one scale


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
