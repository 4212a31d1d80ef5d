"""What users would pick instead of slimroute, run on the same task for the bench: llama.cpp.

`LlamaCppClassifier` asks llama.cpp (through the optional `llama-cpp-python`, `pip install 'slimroute[llamacpp]'`)
the same question slimroute does: the same prompt token ids (slimroute's `Prompt`, fed as ids), the label tokens'
log-probs at the assistant-turn start, one more step per proper prefix of a multi-token label, the same decision
rule. Only the compute differs: llama.cpp's kernels on the GGUF's quantised weights. One ticket at a time, as a
user gets it: the shared prefix is evaluated once; each ticket keeps the prefix's KV cells and drops its own.
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from slimroute.labels import Prediction, check_decision, make_prediction, trie_paths
from slimroute.task import Prompt, Task, render_prompt

INSTALL_HINT = "pip install 'slimroute[llamacpp]' (compiles llama.cpp: ~12 min on 2 cores)"


def llama_cpp_unavailable_reason() -> str | None:
    """None when llama-cpp-python imports; otherwise one line saying why not and how to install it."""
    try:
        importlib.import_module("llama_cpp")
    except Exception as exc:  # ImportError, or the bundled shared library failing to load
        return f"llama-cpp-python is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def llama_cpp_available() -> bool:
    return llama_cpp_unavailable_reason() is None


# a child process loads the GGUF and evaluates 4 tokens: llama.cpp's native code can crash outright on some CPUs
# (seen: llama-cpp-python built with -march=native on an Intel Xeon with AMX, SIGSEGV at the first decode)
_TRIAL = ("import sys; from llama_cpp import Llama; llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, "
          "n_threads=int(sys.argv[2]), verbose=False); llm.eval([0, 1, 2, 3])")


def llama_cpp_trial(gguf_path: str | Path, threads: int = 1, timeout: float = 300) -> str | None:
    """None when llama.cpp loads the GGUF and evaluates a few tokens in a child process; else one line saying how
    it failed (in this process the crash would take the caller, the bench with every row, down with it)."""
    command = [sys.executable, "-c", _TRIAL, str(gguf_path), str(threads)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not evaluate 4 tokens within {timeout:.0f} s in a trial run"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        how = f"killed by {signal.Signals(-proc.returncode).name}"
    else:
        lines = proc.stderr.strip().splitlines()
        how = f"exit {proc.returncode}: {lines[-1] if lines else 'no message'}"
    return (f"llama.cpp crashed in a 4-token trial run on this CPU ({how}); a llama-cpp-python built for "
            f"portable AVX2 kernels may run: CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install --force-reinstall "
            f"--no-cache-dir llama-cpp-python")


def gguf_tokenizer(gguf_path: str | Path):
    """The Hugging Face tokenizer transformers reads from a GGUF: the one slimroute's conversion saves."""
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


class LlamaCppClassifier:
    """classify(texts) -> Predictions with llama.cpp's exact label log-probs (float32 logits, log-softmax in
    float64). `quant` is the GGUF's weight format ("Q4_K_M"); `tokens` counts the tokens llama.cpp evaluated
    (prefix once), `last_tokens` those of the last classify call. tokenizer: slimroute's (the converted model's);
    by default the one transformers reads from the GGUF. reuse_prefix=False evaluates each full prompt from
    scratch (what the reuse is checked against)."""

    def __init__(self, gguf_path: str | Path, task: Task, threads: int, decision: str = "greedy", tokenizer=None,
                 n_ctx: int = 2048, n_batch: int = 512, reuse_prefix: bool = True):
        self.decision = check_decision(decision)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if n_batch < 1 or n_ctx < n_batch:
            raise ValueError(f"n_batch must be in 1..n_ctx ({n_ctx}), got {n_batch}")
        path = Path(gguf_path)
        if not path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist")
        if reason := llama_cpp_unavailable_reason():
            raise RuntimeError(reason)
        from llama_cpp import Llama

        self.task, self.gguf_path, self.threads, self.reuse_prefix = task, path, threads, reuse_prefix
        self.tokenizer = tokenizer if tokenizer is not None else gguf_tokenizer(path)
        self.prompt = Prompt(task, self.tokenizer, n_ctx)  # fit_text keeps each prompt inside n_ctx
        self.label_ids = self.prompt.label_ids
        self.paths = trie_paths(self.label_ids)
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                         n_threads_batch=threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.quant = _file_type(self.llm.metadata)
        self.prefix_length = len(self.prompt.prefix_ids)
        self.tokens = self.last_tokens = 0
        if reuse_prefix:
            self._eval_from(0, self.prompt.prefix_ids)

    def _eval_from(self, keep: int, ids: list[int]) -> np.ndarray:
        """Keep the first `keep` KV cells, drop the rest, evaluate `ids` after them; the full-vocabulary
        log-softmax at the last one, (V,) float64."""
        self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
        self.llm.n_tokens = keep
        self.llm.eval(ids)
        self.tokens += len(ids)
        self.last_tokens += len(ids)
        ptr = self.llm._ctx.get_logits_ith(-1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)  # a copy
        top = logits.max()
        return logits - (top + np.log(np.exp(logits - top).sum()))

    def classify_one(self, text: str) -> Prediction:
        text, truncated = self.prompt.fit_text(text)
        item_ids = self.prompt.item_ids(text)
        if self.reuse_prefix:
            start, ids = self.prefix_length, item_ids
        else:
            start, ids = 0, self.prompt.prefix_ids + item_ids
        end = start + len(ids)
        contexts = {(): self._eval_from(start, ids)}
        done: tuple[int, ...] = ()  # label tokens now in the cache after the prompt
        for path in self.paths:  # sorted shortest first, so a path's parent is usually in the cache
            keep = _common_length(done, path[:-1])
            contexts[path] = self._eval_from(end + keep, list(path[keep:]))
            done = path
        token_logprobs = [[float(contexts[ids[:k]][tok]) for k, tok in enumerate(ids)] for ids in self.label_ids]
        return make_prediction(self.task.labels, self.label_ids, token_logprobs, self.decision, end, truncated)

    def classify(self, texts: list[str], progress=None) -> list[Prediction]:
        self.last_tokens = 0
        preds = []
        for text in texts:
            preds.append(self.classify_one(text))
            if progress:
                progress(1)
        return preds

    def tokenizer_mismatches(self, texts: list[str]) -> list[int]:
        """Indices of texts whose full prompt llama.cpp's own tokenizer (from the GGUF) splits into other ids
        than slimroute's Prompt does. Scoring never depends on it (ids are fed directly); it says whether a
        user feeding llama.cpp the prompt string would get the same prompt."""
        bad = []
        for i, text in enumerate(texts):
            text, _ = self.prompt.fit_text(text)
            ours = self.prompt.prefix_ids + self.prompt.item_ids(text)
            rendered = render_prompt(self.tokenizer, self.task, text).encode("utf-8")
            if self.llm.tokenize(rendered, add_bos=False, special=True) != ours:
                bad.append(i)
        return bad

    def close(self) -> None:
        self.llm.close()


def _file_type(metadata: dict) -> str:
    """The GGUF's weight format as llama.cpp names it ("Q4_K_M"), or "" when the file does not say."""
    import gguf

    try:
        return gguf.LlamaFileType(int(metadata["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):
        return ""


def _common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
