import random
import subprocess
import sys

import pytest
import torch
from tiny import make_text, tiny_model
from torch import nn

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.runtime.attention import pick_attention, set_attention
from slimroute.runtime.cpu import detect
from slimroute.runtime.dtypes import exactness
from slimroute.runtime.linear import OneDNNLinear, onednn_failure, set_linear_kernels
from slimroute.task import Task

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

CPU = detect()
needs_bf16 = pytest.mark.skipif(
    onednn_failure(torch.bfloat16) is not None,
    reason=f"oneDNN's bf16 kernels need AVX-512 (bw/vl/dq) or AVX-NE-CONVERT; this CPU is {CPU.describe()}",
)
# Measured: on AVX2 (Zen 3) oneDNN's fp32 kernels block by batch shape, so a row's last bits depend on the rows
# beside it; on AVX-512 (Zen 5) they do not. The engine's fp32 fast path is held to 1e-4, not to bits.
needs_avx512_for_fp32_bits = pytest.mark.skipif(
    not CPU.avx512, reason=f"oneDNN's AVX2 fp32 GEMM is not row-invariant (this CPU: {CPU.describe()})")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2, marks=needs_bf16)])
def test_onednn_linear_matches_nn_linear(dtype, tol):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    x = torch.randn(3, 7, 64, dtype=dtype)
    fast = OneDNNLinear(linear)
    assert torch.allclose(fast(x).float(), linear(x).float(), atol=tol, rtol=tol)
    back = fast.to_linear()
    assert torch.equal(back(x), linear(x))


def test_packed_weight_matches_the_plain_weight_for_every_batch_shape():
    """Packing changes no result beyond fp32 rounding, whatever the batch shape (every CPU)."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    x = torch.randn(300, 96)
    packed = OneDNNLinear(linear, pack=True)
    for rows in (1, 2, 7, 64, 300):
        assert torch.allclose(packed(x[:rows]), linear(x[:rows]), atol=1e-5, rtol=1e-5), rows


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=needs_avx512_for_fp32_bits),
                                   pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packed_weight_gives_the_plain_weights_bits_for_every_batch_shape(dtype):
    """The weight reordered once into oneDNN's layout changes no bit, and each row's output does not depend on
    how many other rows share the call (what keeps the batched engine equal to the one-at-a-time reference)."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200).to(dtype)
    x = torch.randn(300, 96, dtype=dtype)
    packed, plain = OneDNNLinear(linear, pack=True), OneDNNLinear(linear, pack=False)
    assert packed.packed and "weight" not in dict(packed.named_parameters())
    whole = plain(x)
    for rows in (1, 2, 7, 64, 300):
        assert torch.equal(packed(x[:rows]), whole[:rows]), rows
    assert torch.equal(packed.to_linear().weight, linear.weight)


def test_output_head_stays_plain_and_readable():
    model, _ = tiny_model("qwen2")
    set_linear_kernels(model, "onednn")
    assert not model.get_output_embeddings().packed  # the label scorer reads its rows
    assert all(m.packed for m in model.model.modules() if isinstance(m, OneDNNLinear))
    set_linear_kernels(model, "default")
    assert type(model.get_output_embeddings()) is nn.Linear


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


def test_auto_attention_is_eager_only_for_bf16_on_cpu():
    assert pick_attention("cpu", torch.float32, int8=True) == "invariant"
    assert pick_attention("cpu", torch.bfloat16) == "eager"
    assert pick_attention("cpu", torch.float32) == "sdpa"
    assert pick_attention("cuda", torch.bfloat16) == "sdpa"
    assert pick_attention("cpu", torch.bfloat16, "sdpa") == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of"):
        pick_attention("cpu", torch.float32, "flash")


BF16 = exactness("bfloat16", CPU)
# Where oneDNN emulates bf16 (AVX-512 without AVX512-BF16: Ice Lake) slimroute claims no bound (a real model's
# log-probs moved by 0.08, dtypes.exactness); the tests' tiny models stay within this one (2.5e-5 measured on the
# tiny Llama, held to Ice Lake's ISA and on a real Ice Lake), so a change that makes them worse still shows.
TINY_EMULATED_BF16_BOUND = 1e-4


