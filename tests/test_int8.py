"""int8: the fast path gives the int8 reference's bits (batch invariance by construction), on tiny models."""

import random

import pytest
import torch
import torch.nn.functional as F
from test_head import random_head
from test_output_head import q8_0
from tiny import make_text, tiny_model
from torch import nn

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.runtime.attention import invariant_attention, set_attention
from slimroute.runtime.cpu import detect
from slimroute.runtime.dtypes import int8_kernels_available
from slimroute.runtime.fused import fuse
from slimroute.runtime.int8 import Int8Linear, _onednn_problem, int8_failure
from slimroute.runtime.native import native
from slimroute.runtime.output_head import Q8Head, compact_head
from slimroute.runtime.quantize import quantize_model
from slimroute.task import Task

CPU = detect()
pytestmark = [pytest.mark.kernels, pytest.mark.skipif(not int8_kernels_available(CPU),
                                reason=f"int8 needs x86 AVX2 and torch's fbgemm kernels; this is {CPU.describe()}")]

SINGLE = ("billing", "technical", "account")
MULTI = ("Technical Support", "Technical Sales", "billing", "account")  # shared first token, different lengths


ONEDNN_RUNS = int8_failure("onednn")  # None where its op runs at all (exact or not)
onednn_int8_runs = pytest.mark.skipif(ONEDNN_RUNS is not None, reason=f"oneDNN's int8 op fails here: {ONEDNN_RUNS}")
ONEDNN_INT8 = _onednn_problem()  # "" where slimroute would take it: it runs and its 8-bit products are exact
needs_onednn_int8 = pytest.mark.skipif(bool(ONEDNN_INT8), reason=f"oneDNN's int8 kernel is not usable here (it "
                                       f"needs a VNNI: AVX-VNNI, AVX512-VNNI or AMX): {ONEDNN_INT8}")


NATIVE = native() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="slimroute's native kernels do not build here (see the note "
                                  "logged by slimroute.runtime.native)")


def int8_model(arch: str, kernel: str = "fbgemm", native: bool | None = None, fused: bool = True):
    """A tiny model in int8 as load_model makes it: smoothed, quantised, the batch-invariant attention, and, where
    slimroute's native kernels run (native None) and `fused`, its decoder fused (fused.fuse)."""
    model, tok = tiny_model(arch)
    quantize_model(model, tokenizer=tok, kernel=kernel, native=native)  # with smoothing, as load_model does
    assert set_attention(model) == "invariant"
    if fused and native is not False and NATIVE:
        assert fuse(model) is None
    return model, tok


@pytest.fixture(scope="module", params=["qwen2", "llama", pytest.param("qwen2-onednn", marks=needs_onednn_int8),
                                        "qwen2-unfused", "qwen2-eager"])
def tiny_int8(request):
    """The tiny models in int8 as load_model makes them (the decoder fused where the native kernels run);
    qwen2-onednn: through oneDNN's int8 kernel (AMX or VNNI where the CPU has them); qwen2-unfused: the model's own
    modules with the native kernels (as for a layer form the fused decoder does not cover); qwen2-eager: torch ops
    alone, as where the native kernels do not build."""
    arch, _, variant = request.param.partition("-")
    if variant == "eager":
        return int8_model(arch, native=False)
    if variant == "unfused":
        return int8_model(arch, fused=False)
    return int8_model(arch, variant or "fbgemm")


@needs_onednn_int8
def test_onednn_int8_kernel_gives_fbgemms_products_and_rows_that_do_not_depend_on_the_batch():
    """Integers add exactly in any order: fed the same integers, oneDNN's kernel (AMX tiles or VNNI where the CPU
    has them) and fbgemm's give the same bits; and oneDNN's rows (8-bit activations) do not depend on the rows
    around them."""
    from slimroute.runtime.int8 import ACTIVATIONS, quantize_weight

    torch.manual_seed(2)
    linear = nn.Linear(896, 200)
    qweight, scale = quantize_weight(linear.weight)
    fbgemm, onednn = Int8Linear(qweight, scale, None), Int8Linear(qweight, scale, None, kernel="onednn")
    ints = torch.randint(-63, 64, (300, 896)).float()  # 7 bits: what both kernels take
    assert torch.equal(onednn.integer_product((ints + ACTIVATIONS["onednn"][1]).to(torch.uint8)),
                       fbgemm.integer_product(ints))
    x = torch.randn(300, 896)
    x[:, 7] *= 40
    layer = Int8Linear.from_linear(linear, kernel="onednn")
    with torch.no_grad():
        whole = layer(x)
        for rows in (1, 7, 32, 299):
            assert torch.equal(layer(x[:rows]), whole[:rows]), rows
        assert torch.equal(layer(x[5:12]), whole[5:12])


