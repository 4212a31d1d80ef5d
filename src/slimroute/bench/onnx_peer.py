"""What users would pick instead of slimroute, run on the same task for the bench: ONNX Runtime with int8 weights.

`export_onnx` exports a Hugging Face checkpoint folder once to ONNX in fp32 (torch.onnx.export, the dynamo exporter)
and quantises it with onnxruntime's `quantize_dynamic` (int8 weights per channel, MatMulInteger); both are kept under
the cache (`cache_dir()/onnx/<model-key>/`), keyed by the checkpoint, so a later run loads them in seconds. The graph
takes (B, T) input_ids + attention_mask and (B, K) positions and returns the logits at those positions only, (B, K, V).

`OnnxClassifier` asks it the question slimroute does: the same prompt token ids (slimroute's `Prompt`, fed as ids),
the label tokens' full-vocabulary log-probs after the assistant-turn start, the same decision rule. It runs
length-sorted, right-padded batches of whole prompts (no prefix cache); a multi-token label costs one more pass per
label-trie branch (labels.continuation_runs), whose positions give every proper prefix of the labels at once.
The fp32 export gives the reference's log-probs (within 1e-4); the int8 one does not, and its answers depend on the
batch: quantize_dynamic scales each MatMul's activations per tensor, over the whole padded batch.
Needs the optional `onnx` extra: `pip install 'slimroute[onnx]'`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slimroute.engine.batching import PaddingStats, plan_batches
from slimroute.engine.fast import EngineStats
from slimroute.engine.verify import compare
from slimroute.labels import Prediction, check_decision, continuation_runs, make_prediction
from slimroute.runtime.load import resolve
from slimroute.runtime.paths import cache_dir, sha256_files
from slimroute.task import Prompt, Task

INSTALL_HINT = "pip install 'slimroute[onnx]' (onnxruntime, onnx, onnxscript)"
EXPORT_VERSION = "v1"  # bump when the exported graph's inputs, outputs or exporter settings change
QUANT_SCHEME = "qint8-per-channel"  # quantize_dynamic's weight type and granularity
ROW_NAME = "ONNX Runtime (int8 dynamic quantisation, sorted batches, no prefix cache)"


def onnx_unavailable_reason() -> str | None:
    """None when onnxruntime, onnx and onnxscript (the exporter's) import; else one line saying why not and how to
    install them."""
    for module in ("onnxruntime", "onnx", "onnxscript"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a native library failing to load
            return f"{module} is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def model_key(folder: str | Path) -> str:
    """The checkpoint's name in the cache: a converted GGUF's folder name (it carries the GGUF's sha256), a hub
    snapshot's repo and commit, else the folder's name and the sha256 of its weights and config."""
    folder = Path(folder).resolve()
    if folder.parent == (cache_dir() / "converted").resolve():
        return folder.name
    if folder.parent.name == "snapshots":
        return f"{folder.parent.parent.name}-{folder.name[:16]}"
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + [folder / "config.json"]
    return f"{folder.name}-{sha256_files(files)[:16]}"


@dataclass(frozen=True)
class OnnxExport:
    """The cached ONNX files of one checkpoint; export_s / quantize_s are None when they came from the cache."""

    fp32: Path
    int8: Path | None
    export_s: float | None = None
    quantize_s: float | None = None

    @property
    def folder(self) -> Path:
        return self.fp32.parent.parent

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file())


def export_onnx(folder: str | Path, quantize: bool = True, root: str | Path | None = None, log=None) -> OnnxExport:
    """The checkpoint folder's fp32 ONNX export and (quantize) its int8 form, made once each (minutes for 0.5B
    parameters) and then read from root (default cache_dir()/onnx). Each is written to a temporary folder and moved
    into place, so an interrupted run leaves nothing half-written."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a Hugging Face model folder (no config.json)")
    if reason := onnx_unavailable_reason():
        raise RuntimeError(reason)
    base = Path(root or cache_dir() / "onnx") / model_key(folder)
    fp32, int8 = base / f"fp32-{EXPORT_VERSION}", base / f"int8-{EXPORT_VERSION}-{QUANT_SCHEME}"
    export_s = quantize_s = None
    if not (fp32 / "model.onnx").is_file():
        if log:
            log(f"exporting {folder.name} to ONNX once, into {fp32} (minutes)")
        start = time.perf_counter()
        with _quiet():
            _atomic(fp32, lambda tmp: _export_fp32(folder, tmp / "model.onnx"))
        export_s = time.perf_counter() - start
    if quantize and not (int8 / "model.onnx").is_file():
        if log:
            log(f"quantising the ONNX export to int8 once, into {int8}")
        start = time.perf_counter()
        with _quiet():
            _atomic(int8, lambda tmp: _quantize(fp32 / "model.onnx", tmp / "model.onnx"))
        quantize_s = time.perf_counter() - start
    return OnnxExport(fp32 / "model.onnx", int8 / "model.onnx" if quantize else None, export_s, quantize_s)