@needs_bf16
@pytest.mark.skipif(CPU.amx, reason=f"oneDNN runs bf16 on AMX tiles here ({CPU.describe()}), whose rounding follows "
                    "the GEMM's shape: not batch-invariant, so --dtype auto picks int8 on this CPU (cpu.py)")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_fast_path_gives_the_reference_within_its_bound_with_auto_attention(arch):
    """bf16 with the CPU defaults (oneDNN linear, eager attention): the cached, padded, batched engine gives the
    reference's log-probs within what bf16 claims on this CPU (dtypes.exactness), whatever the batch size: with
    native BF16 dot products 1e-5 (fp32 rounding of the normaliser); where oneDNN emulates BF16 (AVX-512 without
    AVX512-BF16: Ice Lake), where slimroute claims no bound, what the tiny models give there."""
    model, tok = tiny_model(arch, dtype=torch.bfloat16)
    set_linear_kernels(model, "auto")
    assert set_attention(model, "auto") == "eager"
    assert BF16.max_abs_logprob_diff == (1e-5 if CPU.native_bf16 else None)
    bound = BF16.max_abs_logprob_diff if CPU.native_bf16 else TINY_EMULATED_BF16_BOUND
    rng = random.Random(0)
    texts = [make_text(rng, rng.choice([1, 5, 30, 120])) for _ in range(40)]
    task = Task(("Technical Support", "Technical Sales", "billing", "account"))
    ref = ReferenceClassifier(model, tok, task).classify(texts)
    for batch_size in (1, 7, 64):
        config = EngineConfig(batch_size=batch_size, max_batch_tokens=None)  # whole batches of 64, long items too
        fast = Engine(model, tok, task, config).classify(texts)
        assert [p.label for p in fast] == [p.label for p in ref]
        worst = max(abs(a.logprobs[k] - b.logprobs[k]) for a, b in zip(ref, fast, strict=True) for k in a.logprobs)
        assert worst <= bound, (batch_size, worst, str(BF16))


def test_released_file_pages_read_back_from_the_file_and_anonymous_memory_is_left_alone(tmp_path):
    from slimroute.runtime.memory import FileMappedMemory

    values = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: many whole pages
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)
    heap = values.clone()
    memory = FileMappedMemory()  # reads the process's mappings: after the file is mapped
    memory.release(mapped[1000:900_000])
    memory.release(heap)  # not file-backed: must not be touched (dropping anonymous pages would zero them)
    assert torch.equal(mapped, values)  # dropped pages come back from the file, the rest never left
    assert torch.equal(heap, values)


def test_onednn_failure_falls_back_to_default_kernels_with_a_note(monkeypatch, caplog):
    """Where oneDNN's op is missing or raises (another torch build, ARM, bf16 on AVX2), "auto" keeps torch's
    kernels and says so in one line; an explicit "onednn" is an error naming the cause."""
    model, tok = tiny_model("qwen2")
    task = Task(("billing", "technical", "account"))
    expected = Engine(model, tok, task).classify(["refund my card"])

    def broken(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: simulated failure\nsecond line")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    with caplog.at_level("WARNING", logger="slimroute.runtime.linear"):
        assert set_linear_kernels(model, "auto") == "default"
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "simulated failure" in notes[0] and "second line" not in notes[0]
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())
    assert Engine(model, tok, task).classify(["refund my card"])[0].label == expected[0].label
    with pytest.raises(ValueError, match="oneDNN kernels do not work here: .*simulated failure"):
        set_linear_kernels(model, "onednn")


def test_a_processs_first_vector_math_call_rounds_like_every_later_one():
    """configure_threads warms MKL's vector math up (kernels.warm_up_vector_math): without it a process's first
    torch.log over 12800 floats gave the second thread's half other values in 3 of 4 processes (Intel Xeon,
    2 threads), and the first torch.cos in 12 of 30, so a process's first forward pass (the rotary cos/sin) could
    differ from every later one. Checked in fresh processes, as a user's job starts (a race: several at once)."""
    code = ("import torch\n"
            "from slimroute.runtime.threads import configure_threads\n"
            "configure_threads(2)\n"
            "x = torch.linspace(0.01, 30, 12800).reshape(200, 64)\n"
            "names = ('log', 'cos', 'sin', 'exp', 'tanh')\n"
            "first = [getattr(torch, name)(x) for name in names]\n"
            "print(all(torch.equal(a, getattr(torch, name)(x)) for a, name in zip(first, names, strict=True)))\n")
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(4)]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert out.strip() == "True"