@onednn_int8_runs
def test_onednn_int8_layer_keeps_no_view_of_its_inputs():
    """A view of a tensor read from the int8 cache file keeps the whole file mapped and resident (it cost 0.35 GB
    of RSS): the layer must own copies."""
    from slimroute.runtime.int8 import quantize_weight

    qweight, scale = quantize_weight(nn.Linear(64, 32).weight)
    layer = Int8Linear(qweight, scale, None, kernel="onednn")
    assert all(t.is_mkldnn or t.untyped_storage().data_ptr() not in (qweight.untyped_storage().data_ptr(),
                                                                      scale.untyped_storage().data_ptr())
               for t in layer.packed)


def test_pick_kernel_takes_onednn_only_with_a_vnni_and_only_when_its_probe_passes(monkeypatch, caplog):
    from slimroute.runtime import int8
    from slimroute.runtime.cpu import CpuFeatures

    def cpu(name, flags):
        return CpuFeatures(name, frozenset(flags.split()), "AVX512" if "avx512f" in flags else "AVX2", "x86_64")

    with_vnni = [cpu("Intel Xeon (AMX)", "avx2 avx512f avx512_vnni amx_bf16 amx_int8"),
                 cpu("AMD Zen 5", "avx2 avx_vnni avx512f avx512_bf16 avx512_vnni"),
                 cpu("Intel Xeon (Cascade Lake)", "avx2 avx512f avx512_vnni"),
                 cpu("Intel Core (Alder Lake)", "avx2 fma avx_vnni")]
    without = [cpu("AMD EPYC (Zen 3)", "avx2 fma"), cpu("Intel Xeon (Skylake)", "avx2 avx512f avx512bw")]
    monkeypatch.setattr(int8, "_KERNEL", {})
    monkeypatch.setattr(int8, "_onednn_problem", lambda: "")
    assert [int8.pick_kernel(c) for c in with_vnni] == ["onednn"] * 4
    assert [int8.pick_kernel(c) for c in without] == ["fbgemm"] * 2
    monkeypatch.setattr(int8, "_KERNEL", {})
    monkeypatch.setattr(int8, "_onednn_problem", lambda: "qlinear_pointwise raised: no kernel")
    assert [int8.pick_kernel(c) for c in with_vnni] == ["fbgemm"] * 4
    assert ("oneDNN's VNNI kernel is not used (qlinear_pointwise raised: no kernel); fbgemm's runs instead"
            in caplog.text)
    with pytest.raises(ValueError, match="int8 kernel must be one of fbgemm, onednn"):
        Int8Linear.from_linear(nn.Linear(4, 4), kernel="amx")


def test_int8_linear_is_close_to_fp32_and_row_invariant():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    x = torch.randn(300, 256)
    q = Int8Linear.from_linear(linear)
    with torch.no_grad():
        assert (q(x) - linear(x)).norm() / linear(x).norm() < 0.03
        x[:, 3] *= 30  # an outlier channel, as real activations have, costs precision in every row
        assert (q(x) - linear(x)).norm() / linear(x).norm() < 0.1
    whole = q(x)
    for rows in (1, 7, 32, 299):
        assert torch.equal(q(x[:rows]), whole[:rows]), rows
    assert torch.equal(q(x[5:12]), whole[5:12])  # a row's bits do not depend on its neighbours or its position


@pytest.mark.parametrize("kernel", ["fbgemm", pytest.param("onednn", marks=needs_onednn_int8)])
def test_int8_accumulation_is_exact(kernel):
    """fbgemm's 7-bit activations cannot saturate its int16 pair sums, oneDNN's 8-bit ones add into int32 (VNNI):
    the output is the exact integer product times the weight scales, down to the last bit, also for the largest
    sum a row can have."""
    from slimroute.runtime.int8 import ACTIVATIONS, quantize_weight

    act_max, shift = ACTIVATIONS[kernel]
    torch.manual_seed(1)
    qweight, scale = quantize_weight(nn.Linear(512, 64, bias=False).weight)
    x = torch.randint(-act_max, act_max + 1, (16, 512)).float()  # integers at full range
    x[0] = torch.where(qweight[0] >= 0, act_max, -act_max)  # every product of output 0 at its largest
    x[1] = -x[0]
    x[2:, 0] = act_max  # every row's max is act_max: its scale is exactly 1
    exact = (x.double() @ qweight.double().T).float() * scale  # integer sums below 2**24: exact in fp32
    layer = Int8Linear(qweight, scale, None, kernel=kernel)
    assert torch.equal(layer.integer_product((x + shift).to(torch.uint8) if shift else x), exact)
    assert torch.equal(layer(x), exact)


