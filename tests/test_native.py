"""slimroute's native kernels (runtime/native.py, kernels.c): the ones that replace torch ops give their bits, the
attention's answers do not depend on anything but the query and its keys, and the build falls back cleanly."""

import pytest
import torch
import torch.nn.functional as F

import slimroute.runtime.native as native_module
from slimroute.runtime.native import KEY_BLOCK, Tokens, native, probe
from slimroute.runtime.output_head import pack_q8

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(native() is None, reason="slimroute's native kernels do not "
                                                      "build here (see the note logged by slimroute.runtime.native)")]
KERNELS = native()


def test_the_probe_passes_at_this_cpus_vector_isa():
    """ATen's cascade sum (RMSNorm's variance) replayed for this build, on widths that take each of its branches."""
    assert probe(KERNELS) == ""
    assert KERNELS.capability == torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize("width", [8, 32, 40, 64, 130, 896, 4864])
def test_the_norm_gives_torchs_rmsnorm_and_residual_add_to_the_bit(width):
    """x += products * scale (+ bias), then weight * (x * rsqrt(mean(x^2) + eps)): what the model's own modules
    compute (an int8 layer's output, the residual add, Qwen2's / Llama's RMSNorm)."""
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=generator) * 5
    products, scale = torch.randn(7, width, generator=generator) * 100, torch.rand(7, 1, generator=generator)
    bias, weight = torch.randn(width, generator=generator), torch.randn(width, generator=generator)
    added = x + (products * scale + bias)
    expected = weight * (added * torch.rsqrt(added.pow(2).mean(-1, keepdim=True) + 1e-6))
    got_x = x.clone()
    assert torch.equal(KERNELS.add_norm(got_x, weight, 1e-6, (products, scale, bias)), expected)
    assert torch.equal(got_x, added)
    ints, scales = KERNELS.add_norm_to_ints(x.clone(), weight, 1e-6, 127, 128, (products, scale, bias))
    assert torch.equal(ints, torch.round(expected / scales).add(128).to(torch.uint8))
    for rows in (slice(0, 1), slice(2, 5)):  # a row's result is its own
        alone = KERNELS.add_norm(x[rows].clone(), weight, 1e-6, (products[rows], scale[rows], bias))
        assert torch.equal(alone, expected[rows])


