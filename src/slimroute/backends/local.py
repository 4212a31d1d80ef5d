"""The local backend: a classifier over a file's rows, in this process. Bad rows become per-row errors, results keep
input order.

`FileJob` is one `slimroute classify` job: its rows streamed from a file (or spooled standard input), its output
(io.durable.DurableOutput, or io.stdio.StreamOutput for standard output) decided before any model loads (a fresh job,
a resumed one, or a refusal). `run_job` classifies the rows in windows of `window` rows: each window is classified
(sorted and bucketed by length inside the engine), then committed in input order, so memory is bounded by the window,
not by the input. See docs/jobs.md for what is durable when.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import torch
import transformers

from slimroute.accuracy.calibration import estimate_offsets
from slimroute.accuracy.metrics import Metrics
from slimroute.io.durable import DurableOutput, input_fingerprint
from slimroute.io.rows import Row, count_rows, iter_rows
from slimroute.io.stdio import STDIO, StreamOutput
from slimroute.labels import Fallback, Prediction

DEFAULT_WINDOW = 2048


@dataclass(frozen=True)
class JobConfig:
    window: int = DEFAULT_WINDOW  # rows classified and committed together
    limit: int | None = None  # only the first N rows (None or 0: all)
    resume: bool = False  # continue after the last committed window
    overwrite: bool = False  # replace an existing output (and drop an unfinished job's progress)
    errors: Path | None = None  # failed rows go to this JSONL file instead of the output

    def __post_init__(self):
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0, got {self.limit!r}")
        if self.resume and self.overwrite:
            raise ValueError("give either --resume or --overwrite, not both")


def windows(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    """Consecutive lists of `size` rows (the last may be shorter); never reads further ahead."""
    it = iter(rows)
    while batch := list(islice(it, size)):
        yield batch


def run_job(classifier, rows: Iterable[Row], output, summary: JobSummary, window: int = DEFAULT_WINDOW,
            progress: Callable[[int], None] | None = None, batch_calibration: bool = False) -> JobSummary:
    """Classify `rows` into `output` (a started DurableOutput) window by window, skipping the rows it
    has already committed, then finish it. An exception leaves every committed window in place.

    batch_calibration: unless the output's record already holds offsets, estimate batch-calibration offsets
    from the first window with a scored row (its rows' mean label log-probs), decide that window again with
    them and keep them fixed for every later window; they are committed with that window, so a resumed
    job (which starts from the record's offsets) decides exactly as an uninterrupted one."""
    for batch in windows(islice(rows, output.record.rows_done, None), window):
        preds = classify_rows(classifier, batch, progress)
        if batch_calibration and output.record.calibration is None and any(p.token_logprobs for p in preds):
            first = output.record.rows_done
            offsets = estimate_offsets("batch", preds, classifier.labels,
                                       f"the run's first window, rows {first}-{first + len(batch) - 1}")
            classifier = classifier.with_calibration(offsets)
            preds = classifier.redecide([row.text for row in batch], preds)
            output.record.calibration = offsets.to_dict()
        summary.add(batch, preds)
        output.commit(batch, preds, summary.state())
    output.finish()
    return summary


def job_settings(*, task, config, model: str, dtype: str, device: str, threads: int, reference: bool,
                 window: int, columns: tuple, limit: int | None, errors: Path | None,
                 server: str | None = None, server_task: str | None = None, head: str | None = None,
                 calibration: dict | None = None, served: dict | None = None) -> dict:
    """Everything that can change the output's bytes; a job resumes only when these are unchanged
    (with --server the answers come from that server and task, so they count too, and served: what the server
    says decides them, RemoteClassifier.answer_settings; with --head, its digest; calibration: the mode and what its
    offsets come from, e.g. the calibration data's fingerprint)."""
    parts = [task.instructions, [[ex.text, ex.label] for ex in task.examples]]
    prompt = json.dumps(parts + ([[list(pair) for pair in task.descriptions]] if task.descriptions else []))
    if Path(model).expanduser().exists():  # a folder or .gguf file, however it was spelled
        model = str(Path(model).expanduser().resolve())
    return {
        "model": model, "dtype": dtype, "device": device, "threads": threads, "reference": reference,
        "labels": list(task.labels), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()[:16],
        **({"truncate_tokens": task.truncate_tokens} if task.truncate_tokens else {}),  # absent: older records resume
        **{f"engine.{key}": value for key, value in asdict(config).items()},
        "window": window, "columns": list(columns), "limit": limit or None,
        "errors": str(Path(errors).resolve()) if errors else None,
        "server": server.rstrip("/") if server else None, "server_task": server_task if server else None,
        **({"calibration": calibration} if calibration else {}),  # absent when off: older records still resume
        "torch": torch.__version__, "transformers": transformers.__version__,
        **({"head": head} if head else {}),
        **({"served": served} if server and served else {}),
    }


def classify_rows(classifier, rows: list[Row],
                  progress: Callable[[int], None] | None = None) -> list[Prediction]:
    """One prediction per row, in order. A row with an error, or one the model fails on, gets an error
    prediction; every other row is still classified."""
    preds = [Prediction.failed(row.error) if row.error else None for row in rows]
    good = [i for i, row in enumerate(rows) if row.error is None]
    if progress and len(good) < len(rows):
        progress(len(rows) - len(good))
    try:
        results = classifier.classify([rows[i].text for i in good], progress=progress)
    except Exception:  # isolate the failing item(s); the others keep their answers
        results = []
        for i in good:
            try:
                results.extend(classifier.classify([rows[i].text]))
            except Exception as exc:
                results.append(Prediction.failed(f"model failed on this row: {type(exc).__name__}: {exc}"))
    for i, pred in zip(good, results, strict=True):
        preds[i] = pred
    return preds


@dataclass
class JobSummary:
    labels: list[str]
    num_items: int = 0
    num_errors: int = 0
    num_truncated: int = 0
    seconds: float = 0.0  # this run only
    confusion: Counter = field(default_factory=Counter)  # (gold, predicted) -> count
    padding_overhead: float | None = None
    num_resumed: int = 0  # rows committed by earlier, interrupted runs of the same job
    dtype: str | None = None  # what --dtype resolved to and why, e.g. "int8 (AVX2 without native BF16)"
    fallback: Fallback | None = None  # the floor under the answers, if any
    num_fallback: int = 0  # rows routed to the fallback label

    @property
    def items_per_s(self) -> float:
        """Rows per second in this run."""
        return (self.num_items - self.num_resumed) / self.seconds if self.seconds else 0.0

    def state(self) -> dict:
        """The counts, for the progress record (so a resumed job's summary covers every row)."""
        return {"items": self.num_items, "errors": self.num_errors, "truncated": self.num_truncated,
                "fallback": self.num_fallback,
                "confusion": [[g, p, n] for (g, p), n in sorted(self.confusion.items())]}

    @classmethod
    def from_state(cls, labels: list[str], state: dict, fallback: Fallback | None = None) -> JobSummary:
        summary = cls(list(labels), num_items=state.get("items", 0), num_errors=state.get("errors", 0),
                      num_truncated=state.get("truncated", 0), num_resumed=state.get("items", 0),
                      fallback=fallback, num_fallback=state.get("fallback", 0))
        summary.confusion.update({(g, p): n for g, p, n in state.get("confusion", [])})
        return summary

    @property
    def num_gold(self) -> int:
        return sum(self.confusion.values())

    def metrics(self) -> Metrics:
        return Metrics.from_counts(self.confusion, self.labels)

    @property
    def accuracy(self) -> float | None:
        return self.metrics().accuracy

    def answered_metrics(self) -> Metrics | None:
        """With a fallback floor: the metrics of the rows it did not route to its label."""
        return self.metrics().without_prediction(self.fallback.label) if self.fallback is not None else None

    def add(self, rows: Iterable[Row], preds: Iterable[Prediction]) -> None:
        for row, pred in zip(rows, preds, strict=True):
            self.count(pred.error, pred.truncated, pred.label, pred.model_label, row.gold)

    def count(self, error: str | None, truncated: bool, label: str | None, model_label: str | None,
              gold: str | None) -> None:
        """One row, from a Prediction or a written record: an error row is counted, not scored; a row the floor
        routed (its label is not the model's: model_label None means not recorded, so not routed) is counted."""
        self.num_items += 1
        if error:
            self.num_errors += 1
            return
        self.num_truncated += int(truncated)
        self.num_fallback += int(model_label not in (None, label))
        if gold is not None:
            self.confusion[(gold, label)] += 1

    def _fallback_dict(self) -> dict:
        answered = self.answered_metrics()
        return {"fallback": {"min_prob": self.fallback.min_prob, "label": self.fallback.label,
                             "rows": self.num_fallback, "answered_accuracy": answered.accuracy,
                             "answered_gold_rows": answered.num_items}}

    def to_dict(self) -> dict:
        return {
            "items": self.num_items,
            "dtype": self.dtype,
            "errors": self.num_errors,
            "truncated": self.num_truncated,
            "resumed": self.num_resumed,
            "seconds": round(self.seconds, 3),
            "items_per_s": round(self.items_per_s, 3),
            "accuracy": self.accuracy,
            "macro_f1": self.metrics().macro_f1_except(self.fallback.label if self.fallback else None),
            "padding_overhead": self.padding_overhead,
            **(self._fallback_dict() if self.fallback is not None else {}),
            "confusion": [[g, p, n] for (g, p), n in sorted(self.confusion.items())],
        }


class FileJob:
    """One job from a file into a file (or standard output), set up before any model loads: the rows (a file-level
    problem raises io.rows.InputError here), the output (a fresh job, a resumed one, or an OutputError saying why
    not; nothing is touched yet), and the summary so far (a resumed job's counts)."""

    def __init__(self, input: str | Path, out: str | Path, answers: list[str], settings: dict, job: JobConfig,
                 columns: tuple[str, str, str | None] = ("text", "id", None), raw_columns: bool = False,
                 fallback: Fallback | None = None, routed_column: bool | None = None):
        """answers: the output's labels; settings: job_settings (what a resume must find unchanged); columns: (text,
        id, label); raw_columns: calibration is on (raw_p_<label> columns); fallback: the floor (a model_label
        column, unless routed_column says otherwise)."""
        self.input, self.job = Path(input), job
        self.rows = iter_rows(input, *columns)
        routed = fallback is not None if routed_column is None else routed_column
        fingerprint = input_fingerprint(input)
        if str(out) == STDIO:
            self.output = StreamOutput(answers, fingerprint, settings, resume=job.resume, errors=job.errors,
                                       raw_columns=raw_columns, routed_column=routed)
        else:
            self.output = DurableOutput.prepare(out, answers, fingerprint, settings, resume=job.resume,
                                                overwrite=job.overwrite, errors=job.errors, raw_columns=raw_columns,
                                                routed_column=routed)
        self.summary = JobSummary.from_state(answers, self.output.record.summary, fallback)
        total = count_rows(input)
        self.total = min(total, job.limit) if total is not None and job.limit else total

    @property
    def stored_calibration(self) -> dict | None:
        """A resumed job's calibration offsets (Offsets.to_dict()), or None."""
        return self.output.record.calibration

    def run(self, classifier, progress: Callable[[int], None] | None = None, batch_calibration: bool = False,
            calibration: dict | None = None) -> JobSummary:
        """Classify every row not yet committed with `classifier` and finish the output; the summary covers every
        row of the job (resumed ones too). calibration: the offsets in use, recorded with the output
        (batch_calibration: estimated from the first window instead, see run_job)."""
        self.output.record.calibration = calibration
        rows = islice(self.rows, self.job.limit) if self.job.limit else self.rows
        start = time.perf_counter()
        with self.output:
            run_job(classifier, rows, self.output, self.summary, self.job.window, progress, batch_calibration)
        self.summary.seconds = time.perf_counter() - start
        stats = getattr(classifier, "stats", None)
        if stats is not None:
            self.summary.padding_overhead = stats.padding.overhead
        return self.summary