@onednn_int8_runs
def test_the_onednn_probe_refuses_a_kernel_whose_sums_saturate(monkeypatch):
    """Without a VNNI a kernel adds pairs of u8 x s8 products in int16, which saturates for 8-bit activations: the
    probe behind pick_kernel sees the wrong products (simulated here on any CPU) and oneDNN is not taken."""
    from slimroute.runtime import int8

    def saturating(self, q):  # u8 (q + shift) x s8 weight, pairs added in int16 with saturation, then int32
        weight = self.int8_weight.double()
        pairs = (q.double()[:, None, :] * weight[None]).view(q.shape[0], weight.shape[0], -1, 2).sum(-1)
        total = pairs.clamp(-32768, 32767).sum(-1) - int8.ACTIVATIONS["onednn"][1] * weight.sum(1)
        return total.float() * self.packed[1]

    original_init = int8.Int8Linear.__init__

    def remember(self, qweight, *args, **kwargs):
        original_init(self, qweight, *args, **kwargs)
        self.int8_weight = qweight

    monkeypatch.setattr(int8.Int8Linear, "__init__", remember)
    monkeypatch.setattr(int8.Int8Linear, "integer_product", saturating)
    assert int8._onednn_problem() == "its integer products are not exact for 8-bit activations on this CPU"