def test_qkv_rotary_gives_the_models_queries_keys_and_values():
    """The fused q/k/v products times the row scales plus bias, rotated as transformers' apply_rotary_pos_emb does;
    keys and values land in each token's row at its slot."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    heads, kv_heads, d = 4, 2, 16
    generator = torch.Generator().manual_seed(0)
    tokens = Tokens.of_lengths(torch.tensor([3, 1, 5]))
    count = tokens.rows.shape[0]
    width = (heads + 2 * kv_heads) * d
    products = torch.randn(count, width, generator=generator) * 50
    scale, bias = torch.rand(count, 1, generator=generator), torch.randn(width, generator=generator)
    angles = torch.rand(count, d // 2, generator=generator) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    keys_t, values = torch.zeros(3, kv_heads, d, 16), torch.zeros(3, kv_heads, 16, d)
    slots = torch.tensor([0, 4, 2])
    queries = KERNELS.qkv_rotary(products, scale, bias, cos, sin, heads, kv_heads, tokens, keys_t, values, slots)
    full = products * scale + bias
    q, k, v = full.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q_rot, k_rot = apply_rotary_pos_emb(q.view(count, heads, d)[None].transpose(1, 2),
                                        k.view(count, kv_heads, d)[None].transpose(1, 2), cos[None], sin[None])
    assert torch.equal(queries, q_rot[0].transpose(0, 1))
    for m in range(count):
        row, at = int(tokens.rows[m]), int(slots[tokens.rows[m]] + tokens.steps[m])
        assert torch.equal(keys_t[row, :, :, at], k_rot[0, :, m])
        assert torch.equal(values[row, :, at], v[m].view(kv_heads, d))


def _keys(rows: int, kv_heads: int, d: int, count: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    cap = -(-count // KEY_BLOCK) * KEY_BLOCK + KEY_BLOCK  # room past the keys: never read
    keys_t, values = torch.full((rows, kv_heads, d, cap), float("nan")), torch.full((rows, kv_heads, cap, d), 7.0)
    keys_t[..., :count] = torch.randn(rows, kv_heads, d, count, generator=generator)
    values[:, :, :count] = torch.randn(rows, kv_heads, count, d, generator=generator)
    return keys_t, values


@pytest.mark.parametrize("d", [8, 64])
def test_attention_is_the_softmax_over_a_querys_keys_and_invariant_to_how_they_are_stored(d):
    """One query at a time over its keys in order: the same bits whether its keys come as a shared prefix run, in a
    row of a batch of others, or as the pass's own, wherever the batch puts them; close to float64 attention."""
    heads, kv_heads, prefix, item = 6, 2, 21, 9
    generator = torch.Generator().manual_seed(d)
    keys_t, values = _keys(1, kv_heads, d, prefix + item, generator)
    queries = torch.randn(item, heads, d, generator=generator)
    # the reference's way: one row holding every key, query t seeing prefix + t + 1 of them
    alone = KERNELS.attention(queries, torch.tensor([0, item]), kv_heads, d ** -0.5,
                              [None, (keys_t, values, prefix + torch.arange(1, item + 1))])
    # the fast path's: the prefix shared, the item's keys in row 2 of a batch of 3 others, read in place
    p_keys, p_values = keys_t[0, :, :, :prefix], values[0, :, :prefix]
    cap = -(-prefix // KEY_BLOCK) * KEY_BLOCK
    shared = (F.pad(p_keys, (0, cap - prefix)).contiguous(),
              F.pad(p_values, (0, 0, 0, cap - prefix)).contiguous(), prefix)
    batch_t, batch_v = _keys(3, kv_heads, d, item, generator)
    batch_t[2, ..., :item] = keys_t[0, ..., prefix:prefix + item]
    batch_v[2, :, :item] = values[0, :, prefix:prefix + item]
    others = torch.randn(4, heads, d, generator=generator)
    packed = torch.cat([others[:2], queries, others[2:]])  # rows 0 and 1: two tokens of others before the item's
    counts = torch.cat([torch.tensor([3, 5]), torch.arange(1, item + 1), torch.tensor([2, 1])])
    starts = torch.tensor([0, 1, 2, 2 + item, 4 + item])  # row 2 (the item) then a row of two of row 3's
    batched = KERNELS.attention(packed, starts, kv_heads, d ** -0.5, [shared, (batch_t, batch_v, counts)])
    assert torch.equal(batched[2:2 + item], alone)
    # a label's continuation: the item row's keys up to the item's end, then the pass's own
    own_t, own_v = _keys(1, kv_heads, d, 1, generator)
    own_t[0, ..., 0], own_v[0, :, 0] = keys_t[0, ..., prefix + item - 1], values[0, :, prefix + item - 1]
    last = KERNELS.attention(queries[-1:], torch.tensor([0, 1]), kv_heads, d ** -0.5,
                             [shared, (batch_t[2:3], batch_v[2:3], torch.tensor([item - 1])),
                              (own_t, own_v, torch.tensor([1]))])
    assert torch.equal(last, alone[-1:])
    # float64 attention over the same keys, grouped-query heads reading kv head h // (heads / kv_heads)
    k64 = keys_t[0, :, :, :prefix + item].double().transpose(-1, -2).repeat_interleave(heads // kv_heads, 0)
    v64 = values[0, :, :prefix + item].double().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("thd,hkd->htk", queries.double(), k64) * d ** -0.5
    scores = scores.masked_fill(torch.arange(prefix + item) > prefix + torch.arange(item)[:, None], float("-inf"))
    expected = torch.einsum("htk,hkd->thd", scores.softmax(-1), v64).reshape(item, heads * d)
    assert torch.allclose(alone.double(), expected, atol=1e-5)


def test_attention_quantises_its_rows_for_o_proj_and_refuses_buffers_it_cannot_read():
    generator = torch.Generator().manual_seed(3)
    keys_t, values = _keys(2, 1, 8, 5, generator)
    queries, counts = torch.randn(4, 2, 8, generator=generator), torch.tensor([1, 2, 5, 3])
    starts = torch.tensor([0, 2, 4])
    out = KERNELS.attention(queries, starts, 1, 0.3, [None, (keys_t, values, counts)])
    ints, scales = KERNELS.attention(queries, starts, 1, 0.3, [None, (keys_t, values, counts)], 127, 128)
    expected_ints, expected_scales = KERNELS.to_ints(out, 127, 128)
    assert torch.equal(ints, expected_ints) and torch.equal(scales, expected_scales)
    with pytest.raises(ValueError, match="multiple of 16 positions"):
        KERNELS.attention(queries, starts, 1, 0.3, [None, (keys_t[..., :10].contiguous(), values, counts)])


def test_the_build_is_cached_per_source_isa_and_compiler_and_a_missing_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMROUTE_CACHE", str(tmp_path))
    first = native_module._load()
    assert first.path.parent == tmp_path / "native" and first.path.is_file()
    assert first.path.name.endswith(f"-{torch.backends.cpu.get_cpu_capability().lower()}.so")
    built = first.path.stat().st_mtime_ns
    assert native_module._load().path == first.path and first.path.stat().st_mtime_ns == built  # reused
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(native_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler found"):
        native_module._load()


@pytest.mark.parametrize("capability", ["AVX512-no-VNNI", "AVX2", "DEFAULT"])
def test_a_lower_vector_isas_build_gives_the_same_bits(monkeypatch, tmp_path, capability):
    """The elementwise kernels, the attention and the Q8 output head give the same bits built for AVX-512 (with VNNI
    or without), AVX2 or plain C (the vector loops and their scalar tails compute the same operations; integer dot
    products are exact however they are taken): an int8 job's numbers do not follow the build."""
    if capability == "AVX2" and KERNELS.capability not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU's torch runs at {KERNELS.capability}: an AVX2 build cannot run here")
    if capability == "AVX512-no-VNNI":
        if KERNELS.capability != "AVX512":
            pytest.skip(f"this CPU's torch runs at {KERNELS.capability}: an AVX-512 build cannot run here")
        capability = "AVX512"
        monkeypatch.setattr(native_module, "real_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    monkeypatch.setenv("SLIMROUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_module.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    other = native_module._load()
    generator = torch.Generator().manual_seed(5)
    for rows, width in ((3, 37), (2, 896), (1, 4864)):
        gate_up = torch.randn(rows, 2 * width, generator=generator) * 20
        scale, x = torch.rand(rows, 1, generator=generator), torch.randn(rows, width, generator=generator) * 3
        weight, delta = torch.randn(width, generator=generator), torch.randn(rows, width, generator=generator)
        for act_max, shift in ((127, 128), (63, 0)):
            pairs = [kernels.gated_to_ints(gate_up[:, :width], gate_up[:, width:], scale, act_max, shift)
                     + kernels.add_norm_to_ints(x.clone(), weight, 1e-6, act_max, shift, (delta, scale, weight))
                     for kernels in (KERNELS, other)]
            assert all(torch.equal(a, b) for a, b in zip(*pairs, strict=True))
    keys_t, values = _keys(3, 2, 64, 40, generator)
    queries, starts = torch.randn(7, 14, 64, generator=generator), torch.tensor([0, 2, 3, 7])
    counts = torch.tensor([1, 2, 40, 5, 9, 30, 33])
    outs = [kernels.attention(queries, starts, 2, 0.125, [None, (keys_t, values, counts)], 127, 128)
            for kernels in (KERNELS, other)]
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    weight = torch.randint(-127, 128, (48, 896), dtype=torch.int8, generator=generator)
    packed = pack_q8(weight, torch.rand(48, 28, generator=generator) * 0.01)
    x = torch.randn(11, 896, generator=generator) * 4
    assert torch.equal(KERNELS.q8_head(x, *packed), other.q8_head(x, *packed))
