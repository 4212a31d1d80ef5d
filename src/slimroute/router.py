"""The public face: `slimroute.load(...)` gives a Router, the one place a model and a task become a classifier.

    router = slimroute.load("qwen2.5-coder-0.5b", labels=["billing", "technical", "account"])
    router.classify(["I was charged twice"])          # [Prediction(label='billing', ...)], in input order
    router.verify(texts)                               # the fast path against the reference: an Agreement
    router.classify_file("tickets.jsonl", "out.jsonl") # windowed, durable, resumable (docs/jobs.md)
    router.info                                        # the dtype and why, kernels, attention, threads

The dtype is chosen once (runtime.dtypes.choose_dtype) and the model loaded once (runtime.load.load_model); the CLI,
the server, the Ray replicas, the scikit-learn estimator and the bench all build their classifiers here. A `Recipe`
is what a Router is built from: plain and picklable, so a Ray replica builds its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slimroute.accuracy.calibration import CalibrationSettings, Offsets
from slimroute.accuracy.head import Head
from slimroute.backends.local import DEFAULT_WINDOW, FileJob, JobConfig, JobSummary, job_settings
from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.reference import ReferenceClassifier
from slimroute.engine.verify import Agreement, compare
from slimroute.labels import Prediction
from slimroute.runtime.dtypes import DtypeChoice, choose_dtype
from slimroute.runtime.load import LoadedModel, load_model
from slimroute.runtime.packaged import DEFAULT_MODEL
from slimroute.task import Task


@dataclass(frozen=True)
class Recipe:
    """What a Router is built from. dtype: a choice already made (choose_dtype), so building never chooses again."""

    task: Task
    dtype: DtypeChoice
    model: str = DEFAULT_MODEL  # a packaged name, a Hugging Face repo id or folder, or a .gguf file
    config: EngineConfig = field(default_factory=EngineConfig)
    head: Head | None = None
    calibration: Offsets | None = None
    threads: int | None = None  # None: the physical cores
    device: str = "cpu"

    @classmethod
    def of(cls, model: str = DEFAULT_MODEL, task: Task | str | Path | Sequence[str] | None = None, *, dtype="auto",
           head: Head | str | Path | None = None, config: EngineConfig | None = None, threads: int | None = None,
           device: str = "cpu") -> Recipe:
        """A recipe from load()'s arguments (calibration aside), checked before anything loads: the task, the head,
        the dtype (chosen here, once) and the fallback label."""
        head = Head.load(head) if isinstance(head, (str, Path)) else head
        the_task = as_task(task, head)
        choice = dtype if isinstance(dtype, DtypeChoice) else choose_dtype(dtype, device=device)
        config = config or EngineConfig()
        if config.fallback is not None:
            config.fallback.check(head.labels if head is not None else the_task.labels)
        return cls(the_task, choice, model, config, head, None, threads, device)

    def build(self) -> Router:
        loaded = load_model(self.model, self.dtype, self.threads, self.device)
        return Router(loaded, self.task, self.config, self.head, self.calibration)


def load(model: str = DEFAULT_MODEL, task: Task | str | Path | Sequence[str] | None = None, *, dtype="auto",
         head: Head | str | Path | None = None, calibrate: str | CalibrationSettings | Offsets | None = None,
         config: EngineConfig | None = None, threads: int | None = None, device: str = "cpu") -> Router:
    """A Router: `model` loaded once in `dtype` ("auto": the fastest batch-invariant dtype for this CPU; or float32,
    bfloat16, int8, or a DtypeChoice), deciding `task`.

    task: a Task, a task file (YAML / JSON), or a list of labels; None with a head: the head's own task.
    head: a tuned head (a folder from `slimroute tune`, or a Head). calibrate: offsets, or how to make them now
    (a mode: "content-free"; or CalibrationSettings with its data for "batch" and "fitted"). config: batching and
    decision settings (EngineConfig). Raises ValueError (a bad task, a dtype this CPU cannot run: the message says
    which) and runtime.packaged.ModelNotFoundError."""
    recipe = Recipe.of(model, task, dtype=dtype, head=head, config=config, threads=threads, device=device)
    return recipe.build().calibrated(calibrate)


def as_task(task: Task | str | Path | Sequence[str] | None, head: Head | None = None) -> Task:
    if isinstance(task, Task):
        return task
    if isinstance(task, (str, Path)) and Path(task).suffix.lower() in (".yaml", ".yml", ".json"):
        return Task.from_file(task)
    if task is None:
        if head is None:
            raise ValueError("no task: give labels (a list), a Task, a task file, or a head")
        return head.task
    return Task.from_labels(task if isinstance(task, str) else list(task))


class Router:
    """A loaded model deciding one task: its fast engine, and the reference beside it (built when first asked)."""

    def __init__(self, loaded: LoadedModel, task: Task, config: EngineConfig | None = None, head: Head | None = None,
                 calibration: Offsets | None = None, engine: Engine | None = None):
        self.loaded = loaded
        self.engine = engine or Engine.from_loaded(loaded, task, config, head, calibration)
        self._reference: ReferenceClassifier | None = None

    @property
    def task(self) -> Task:
        return self.engine.task

    @property
    def labels(self) -> tuple[str, ...]:
        """The answers: the task's labels, or the head's."""
        return self.engine.labels

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def reference(self) -> ReferenceClassifier:
        """The slow, obviously-correct path, deciding with the engine's very setup (offsets, floor, head)."""
        if self._reference is None:
            self._reference = ReferenceClassifier.from_setup(self.loaded.model, self.loaded.tokenizer,
                                                             self.engine.setup)
        return self._reference

    @property
    def recipe(self) -> Recipe:
        """What builds this router again (a Ray replica does)."""
        loaded = self.loaded
        return Recipe(self.task, DtypeChoice(loaded.precision, loaded.precision_reason), loaded.name, self.config,
                      self.engine.head, self.engine.calibration, loaded.threads, str(loaded.device))

    @property
    def info(self) -> dict:
        """What runs: the model, the dtype and why, the kernels, the attention, threads and device, and the task."""
        loaded, engine = self.loaded, self.engine
        return {"model": loaded.name, "dtype": loaded.precision, "dtype_reason": loaded.precision_reason,
                "kernels": loaded.kernels, "attention": loaded.attention, "threads": loaded.threads,
                "device": str(loaded.device), "labels": list(self.labels),
                "prefix_tokens": len(engine.prompt.prefix_ids), "head": engine.head is not None,
                "calibration": engine.calibration.to_dict() if engine.calibration is not None else None}

    def classify(self, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> list[Prediction]:
        """One Prediction per text, in input order (texts must be non-empty strings)."""
        return self.engine.classify(list(texts), progress=progress)

    def verify(self, texts: Sequence[str], ids: Sequence[str] | None = None) -> Agreement:
        """The reference and the fast path on the same texts: label agreement must be 100%, log-probs equal within
        tolerance (bit for bit in int8)."""
        texts = list(texts)
        ids = [str(i) for i in range(len(texts))] if ids is None else list(ids)
        return compare(ids, self.reference.classify(texts), self.engine.classify(texts))

    def classify_file(self, input: str | Path, out: str | Path, *, text_column: str = "text", id_column: str = "id",
                      label_column: str | None = None, window: int = DEFAULT_WINDOW, limit: int | None = None,
                      resume: bool = False, overwrite: bool = False, errors: str | Path | None = None,
                      progress: Callable[[int], None] | None = None) -> JobSummary:
        """Classify a CSV / JSONL / Parquet / text file into `out` (the same formats), window by window: durable after
        each window, resumable with resume=True (docs/jobs.md). Returns the job's summary."""
        job = JobConfig(window, limit, resume, overwrite, Path(errors) if errors else None)
        columns = (text_column, id_column, label_column)
        offsets = self.engine.calibration
        settings = self.job_settings(job, columns, offsets.to_dict() if offsets is not None else None)
        file_job = FileJob(input, out, list(self.labels), settings, job, columns, raw_columns=offsets is not None,
                           fallback=self.engine.fallback)
        return file_job.run(self.engine, progress, calibration=offsets.to_dict() if offsets is not None else None)

    def job_settings(self, job: JobConfig, columns: tuple, calibration: dict | None = None,
                     reference: bool = False) -> dict:
        """What a resumed job must find unchanged (backends.local.job_settings) for this router's model and task."""
        loaded = self.loaded
        return job_settings(task=self.task, config=self.config, model=loaded.name, dtype=loaded.precision,
                            device=str(loaded.device), threads=loaded.threads, reference=reference, window=job.window,
                            columns=columns, limit=job.limit, errors=job.errors,
                            head=self.engine.head.digest if self.engine.head else None, calibration=calibration)

    def calibrated(self, calibrate: str | CalibrationSettings | Offsets | None) -> Router:
        """This router deciding with calibration offsets: given, or estimated / fitted now (CalibrationSettings;
        a mode alone for content-free). None or "none": this router."""
        if calibrate is None or isinstance(calibrate, Offsets):
            return self.with_calibration(calibrate) if calibrate is not None else self
        settings = CalibrationSettings(calibrate) if isinstance(calibrate, str) else calibrate
        if not settings.on:
            return self
        settings.check_data(self.labels, self.engine.head)
        offsets = settings.offsets(self.engine, self.labels)
        if offsets is None:
            raise ValueError(f"{settings.mode} calibration needs texts to estimate its offsets from: "
                             f"CalibrationSettings({settings.mode!r}, data='texts.csv')")
        return self.with_calibration(offsets)

    def with_calibration(self, offsets: Offsets | None) -> Router:
        """The same model deciding with `offsets` (None: none)."""
        return Router(self.loaded, self.task, engine=self.engine.with_calibration(offsets))

    def with_task(self, task: Task | str | Path | Sequence[str], head: Head | None = None) -> Router:
        """The same model (loaded once) deciding another task, with the same settings."""
        return Router(self.loaded, as_task(task, head), self.config, head)

    def with_config(self, config: EngineConfig) -> Router:
        """The same model and task with other batching / decision settings."""
        return Router(self.loaded, self.task, config, self.engine.head, self.engine.calibration)

    def __repr__(self) -> str:
        return f"Router({self.loaded.name!r}, {self.loaded.precision}, labels={list(self.labels)})"