@contextmanager
def _quiet():
    """The exporter's and quantiser's warnings (missing torchvision ops, deprecations, "consider pre-processing")
    held back while they run: they say nothing about this graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def _atomic(target: Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.onnx").is_file():  # else another process made it first: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _export_fp32(folder: Path, path: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, plain in (("final_logit_softcapping", None), ("logits_scaling", 1.0)):
        if config.get(key, plain) != plain:  # the graph is the output embedding on the last hidden state, no more
            raise ValueError(f"the ONNX export does not apply {key}={config[key]!r} to the logits")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 0, 0]])  # (B, T): B, T, K > 1, not specialised
    mask = (ids != 0).long()
    positions = torch.tensor([[6, 7], [4, 5]])  # (B, K)
    batch, length, keep = torch.export.Dim("batch"), torch.export.Dim("length"), torch.export.Dim("keep")
    torch.onnx.export(
        _LogitsAt(model).eval(), (ids, mask, positions), str(path), dynamo=True, external_data=True, verbose=False,
        input_names=["input_ids", "attention_mask", "positions"], output_names=["logits"],
        dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length},
                        "positions": {0: batch, 1: keep}})


def _quantize(source: Path, path: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(source, path, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], per_channel=True,
                     use_external_data_format=True)


class _LogitsAt(torch.nn.Module):
    """A causal LM's logits at chosen positions of each row: the decoder over the whole (right-padded) batch, then
    the output embedding on the (B, K) positions' hidden states alone."""

    def __init__(self, model):
        super().__init__()
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()

    def forward(self, input_ids, attention_mask, positions):
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state  # (B, T, H)
        index = positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (B, K, H)
        return self.head(hidden.gather(1, index))  # (B, K, V)


class OnnxClassifier:
    """classify(texts) -> Predictions from an exported graph (export_onnx's fp32 or int8 model.onnx) on ONNX
    Runtime's CPU provider with `threads` intra-op threads. tokenizer: the checkpoint's (slimroute's). Batches as
    the engine plans them (engine.batching.plan_batches); last_stats counts batches and padding."""

    def __init__(self, onnx_path: str | Path, tokenizer, task: Task, threads: int, decision: str = "greedy",
                 batch_size: int = 32, max_batch_tokens: int | None = 512, max_positions: int = 32768):
        self.decision = check_decision(decision)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        path = Path(onnx_path)
        if not path.is_file():
            raise ValueError(f"ONNX file {str(path)!r} does not exist")
        if reason := onnx_unavailable_reason():
            raise RuntimeError(reason)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.task, self.tokenizer, self.threads = task, tokenizer, threads
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self.prompt = Prompt(task, tokenizer, max_positions)
        self.label_ids = self.prompt.label_ids
        self.runs = continuation_runs(self.label_ids)[0] or [()]  # one pass per run; () when every label is 1 token
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.prefix = None  # no prefix cache: every pass runs the whole prompt (the bench reads this)
        self.last_stats = EngineStats()

    def classify(self, texts: list[str], progress=None) -> list[Prediction]:
        stats = EngineStats(num_items=len(texts))
        start = time.perf_counter()
        fitted = [self.prompt.fit_text(text) for text in texts]
        stats.num_truncated = sum(truncated for _, truncated in fitted)
        items = self.prompt.item_ids_batch([text for text, _ in fitted])
        prompts = [self.prompt.prefix_ids + ids for ids in items]
        preds: list[Prediction | None] = [None] * len(texts)
        for batch in plan_batches([len(ids) for ids in prompts], self.batch_size, self.max_batch_tokens):
            contexts = self._contexts([prompts[i] for i in batch], stats.padding)
            for i, context in zip(batch, contexts, strict=True):
                lps = [[float(context[ids[:k]][tok]) for k, tok in enumerate(ids)] for ids in self.label_ids]
                preds[i] = make_prediction(self.task.labels, self.label_ids, lps, self.decision, len(prompts[i]),
                                           fitted[i][1])
            stats.num_batches += 1
            if progress:
                progress(len(batch))
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return preds

    def _contexts(self, prompts: list[list[int]], padding: PaddingStats) -> list[dict[tuple[int, ...], np.ndarray]]:
        """Per prompt, the full-vocabulary log-softmax (V,) float64 after each context the labels need, keyed by the
        label tokens after the prompt: () and each proper prefix of a label."""
        contexts: list[dict[tuple[int, ...], np.ndarray]] = [{} for _ in prompts]
        for run in self.runs:
            seqs = [ids + list(run) for ids in prompts]
            lengths = [len(seq) for seq in seqs]
            padding.add(lengths)
            input_ids = np.full((len(seqs), max(lengths)), self.pad_id, dtype=np.int64)  # (B, T)
            for row, seq in enumerate(seqs):
                input_ids[row, :len(seq)] = seq
            mask = (np.arange(input_ids.shape[1])[None, :] < np.array(lengths)[:, None]).astype(np.int64)  # (B, T)
            positions = np.array([[len(ids) - 1 + k for k in range(len(run) + 1)] for ids in prompts])  # (B, K)
            (logits,) = self.session.run(["logits"], {"input_ids": input_ids, "attention_mask": mask,
                                                      "positions": positions})  # (B, K, V) float32
            logits = logits.astype(np.float64)
            top = logits.max(axis=-1, keepdims=True)  # (B, K, 1)
            logprobs = logits - (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))  # (B, K, V)
            for row, context in enumerate(contexts):
                for k in range(len(run) + 1):
                    context.setdefault(run[:k], logprobs[row, k])
        return contexts


