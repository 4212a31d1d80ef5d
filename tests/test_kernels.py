import pytest
import torch
from tiny import tiny_model
from torch import nn

from slimroute.config import EngineConfig
from slimroute.engine import Engine
from slimroute.kernels import OneDNNLinear, set_linear_kernels
from slimroute.task import Task


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_onednn_linear_matches_nn_linear(dtype, tol):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    x = torch.randn(3, 7, 64, dtype=dtype)
    fast = OneDNNLinear(linear)
    assert torch.allclose(fast(x).float(), linear(x).float(), atol=tol, rtol=tol)
    back = fast.to_linear()
    assert torch.equal(back(x), linear(x))


def test_swap_and_restore_keep_answers():
    model, tok = tiny_model("qwen2")
    task = Task(("billing", "technical", "account"))
    texts = ["refund my card", "app crash after login"]
    assert set_linear_kernels(model, "default") == "default"
    plain = Engine(model, tok, task, EngineConfig()).classify(texts)
    assert set_linear_kernels(model, "onednn") == "onednn"
    assert any(isinstance(m, OneDNNLinear) for m in model.modules())
    fast = Engine(model, tok, task, EngineConfig()).classify(texts)
    set_linear_kernels(model, "default")
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())
    for a, b in zip(plain, fast, strict=True):
        assert a.label == b.label and max(abs(a.logprobs[k] - b.logprobs[k]) for k in a.logprobs) < 1e-4


def test_unknown_kernels_rejected():
    model, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="kernels"):
        set_linear_kernels(model, "fast")