def causal_attention_inputs(batch: int, heads: int, queries: int, keys: int, dim: int, kv_heads: int = 2):
    """Seeded random q (B, H, Lq, D), k and v (B, Hkv, Lk, D), and a causal boolean mask (B, 1, Lq, Lk) whose
    queries are the last Lq positions (the keys before them: a cached prefix)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(batch, heads, queries, dim), torch.randn(batch, kv_heads, keys, dim), torch.randn(
        batch, kv_heads, keys, dim)
    positions = torch.arange(keys - queries, keys)
    allowed = (torch.arange(keys)[None, :] <= positions[:, None]).expand(batch, 1, queries, keys).clone()
    return q, k, v, allowed


def test_invariant_attention_matches_eager_attention():
    """The tiled kernel computes ordinary attention (fp32 rounding apart), with padding and a cached prefix."""
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    batch, heads, queries, keys, dim = 3, 4, 70, 150, 16
    q, k, v, allowed = causal_attention_inputs(batch, heads, queries, keys, dim)
    allowed[1, :, :, 100:] = False  # row 1: padded keys, as in a right-padded batch
    module = type("Attn", (), {"num_key_value_groups": heads // k.shape[1], "training": False})()
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    expected, _ = eager_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    got, _ = invariant_attention(module, q, k, v, allowed, scaling=dim ** -0.5)
    assert got.shape == expected.shape == (batch, queries, heads, dim)
    assert torch.allclose(got, expected, atol=1e-5)


def test_invariant_attention_with_segments_and_a_continuation_matches_eager_attention():
    """Queries tiled afresh at a segment start and, from a label's continuation on, CONTINUATION_TILE at a time:
    still ordinary attention, and the continuation's queries get the bits a pass of their own gives them."""
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    from slimroute.runtime.attention import segments

    batch, heads, queries, keys, dim = 2, 4, 70, 70, 16
    q, k, v, allowed = causal_attention_inputs(batch, heads, queries, keys, dim)
    module = type("Attn", (), {"num_key_value_groups": heads // k.shape[1], "training": False})()
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    expected, _ = eager_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    with segments(20, continuation=66):
        got, _ = invariant_attention(module, q, k, v, allowed, scaling=dim ** -0.5)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
    with segments(continuation=0):  # the continuation alone, behind the rest as a cache
        alone, _ = invariant_attention(module, q[:, :, 66:], k, v, allowed[:, :, 66:], scaling=dim ** -0.5)
    assert torch.equal(alone, got[:, 66:])


@pytest.mark.parametrize("hole", [False, True], ids=["right-padded", "a hidden cached key in front"])
def test_continuation_attention_on_cached_tiles_gives_the_bits_of_the_keys_in_full(hole):
    """A continuation pass's new keys marked with the batch's cached ones (CachedKeys: tiles made once, patched
    where a pass's keys go) give the bits of the cached keys copied behind each copy of the batch; a cache whose
    visible keys are not all in front (not a right-padded batch) falls back to those copies."""
    from slimroute.runtime.attention import CachedKeys, segments

    batch, copies, heads, kv_heads, cached_len, steps, dim = 3, 2, 4, 2, 70, 3, 16
    torch.manual_seed(1)
    keys, values = torch.randn(batch, kv_heads, cached_len, dim), torch.randn(batch, kv_heads, cached_len, dim)
    q = torch.randn(copies * batch, heads, steps, dim)
    new_k, new_v = torch.randn(copies * batch, kv_heads, steps, dim), torch.randn(copies * batch, kv_heads, steps, dim)
    visible = torch.tensor([70, 45, 60]).repeat(copies)  # each row's cached keys: right-padded
    fed = torch.tensor([3, 2]).repeat_interleave(batch)  # copy 0 feeds a 3-token run, copy 1 a 2-token one
    key_index, query_index = torch.arange(cached_len + steps), torch.arange(steps)
    cached_seen = key_index[None, None, :] < visible[:, None, None]
    own = key_index - cached_len
    new_seen = (own[None, None, :] >= 0) & (own[None, None, :] <= query_index[None, :, None]) & (
        own[None, None, :] < fed[:, None, None])
    allowed = (cached_seen | new_seen)[:, None]  # (C * B, 1, steps, P + steps)
    if hole:
        allowed[[1, 4], :, :, 10] = False
    full_k = torch.cat([keys.repeat(copies, 1, 1, 1), new_k], dim=2)
    full_v = torch.cat([values.repeat(copies, 1, 1, 1), new_v], dim=2)
    shared = CachedKeys(keys, values)
    with segments(continuation=0):
        expected, _ = invariant_attention(None, q, full_k, full_v, allowed, scaling=dim ** -0.5)
        got, _ = invariant_attention(None, q, shared.mark(new_k.clone()), new_v, allowed, scaling=dim ** -0.5)
        tiles = shared._tiles
        again, _ = invariant_attention(None, q, shared.mark(new_k.clone()), new_v, allowed, scaling=dim ** -0.5)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert (tiles is None) == hole and shared._tiles is tiles  # tiled once (a second layer, pass: the same tiles)


def test_invariant_attention_bits_do_not_depend_on_the_query_chunks(monkeypatch):
    """Long inputs run QUERY_TILES query tiles per pass: the same bits as one pass over every query."""
    import slimroute.runtime.attention as attention

    batch, heads, queries, keys, dim = 2, 4, 200, 230, 16
    q, k, v, allowed = causal_attention_inputs(batch, heads, queries, keys, dim)
    allowed[1, :, :, 180:] = False
    assert queries > attention.TILE * attention.QUERY_TILES  # several chunks at the default
    chunked, _ = invariant_attention(None, q, k, v, allowed, scaling=dim ** -0.5)
    monkeypatch.setattr(attention, "QUERY_TILES", 1000)
    whole, _ = invariant_attention(None, q, k, v, allowed, scaling=dim ** -0.5)
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("labels", [SINGLE, MULTI], ids=["single-token", "multi-token"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix", "no-prefix"])
def test_int8_fast_path_gives_the_int8_references_bits(tiny_int8, labels, prefix_cache):
    model, tok = tiny_int8
    rng = random.Random(len(labels) + prefix_cache)
    texts = [make_text(rng, rng.choice([1, 4, 17, 60, 130])) for _ in range(33)]
    task = Task(labels)
    for decision in ("greedy", "max-prob"):
        ref = ReferenceClassifier(model, tok, task, decision).classify(texts)
        for batch_size in (1, 7, 32):
            config = EngineConfig(batch_size=batch_size, max_batch_tokens=None, prefix_cache=prefix_cache,
                                  decision=decision)
            fast = Engine(model, tok, task, config).classify(texts)
            assert [p.label for p in fast] == [p.label for p in ref]
            assert [p.logprobs for p in fast] == [p.logprobs for p in ref], (decision, batch_size)  # bitwise


@pytest.mark.parametrize("labels", [SINGLE, MULTI], ids=["single-token", "multi-token"])
def test_int8_chunked_prefill_gives_the_int8_references_bits(tiny_int8, labels):
    """Long items run chunk_tokens at a time, their keys carried over (chunked prefill): the same bits as one pass,
    as the reference's, in the gated MLP's rows_only pass too, beside short items batched as usual."""
    model, tok = tiny_int8
    rng = random.Random(7 + len(labels))
    texts = [make_text(rng, rng.choice([1, 17, 60, 130, 200])) for _ in range(12)]
    task = Task(labels)
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    for chunk in (32, 64):
        engine = Engine(model, tok, task, EngineConfig(batch_size=7, chunk_tokens=chunk))
        lengths = [len(ids) for ids in engine.encode(texts)[0]]
        assert sum(n > chunk for n in lengths) >= 3 and any(n % chunk for n in lengths if n > chunk)
        fast = engine.classify(texts)
        assert [p.logprobs for p in fast] == [p.logprobs for p in ref], chunk  # bitwise


@pytest.mark.parametrize(("features", "label_logprobs", "layers"),
                         [("mean", False, ()), ("hidden+mean", False, (1,)), ("hidden", True, (1,))],
                         ids=["mean", "last+mean+layer", "last+label-logprobs+layer"])
def test_int8_chunked_prefill_with_a_head_that_reads_every_token_gives_the_references_bits(
        tiny_int8, features, label_logprobs, layers):
    """A head's mean over an item's tokens (final or a middle layer's states) from the chunks put back together:
    the same bits as the reference's one pass, so a served head keeps chunked prefill's fairness."""
    model, tok = tiny_int8
    task = Task(MULTI)
    head = random_head(model, tok, task, features=features, with_label_logprobs=label_logprobs, layers=layers,
                       seed=11)
    rng = random.Random(13)
    texts = [make_text(rng, rng.choice([1, 17, 60, 130, 200])) for _ in range(12)]
    engine = Engine(model, tok, task, EngineConfig(batch_size=7, chunk_tokens=32), head=head)
    lengths = [len(ids) for ids in engine.encode(texts)[0]]
    assert engine._chunk_tokens == 32 and sum(n > 32 for n in lengths) >= 3
    fast = engine.classify(texts)
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    assert [p.label for p in fast] == [p.label for p in ref]
    assert [p.logprobs for p in fast] == [p.logprobs for p in ref]  # bitwise


@pytest.mark.parametrize("features", ["hidden", "hidden+mean"])
def test_int8_template_head_gives_the_references_bits_with_prefix_cache_and_chunks(tiny_int8, features):
    """A template task (no chat template, an empty prefix), as `tune --prompt represent` makes: with the prefix cache,
    batched and in chunks, without the cache, the reference's bits, head and zero-shot label scores alike."""
    model, tok = tiny_int8
    task = Task(MULTI, template='Customer message: "{text}"\nTopic (a few words): "')
    head = random_head(model, tok, task, features=features, seed=17)
    rng = random.Random(19)
    texts = [make_text(rng, rng.choice([1, 17, 60, 130, 200])) for _ in range(12)]
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    zero_ref = ReferenceClassifier(model, tok, task).classify(texts)
    for config in (EngineConfig(batch_size=7), EngineConfig(batch_size=7, chunk_tokens=32),
                   EngineConfig(batch_size=5, prefix_cache=False)):
        engine = Engine(model, tok, task, config, head=head)
        assert engine.prompt.prefix_ids == []
        assert [p.logprobs for p in engine.classify(texts)] == [p.logprobs for p in ref], config  # bitwise
        plain = Engine(model, tok, task, config)
        assert [p.logprobs for p in plain.classify(texts)] == [p.logprobs for p in zero_ref], config
    assert len({p.label for p in ref}) > 1


def test_int8_truncate_tokens_gives_the_int8_references_bits(tiny_int8):
    """Texts cut to a task's truncate_tokens: the fast path still gives the int8 reference's bits."""
    model, tok = tiny_int8
    rng = random.Random(5)
    texts = [make_text(rng, rng.choice([2, 9, 10, 60, 130])) for _ in range(20)]
    task = Task(MULTI, truncate_tokens=10)
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    fast = Engine(model, tok, task, EngineConfig(batch_size=7)).classify(texts)
    assert [p.truncated for p in fast] == [p.truncated for p in ref] and any(p.truncated for p in fast)
    assert [p.logprobs for p in fast] == [p.logprobs for p in ref]  # bitwise


@pytest.mark.parametrize("row_keys", [1, 10 ** 9], ids=["a-pass-a-label", "labels-share-a-pass"])
def test_int8_continuation_passes_give_the_references_bits_however_labels_share_them(tiny_int8, monkeypatch,
                                                                                     row_keys):
    """Multi-token labels' contexts are fed as runs of tokens (a context other labels extend is not fed again:
    "Technical Support" inside "Technical Support escalation..."); runs of different lengths (the shorter ones
    right-padded) share continuation passes up to CONTINUATION_ROW_KEYS, or run one a pass: the int8 reference's
    bits either way."""
    import slimroute.engine.fast as engine_module

    monkeypatch.setattr(engine_module, "CONTINUATION_ROW_KEYS", row_keys)
    model, tok = tiny_int8
    rng = random.Random(7)
    texts = [make_text(rng, rng.choice([1, 5, 40, 90])) for _ in range(12)]
    task = Task(MULTI + ("Technical Support escalation for enterprise customers",))
    engine = Engine(model, tok, task, EngineConfig(batch_size=5))
    assert len(engine._runs) < sum(len(ids) > 1 for ids in engine.label_ids)
    groups = engine._continuation_groups(5, 100)
    lengths = [len(engine._runs[r]) for group in groups for r in group]
    assert len(set(lengths)) > 1 and lengths == sorted(lengths)  # shortest first; some padded when shared
    assert len(groups) == (len(lengths) if row_keys == 1 else 1)
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    fast = engine.classify(texts)
    assert [p.logprobs for p in fast] == [p.logprobs for p in ref]  # bitwise


def _quirky_gemms(monkeypatch):
    """Make the attention tiles' GEMMs round as MKL's AVX2 kernels may, on any CPU: a row's bits follow where it
    sits in the product (here: rows 4 and 5 of every 6) and whether an operand comes transposed."""
    import slimroute.runtime.attention as attention

    def nudge(product: torch.Tensor, transposed: bool) -> torch.Tensor:
        rows = torch.arange(product.shape[-2]) % 6 >= 4
        product[..., rows, :] *= 1 + 2.0 ** -20
        return product * (1 + 2.0 ** -19) if transposed else product

    def scores(q, k_transposed):  # matmul hands MKL a broadcast operand as a contiguous copy, else as it comes
        as_given = k_transposed.shape[:-2] == q.shape[:-2]
        return nudge(torch.matmul(q, k_transposed), transposed=as_given and k_transposed.stride(-2) == 1)

    def add_weighted_sum(out, probs, v, first):
        product = nudge(torch.bmm(probs, v), transposed=v.stride(-2) == 1)
        out.copy_(product) if first else out.add_(product)

    monkeypatch.setattr(attention, "_tile_scores", scores)
    monkeypatch.setattr(attention, "_add_weighted_sum", add_weighted_sum)


@pytest.mark.parametrize("labels", [SINGLE, MULTI], ids=["single-token", "multi-token"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix", "no-prefix"])
def test_int8_fast_path_gives_the_references_bits_with_gemms_that_round_by_row_and_layout(monkeypatch, labels,
                                                                                        prefix_cache):
    """A query sits in the same row of its tile, and its keys come in the same layout, in the fast path (prefix
    cached, items batched, a label's continuation in a pass of its own) and in the one-at-a-time path (one
    sequence): so a GEMM that rounds a row by where it sits (MKL on AVX2) still gives both the same bits."""
    _quirky_gemms(monkeypatch)
    model, tok = int8_model("qwen2")
    rng = random.Random(11 + prefix_cache)
    texts = [make_text(rng, rng.choice([1, 4, 17, 60, 130])) for _ in range(17)]
    task = Task(labels)
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    for batch_size in (1, 7):
        config = EngineConfig(batch_size=batch_size, max_batch_tokens=None, prefix_cache=prefix_cache)
        fast = Engine(model, tok, task, config).classify(texts)
        assert [p.logprobs for p in fast] == [p.logprobs for p in ref], batch_size  # bitwise


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix", "no-prefix"])
@pytest.mark.parametrize("features", ["hidden+mean", "mean", "hidden+mean, layer 1"])
def test_int8_head_with_mean_states_gives_the_references_bits(tiny_int8, prefix_cache, features):
    """A +mean head reads every item position's final state: their float64 means are bitwise equal too (also
    centred and scaled to unit length, as a description head; and a decoder layer's output, as a head with
    layers)."""
    from test_head import random_head

    model, tok = tiny_int8
    rng = random.Random(7 + prefix_cache)
    texts = [make_text(rng, rng.choice([1, 4, 17, 60, 130])) for _ in range(33)]
    task = Task(MULTI)
    head = random_head(model, tok, task, seed=5, features=features.split(",")[0], normalize=features == "mean",
                       layers=(1,) if features.endswith("layer 1") else ())
    ref = ReferenceClassifier(model, tok, task, head=head).classify(texts)
    for batch_size in (1, 7, 32):
        config = EngineConfig(batch_size=batch_size, max_batch_tokens=None, prefix_cache=prefix_cache)
        fast = Engine(model, tok, task, config, head=head).classify(texts)
        assert [p.logprobs for p in fast] == [p.logprobs for p in ref], batch_size  # bitwise
    assert len({p.label for p in ref}) > 1


def test_quantised_weights_are_cached_and_reloaded_bitwise(tmp_path):
    texts = ["refund my card please", "app crash after login error"]
    task = Task(SINGLE)
    cache_file = tmp_path / "int8.safetensors"
    first, tok = tiny_model("qwen2")
    quantize_model(first, cache_file)
    set_attention(first)
    assert cache_file.is_file()
    second, _ = tiny_model("qwen2")
    second.get_decoder().layers[0].mlp.up_proj.weight.data.zero_()  # proves the int8 weights come from the file
    quantize_model(second, cache_file)
    set_attention(second)
    a, b = (Engine(m, tok, task).classify(texts) for m in (first, second))
    assert [p.logprobs for p in a] == [p.logprobs for p in b]


def test_a_new_int8_cache_replaces_an_earlier_schemes_file(tmp_path):
    from slimroute.runtime.quantize import SCHEME

    earlier = tmp_path / "int8-w127-a63-smooth-v3.safetensors"  # what an earlier version cached
    earlier.write_bytes(b"stale")
    other = tmp_path / "model.safetensors"  # the checkpoint itself stays
    other.write_bytes(b"weights")
    model, _ = tiny_model("qwen2")
    quantize_model(model, tmp_path / f"int8-{SCHEME}.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"int8-{SCHEME}.safetensors", "model.safetensors"])


@pytest.mark.parametrize("native_kernels", [pytest.param(None, marks=needs_native), False], ids=["native", "eager"])
def test_a_q8_head_is_cached_compact_and_gives_the_references_bits(tmp_path, native_kernels):
    """A tiny model whose output head holds Q8_0 values (as the packaged GGUF's does): the int8 model's head is a
    Q8Head, the cache file holds the compact form in the checkpoint's order (the packing for the native kernel,
    done in place, comes after the file is written) and a reload takes it from there, and the fast path still
    gives the reference's bits."""
    texts = [make_text(random.Random(i), n) for i, n in enumerate((1, 5, 30, 90))]
    task = Task(MULTI)
    cache_file = tmp_path / "int8.safetensors"
    models = []
    for _ in range(2):
        model, tok = tiny_model("qwen2")
        with torch.no_grad():
            model.lm_head.weight = nn.Parameter(q8_0(model.lm_head.weight.data.clone()), requires_grad=False)
        expected = compact_head(model.lm_head.weight.data.clone())
        if models:
            model.lm_head.weight.data.zero_()  # proves the reload's head comes from the cache file
        quantize_model(model, cache_file, tok, native=native_kernels)
        set_attention(model)
        head = model.get_output_embeddings()
        assert isinstance(head, Q8Head) and (head.kernels is not None) == (native_kernels is None)
        models.append(model)
    from safetensors import safe_open

    with safe_open(str(cache_file), "pt") as stored:
        assert all(torch.equal(stored.get_tensor(key), expected[key]) for key in ("head.q8", "head.q8_scale"))
    ref = ReferenceClassifier(models[0], tok, task).classify(texts)
    for model in models:
        for batch_size in (1, 3):
            fast = Engine(model, tok, task, EngineConfig(batch_size=batch_size)).classify(texts)
            assert [p.logprobs for p in fast] == [p.logprobs for p in ref]  # bitwise


def test_int8_probe_failure_is_reported(monkeypatch):
    import slimroute.runtime.int8 as int8

    def broken(*args):
        raise RuntimeError("quantized::linear_prepack: simulated failure")

    monkeypatch.setattr(int8, "_prepack", broken)
    assert "simulated failure" in int8_failure()


@pytest.mark.slow
def test_int8_is_bitwise_equal_to_its_reference_on_the_packaged_smollm2(tmp_path, monkeypatch):
    """A real model (SmolLM2-135M, Llama architecture): padded, cached, batched int8 == one at a time, bitwise."""
    from slimroute.io.synth import synthetic_tickets
    from slimroute.runtime.load import load_model

    loaded = load_model("smollm2-135m", "int8", threads=2)
    assert (loaded.precision, loaded.attention) == ("int8", "invariant")
    texts = [t["text"] for t in synthetic_tickets(600, 0)[:24]]
    task = Task(MULTI)
    ref = ReferenceClassifier(loaded.model, loaded.tokenizer, task).classify(texts)
    for batch_size in (1, 7, 32):
        fast = Engine.from_loaded(loaded, task, EngineConfig(batch_size=batch_size)).classify(texts)
        assert [p.logprobs for p in fast] == [p.logprobs for p in ref], batch_size


def test_invariant_attention_plans_a_mask_once_and_drops_the_plan_with_it():
    """The mask's plan (key order, additive bias, key tiles per query tile) is made once for the layers of a
    forward pass, made again for another mask or an edited one, and let go when its mask is."""
    import gc

    import slimroute.runtime.attention as attention

    batch, heads, queries, keys, dim = 2, 4, 40, 50, 16
    q, k, v, allowed = causal_attention_inputs(batch, heads, queries, keys, dim)
    first, _ = invariant_attention(None, q, k, v, allowed, scaling=dim ** -0.5)
    plan = attention._plan[2]
    again, _ = invariant_attention(None, q, k, v, allowed, scaling=dim ** -0.5)
    assert attention._plan[2] is plan and torch.equal(again, first)  # a second layer: the same plan
    allowed[1, :, :, 30:] = False  # edited in place: planned again
    edited, _ = invariant_attention(None, q, k, v, allowed, scaling=dim ** -0.5)
    assert attention._plan[2] is not plan
    fresh, _ = invariant_attention(None, q, k, v, allowed.clone(), scaling=dim ** -0.5)  # another mask object
    assert torch.equal(fresh, edited) and not torch.equal(edited[1], first[1])
    gc.collect()
    assert attention._plan == (None,)  # the clone is gone, and its plan with it


def test_a_quantizer_feeds_only_its_own_kernel():
    """fbgemm takes 7-bit integers as floats, oneDNN 8-bit ones as shifted uint8 (ACTIVATIONS): a shared quantizer
    made for one kernel is refused by the other; both forms hold the row's integers at their resolution."""
    from slimroute.runtime.int8 import ACTIVATIONS, Int8Linear, RowQuantizer

    x = torch.randn(5, 64)
    as_floats, scale = RowQuantizer(kernel="fbgemm")(x)
    as_uint8, fine_scale = RowQuantizer(kernel="onednn")(x)
    assert as_floats.abs().amax(dim=1).eq(63).all() and torch.equal(scale * 63, x.abs().amax(dim=1, keepdim=True))
    ints = as_uint8.float() - ACTIVATIONS["onednn"][1]
    assert as_uint8.dtype == torch.uint8 and ints.abs().amax(dim=1).eq(127).all()
    assert torch.equal(ints, torch.round(x / fine_scale)) and torch.equal(as_floats, torch.round(x / scale))
    with pytest.raises(ValueError, match="cannot feed the fbgemm kernel"):
        Int8Linear.from_linear(nn.Linear(64, 8), RowQuantizer(kernel="onednn"), kernel="fbgemm")


@needs_native
def test_native_elementwise_gives_each_row_the_bits_it_gets_alone():
    """The native quantiser and MLP middle: a row's integers and scale do not depend on the rows around it (odd
    sizes: the vector loops' tails too); the quantiser's are eager's bits, the gate's eager's up to the last bits of
    silu (its own exp)."""
    from slimroute.runtime.int8 import ACTIVATIONS, EAGER

    kernels = native()
    generator = torch.Generator().manual_seed(4)
    gate, up = torch.randn(37, 72, generator=generator) * 3, torch.randn(37, 72, generator=generator)
    scale = torch.rand(37, 1, generator=generator) + 0.1
    with torch.inference_mode():
        for ints in ACTIVATIONS.values():
            shift = ints[1]
            q, q_scale = kernels.to_ints(gate, *ints)
            assert q.dtype == (torch.uint8 if shift else torch.float32)
            eager_q, eager_scale = EAGER.to_ints(gate, *ints)
            assert torch.equal(q, eager_q) and torch.equal(q_scale, eager_scale)
            hidden, hidden_scale = kernels.gated_to_ints(gate, up, scale, *ints)
            eager_hidden, eager_hidden_scale = EAGER.gated_to_ints(gate, up, scale, *ints)
            assert (hidden.float() - eager_hidden.float()).abs().max() <= 1
            assert torch.allclose(hidden_scale, eager_hidden_scale, rtol=1e-5)
            for rows in (slice(0, 1), slice(5, 6), slice(3, 10), slice(30, 37)):
                alone, alone_scale = kernels.gated_to_ints(gate[rows], up[rows], scale[rows], *ints)
                assert torch.equal(alone, hidden[rows]) and torch.equal(alone_scale, hidden_scale[rows])
                alone, alone_scale = kernels.to_ints(gate[rows], *ints)
                assert torch.equal(alone, q[rows]) and torch.equal(alone_scale, q_scale[rows])


@pytest.mark.parametrize("native_kernels", [pytest.param(None, marks=needs_native), False])
def test_int8_model_runs_a_gated_silu_mlp_as_one_gemm_and_its_other_layers_as_slices(native_kernels):
    """q/k/v and gate/up become one GEMM each over their stacked weights (their columns: the same bits as the layers
    alone); a gated SiLU MLP becomes an Int8GatedMLP computing what the model's own MLP computes on those layers."""
    from slimroute.runtime.int8 import Int8GatedMLP, Int8Slice

    model, _ = int8_model("qwen2", native=native_kernels, fused=False)
    float_model, _ = tiny_model("qwen2")
    layers = model.get_decoder().layers
    assert all(isinstance(layer.mlp, Int8GatedMLP) for layer in layers)
    attention = layers[0].self_attn
    assert all(isinstance(getattr(attention, name), Int8Slice) for name in ("q_proj", "k_proj", "v_proj"))
    assert attention.q_proj.stacked is attention.v_proj.stacked and attention.k_proj.start == attention.q_proj.end
    plain = float_model.get_decoder().layers[0].mlp
    assert Int8GatedMLP.replaces(plain)
    plain.act_fn = nn.GELU()  # another activation: not what Int8GatedMLP computes
    assert not Int8GatedMLP.replaces(plain)
    mlp, x = layers[0].mlp, torch.randn(2, 5, layers[0].mlp.gate_up.in_features)
    with torch.inference_mode():  # the model's own MLP arithmetic on the same int8 layers
        q, scale = mlp.gate_up.quantizer(x)
        both = mlp.gate_up.integer_product(q)
        half = both.shape[1] // 2
        unfused = mlp.down_proj(F.silu(both[:, :half] * scale) * (both[:, half:] * scale)).view(2, 5, -1)
        if native_kernels is False:
            assert torch.equal(mlp(x), unfused)
        else:  # the native silu's exp is its own: within the last bits of an integer
            assert torch.allclose(mlp(x), unfused, rtol=1e-2, atol=1e-3)
    with torch.inference_mode():  # a slice is its layer: columns of the one GEMM, times the row scales, plus bias
        h = torch.randn(3, attention.q_proj.in_features)
        q, s = attention.q_proj.shared.linear.quantizer(h)
        whole = attention.q_proj.stacked.integer_product(q)
        k = attention.k_proj
        assert torch.equal(k(h), whole[:, k.start:k.end] * s + k.bias)


def test_native_failure_falls_back_to_eager_with_a_note(monkeypatch, caplog):
    """Where the native kernels do not build (no C compiler, a failing probe), the int8 model runs its elementwise
    ops as torch ops, with one warning line; SLIMROUTE_COMPILE=0 asks for that without a warning."""
    import slimroute.runtime.native as native_module
    from slimroute.runtime import int8

    def broken():
        raise RuntimeError("no C compiler found (set CC, or install gcc)")

    monkeypatch.setattr(native_module, "_LOADED", [])
    monkeypatch.setattr(native_module, "_load", broken)
    with caplog.at_level("WARNING", logger="slimroute.runtime.native"):
        assert int8.elementwise() is int8.EAGER
    assert "native kernels do not run here (no C compiler found" in caplog.text
    assert len(caplog.records) == 1
    caplog.clear()
    monkeypatch.setattr(native_module, "_LOADED", [])
    monkeypatch.setenv("SLIMROUTE_COMPILE", "0")
    with caplog.at_level("WARNING", logger="slimroute.runtime.native"):
        assert int8.elementwise() is int8.EAGER
    assert not caplog.records