def bench_row(bench, task: Task, model: str, threads: int, batch_size: int, max_batch_tokens: int | None,
              refs: dict[str, list[Prediction] | None]) -> dict | None:
    """The bench's ONNX Runtime int8 row (bench: speed._Bench), when the `onnx` extra is installed: exported and
    quantised once (cached), then timed like the other rows; its labels compared with the fp32 reference's (or,
    when the bench ran no fp32, with the first dtype's reference). A record for bench.json, or None."""
    if reason := onnx_unavailable_reason():
        bench.skip("ONNX Runtime", "-", f"skipped: {reason}")
        return None
    try:
        folder = resolve(model)
        if not Path(folder).is_dir():
            raise ValueError(f"needs a local checkpoint folder, not the hub id {model!r}")
        export = export_onnx(folder, log=bench.log)
        max_positions = int(getattr(AutoConfig.from_pretrained(folder), "max_position_embeddings", 0) or 32768)
        peer = OnnxClassifier(export.int8, AutoTokenizer.from_pretrained(folder), task, threads,
                              batch_size=batch_size, max_batch_tokens=max_batch_tokens, max_positions=max_positions)
    except Exception as exc:  # noqa: BLE001 - the peer's failure is a row saying so; the bench goes on
        bench.skip("ONNX Runtime", "-", f"failed: {type(exc).__name__}: {exc}")
        return None
    preds = bench.run(ROW_NAME, "ort-int8", peer)
    record = {"export_s": export.export_s, "quantize_s": export.quantize_s, "cache": str(export.folder),
              "cache_bytes": export.disk_bytes(), "threads": threads, "quant_scheme": QUANT_SCHEME,
              "padding": peer.last_stats.padding.overhead}
    ref_dtype = "float32" if refs.get("float32") is not None else next((d for d, r in refs.items() if r), None)
    if preds is not None and ref_dtype is not None:
        agree = compare([str(i) for i in range(len(preds))], refs[ref_dtype], preds)
        record.update(reference=ref_dtype, label_agreement=agree.agreement, num_agree=agree.num_agree,
                      max_abs_logprob_diff=agree.max_abs_logprob_diff)
        bench.log(f"ONNX Runtime int8 labels vs the {ref_dtype} reference: {100 * record['label_agreement']:.1f}% "
                  f"agree, max |Δ log-prob| {record['max_abs_logprob_diff']:.3f}")
    return record


def summary(record: dict, n: int) -> str:
    """The bench.md line under the table: fidelity against our reference, and what the export cost."""
    made = [f"{what} {record[key]:.0f} s" for what, key in (("export", "export_s"), ("quantise", "quantize_s"))
            if record.get(key) is not None]
    cost = f"made in this run ({', '.join(made)})" if made else "read from the cache"
    line = f"ONNX Runtime int8 ({record['quant_scheme']}, {record['threads']} threads): "
    if "reference" in record:
        line += (f"labels vs the {record['reference']} reference {100 * record['label_agreement']:.1f}% agree "
                 f"({record['num_agree']} of {n}), max |Δ log-prob| {record['max_abs_logprob_diff']:.3f}; ")
    return line + f"the fp32 export and its int8 form were {cost}, {record['cache_bytes'] / 2**30:.2f} GB on disk."
