"""The bench's GEMM-only limit and op profile (bench/limit.py), on tiny models."""

import pytest
import torch
from test_int8 import int8_model
from tiny import tiny_model
from torch import nn

from slimroute.bench.limit import DECODER_GEMM, GemmCalls, Limit, profile_markdown, profile_ops, replay
from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.runtime.fused import fused_decoder
from slimroute.runtime.int8 import Int8Linear
from slimroute.runtime.linear import OneDNNLinear, onednn_failure, set_linear_kernels
from slimroute.task import Task

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

TASK = Task(["billing", "technical", "account"])
TEXTS = ["refund my card please", "the app crashes at login", "reset password", "upgrade plan", "server error"]


def _engine(model, tok, batch_size=2):
    return Engine(model, tok, TASK, EngineConfig(batch_size=batch_size))


def test_limit_arithmetic():
    limit = Limit(items=600, row_seconds=40.0, gemm_seconds=26.0, num_gemms=1000)
    assert limit.items_per_s == pytest.approx(600 / 26.0)
    assert limit.share == pytest.approx(26.0 / 40.0)  # the row's items/s over the limit's
    assert limit.share == pytest.approx((600 / 40.0) / limit.items_per_s)


def test_paired_limit_takes_the_medians_of_turns_and_of_their_ratios(monkeypatch):
    import slimroute.bench.limit as limit_module

    clock, turns = [0.0], iter([(4.0, 3.0), (9.0, 3.5), (5.0, 4.5)])  # (row s, GEMM s) of each turn; one busy row
    seconds = {}
    monkeypatch.setattr(limit_module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(limit_module, "replay", lambda calls, passes: seconds.pop("gemm"))
    monkeypatch.setattr(limit_module, "large_gemm_rate", lambda calls: 1e12)

    def run():
        row, gemm = next(turns)
        clock[0] += row
        seconds["gemm"] = gemm

    calls = [limit_module.GemmCall(lambda x: x, 4, 8, torch.float32, "float", 16)]
    limit = Limit.paired(10, run, calls, passes=3)
    assert (limit.row_seconds, limit.gemm_seconds, limit.passes) == (5.0, 3.5, 3)
    assert limit.share == pytest.approx(0.75)  # median of 3/4, 3.5/9, 4.5/5: the busy turn is an outlier
    assert limit.to_dict()["share"] == limit.share and limit.macs == 4 * 8 * 16


def test_int8_gemms_recorded_one_per_linear_layer_per_pass_with_the_passes_rows():
    model, tok = int8_model("qwen2")
    engine = _engine(model, tok)
    plain = engine.classify(TEXTS)
    with GemmCalls(model) as calls:
        recorded = engine.classify(TEXTS)
    assert [p.logprobs for p in recorded] == [p.logprobs for p in plain]  # recording changes nothing
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 2 * 4 and len(calls.layers) == len(layers)  # q/k/v stacked, o, gate/up stacked, down
    assert not any("integer_product" in layer.__dict__ for layer in layers)  # the class's method is back
    # every pass runs each of a layer's 4 GEMMs once (the last layer's MLP on the scored rows alone)
    assert len(calls.calls) % 8 == 0
    qkv = model.model.layers[0].self_attn.q_proj.stacked
    q_rows = [c.rows for c in calls.calls if c.gemm.__self__ is qkv]
    # the first pass of a batch (2, items sorted by length) runs the pair's tokens: packed where the decoder is
    # fused (no padding), else padded to the longest
    lengths = sorted(len(ids) for ids in engine.encode(TEXTS)[0])
    pairs = list(zip(lengths[::2], lengths[1::2], strict=False))
    assert q_rows[0] in ({sum(pair) for pair in pairs} if fused_decoder(model) else {2 * max(pair) for pair in pairs}
                         ) | {lengths[-1]}
    assert all(c.dtype == torch.uint8 or c.kernel == "fbgemm" for c in calls.calls)

    ran = []
    for i, call in enumerate(calls.calls):  # replay runs exactly the recorded GEMMs, on inputs of their shapes
        calls.calls[i] = type(call)(lambda x, g=call.gemm, r=call.rows: ran.append((g, r, tuple(x.shape))) or g(x),
                                    call.rows, call.in_features, call.dtype, call.kernel, call.out_features)
    assert replay(calls.calls, passes=1) > 0
    assert [(r, s) for _, r, s in ran] == [(c.rows, (c.rows, c.in_features)) for c in calls.calls]
    limit = Limit.of(len(TEXTS), 10.0, calls.calls)  # the best of 3 passes, and one large GEMM of theirs timed
    assert limit.macs == sum(c.rows * c.in_features * c.out_features for c in calls.calls) > 0
    assert limit.gemm_seconds > 0 and limit.large_rate > 0 and limit.efficiency == limit.rate / limit.large_rate


@pytest.mark.parametrize("kernels", ["default", "onednn"])
def test_float_gemms_recorded_for_default_and_onednn_linears(kernels):
    if kernels == "onednn" and (problem := onednn_failure(torch.float32)):
        pytest.skip(f"oneDNN's fp32 linear does not run here: {problem}")
    model, tok = tiny_model("llama")
    set_linear_kernels(model, kernels)
    engine = _engine(model, tok)
    with GemmCalls(model) as calls:
        engine.classify(TEXTS[:3])
    kind = OneDNNLinear if kernels == "onednn" else nn.Linear
    assert len(calls.layers) == 14 and all(type(m) is kind for m in calls.layers)
    assert model.get_output_embeddings() not in calls.layers
    assert calls.calls and all(c.kernel == "float" and c.dtype == torch.float32 for c in calls.calls)
    assert not any("forward" in m.__dict__ for m in calls.layers)
    assert replay(calls.calls) > 0


def test_profile_names_the_ops_and_the_decoder_gemms_share():
    model, tok = int8_model("qwen2")
    engine = _engine(model, tok)
    profile = profile_ops(engine, TEXTS, top=5)
    assert 0 < profile["decoder_gemm_share"] < 1
    assert len(profile["ops"]) == 5 and DECODER_GEMM not in {op["name"] for op in profile["ops"]}
    assert profile["ops"][0]["self_s"] >= profile["ops"][-1]["self_s"]
    table = profile_markdown("int8", profile)
    assert "decoder GEMMs" in table[0] and len(table) == 4 + 5
