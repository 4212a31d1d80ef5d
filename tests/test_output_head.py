"""The int8 model's output head: rows that do not depend on the batch, on a weight held compactly and exactly."""

import pytest
import torch
from torch import nn

from slimroute.runtime.linear import onednn_failure
from slimroute.runtime.native import native
from slimroute.runtime.output_head import (
    HEAD_CHUNK,
    Q8_LANES,
    Q8Head,
    RowBlockedLinear,
    compact_head,
    expand_head,
    q8_logits,
)

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py


@pytest.mark.parametrize("onednn", [False, True], ids=["torch", "onednn"])
def test_row_blocked_head_rows_do_not_depend_on_the_batch(onednn):
    if onednn and onednn_failure(torch.float32):
        pytest.skip(f"oneDNN's fp32 linear does not run here: {onednn_failure(torch.float32)}")
    torch.manual_seed(0)
    head = RowBlockedLinear(nn.Linear(64, 400, bias=False), onednn)
    x = torch.randn(37, 64)
    whole = head(x)
    assert torch.allclose(whole, torch.nn.functional.linear(x, head.weight), atol=1e-5)
    for start, stop in ((0, 1), (5, 6), (3, 20), (36, 37)):
        assert torch.equal(head(x[start:stop]), whole[start:stop])


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """weight's values as a Q8_0 GGUF gives them back (llama.cpp's quantize_row_q8_0_ref): blocks of 32,
    q = round(x / d) with d = amax / 127, then q times d stored as fp16."""
    blocks = weight.reshape(weight.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale > 0, scale, torch.ones_like(scale)))
    return (q * scale.half().float()).reshape(weight.shape)


def test_compact_head_gives_back_every_value_exactly():
    """A Q8_0-valued weight becomes int8 + one scale per 32 (a quarter of fp32's bytes plus 1/8), a bf16-valued
    one bf16, anything else stays fp32 (None); every slice comes back bit for bit, across HEAD_CHUNK's seams."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(HEAD_CHUNK + 300, 64, generator=gen) * 0.05
    raw[7, 32:] = 0  # an all-zero block: scale 0, every integer 0
    for weight, kind in ((q8_0(raw), "q8"), (raw.bfloat16().float(), "bf16"), (raw, None)):
        compact = compact_head(weight)
        if kind is None:
            assert compact is None
            continue
        assert sorted(compact) == (["head.q8", "head.q8_scale"] if kind == "q8" else ["head.bf16"])
        held = sum(t.numel() * t.element_size() for t in compact.values())
        assert held <= weight.numel() * weight.element_size() * (0.29 if kind == "q8" else 0.5)
        buffer = torch.full((HEAD_CHUNK, 64), float("nan"))  # reused slice after slice, as RowBlockedLinear does
        for lo, hi in ((0, HEAD_CHUNK), (HEAD_CHUNK, weight.shape[0]), (5, 9)):
            assert torch.equal(expand_head(compact, lo, hi), weight[lo:hi])
            assert torch.equal(expand_head(compact, lo, hi, buffer), weight[lo:hi])
    q8 = q8_0(raw)
    q8[3, 3] = q8[3, 3] * (1 + 2**-20)  # one value off the grid: not a Q8_0 tensor (and not bf16 either)
    assert compact_head(q8) is None


@pytest.mark.parametrize("onednn", [False, True], ids=["torch", "onednn"])
def test_compact_head_gives_the_fp32_heads_logits_and_row_invariance(onednn):
    if onednn and onednn_failure(torch.float32):
        pytest.skip(f"oneDNN's fp32 linear does not run here: {onednn_failure(torch.float32)}")
    torch.manual_seed(0)
    linear = nn.Linear(64, HEAD_CHUNK + 100, bias=False)
    with torch.no_grad():
        linear.weight.copy_(q8_0(linear.weight))
    head = RowBlockedLinear(linear, onednn, compact_head(linear.weight.data))
    assert head.weight is None and head.compact is not None  # the fp32 weight is not held
    x = torch.randn(37, 64)
    whole = head(x)
    assert torch.allclose(whole, torch.nn.functional.linear(x, linear.weight), atol=1e-5)
    for start, stop in ((0, 1), (5, 6), (3, 20), (36, 37)):
        assert torch.equal(head(x[start:stop]), whole[start:stop])


def _q8_head_case(rows: int, vocab: int, width: int, seed: int):
    """A Q8_0 head's compact form and rows to score: an outlier, an all-zero block of x and one of w."""
    gen = torch.Generator().manual_seed(seed)
    weight = q8_0(torch.randn(vocab, width, generator=gen) * 0.05)
    weight[3, :32] = 0
    x = torch.randn(rows, width, generator=gen) * 3
    x[0, 5] = 90.0  # an outlier, as after the final norm
    x[-1, :32] = 0
    return compact_head(weight), weight, x


def test_q8_head_rows_are_their_own_and_near_the_fp32_heads():
    """Q8Head in torch ops (where the native kernels do not run): a row's logits do not depend on the rows beside
    it, and they stay within 1e-3 of the fp32 GEMM on the same weights (int16 activations per block of 32)."""
    compact, weight, x = _q8_head_case(9, HEAD_CHUNK + 37, 96, 1)
    head = Q8Head({key: value.clone() for key, value in compact.items()})
    whole = head(x)
    assert whole.shape == (9, HEAD_CHUNK + 37)
    assert (whole - x @ weight.T).abs().max() < 1e-3
    for start, stop in ((0, 1), (4, 5), (2, 9)):
        assert torch.equal(head(x[start:stop]), whole[start:stop])


@pytest.mark.skipif(native() is None, reason="slimroute's native kernels do not build here (see the note logged by "
                                              "slimroute.runtime.native)")
@pytest.mark.parametrize("vocab", [160, 4133], ids=["whole-tiles", "a-part-tile"])
def test_q8_head_native_kernel_gives_the_torch_ops_bits(vocab):
    """The native kernel (packed weights, 16 vocabulary rows a tile, VNNI's or vpmaddwd's integer dot products) gives
    q8_logits's bits, for any number of rows (the kernel's row groups and their remainders) and a vocabulary that
    does not fill its last tile; packing reorders the head in place where it does."""
    compact, _, x = _q8_head_case(13, vocab, 896, 2)
    expected = q8_logits(x, compact["head.q8"], compact["head.q8_scale"])
    own = {key: value.clone() for key, value in compact.items()}
    head = Q8Head(own, kernels=native())
    assert torch.equal(head(x), expected)
    for rows in (1, 2, 3, 7, 8, 9):
        assert torch.equal(head(x[:rows]), expected[:rows])
    assert (head.packed.data_ptr() == own["head.q8"].data_ptr()) == (vocab % Q8_LANES == 0)
