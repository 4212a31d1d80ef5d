"""Ray Data backend: the job of `slimroute classify`, spread over replicas of the fast Engine.

    input files --read tasks, one per file (slimroute.io.rows.iter_rows)--> blocks of `block_rows` rows
        --ClassifierActor x replicas (model and prefix cache loaded once each)--> output records
        --> Parquet or JSONL shards in a folder, plus _slimroute_summary.json

Files are parsed by the local backend's own reader, so ids, gold labels and per-row errors are those
of `--backend local` by construction; Ray's native JSON and CSV readers fail the whole job on one row
whose type differs from the others. `classify_dataset` takes any Ray Dataset instead. See docs/ray.md.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from itertools import islice
from pathlib import Path

import psutil
import pyarrow as pa
import ray
import ray.data
from ray.data.datasource import BlockBasedFileDatasink
from ray.util.annotations import RayDeprecationWarning

from slimroute.backends.local import DEFAULT_WINDOW, JobSummary, classify_rows
from slimroute.io.records import encode_records, output_record, output_schema
from slimroute.io.rows import FORMATS, InputError, Row, iter_rows, optional_str, text_of
from slimroute.labels import Fallback
from slimroute.runtime.load import resolve

log = logging.getLogger(__name__)

# Rows per block, the unit of work and of retry. The engine sorts and buckets by length inside a block, so
# padding falls as blocks grow (~30% at 512 rows, ~7% at 2048 on the synthetic tickets); 2048 is the local
# backend's window, so both backends batch alike.
DEFAULT_BLOCK_ROWS = DEFAULT_WINDOW
ROWS_PER_FILE = 100_000  # output shard size (at least; a shard holds whole blocks)
SUMMARY_FILE = "_slimroute_summary.json"  # also marks a folder as a slimroute output
ERROR_COLUMN = "_error"  # set by the reader for a row it already rejected (e.g. not valid JSON)
ROW_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("gold", pa.string()),
                        (ERROR_COLUMN, pa.string())])
TELEMETRY_SCHEMA = pa.schema([("_replica", pa.string()), ("_gold", pa.string()),
                              ("_batch_start", pa.float64()), ("_batch_end", pa.float64()),
                              ("_load_seconds", pa.float64()), ("_rss_mb", pa.float64())])
WARMUP_TEXT = "warm-up"


# --------------------------------------------------------------------------- reading


def input_files(input_path) -> list[Path]:
    """A file, a folder (searched recursively) or a glob -> the input files, sorted."""
    text = str(input_path)
    if glob.has_magic(text):
        candidates = [Path(p) for p in sorted(glob.glob(text, recursive=True))]
    elif Path(text).is_dir():
        candidates = sorted(Path(text).rglob("*"))
    elif Path(text).is_file():
        return [Path(text)]
    else:
        raise InputError(f"input {text!r} does not exist; give a file, a folder or a glob")
    files = [p for p in candidates
             if p.is_file() and p.suffix.lower() in FORMATS and not p.name.startswith((".", "_"))]
    if not files:
        raise InputError(f"no {', '.join(FORMATS)} files in {text!r}")
    return files


def _has_column(path: Path, column: str) -> bool:
    """Whether the file has `column`, as the local reader decides it (JSONL: in its first 100 objects)."""
    try:
        next(iter(iter_rows(path, text_column=column)), None)
    except InputError:
        return False
    return True


def _id_prefixes(files: list[Path], id_column: str) -> list[str]:
    """Without an id column a row's id is its row number; with several files, prefix it by the file."""
    if len(files) == 1:
        return [""]
    root = Path(os.path.commonpath([f.parent for f in files]))
    return ["" if _has_column(f, id_column) else f"{f.relative_to(root)}:" for f in files]


def _read_files(batch: pa.Table, text_column: str, id_column: str, label_column: str | None,
                block_rows: int) -> Iterator[pa.Table]:
    for path, prefix in zip(batch["path"].to_pylist(), batch["id_prefix"].to_pylist(), strict=True):
        rows = iter_rows(path, text_column, id_column, label_column)
        while chunk := list(islice(rows, block_rows)):
            yield pa.Table.from_pylist(
                [{"id": prefix + r.id, "text": r.text, "gold": r.gold, ERROR_COLUMN: r.error} for r in chunk],
                schema=ROW_SCHEMA)


def check_inputs(files: list[Path], text_column: str = "text", id_column: str = "id",
                 label_column: str | None = None) -> list[str]:
    """Raise InputError for a file-level problem (unreadable, no text column), on the driver; return
    each file's id prefix."""
    for path in files:
        next(iter(iter_rows(path, text_column, id_column, label_column)), None)
    return _id_prefixes(files, id_column)


def _rows_dataset(files: list[Path], id_prefixes: list[str], text_column: str, id_column: str,
                  label_column: str | None, block_rows: int) -> ray.data.Dataset:
    items = [{"path": str(f), "id_prefix": p} for f, p in zip(files, id_prefixes, strict=True)]
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _read_files, batch_size=1, batch_format="pyarrow",
        fn_kwargs=dict(text_column=text_column, id_column=id_column, label_column=label_column,
                       block_rows=block_rows),
    ).repartition(target_num_rows_per_block=block_rows)  # one block per replica task, not one per file


def read_rows_dataset(input_path, text_column: str = "text", id_column: str = "id", label_column: str | None = None,
                      block_rows: int = DEFAULT_BLOCK_ROWS) -> ray.data.Dataset:
    """Rows (id, text, gold, _error) of a file, folder or glob, exactly as the local backend reads them,
    in blocks of `block_rows`; classify them with `classify_dataset(..., label_column="gold")`."""
    files = input_files(input_path)
    prefixes = check_inputs(files, text_column, id_column, label_column)
    return _rows_dataset(files, prefixes, text_column, id_column, label_column, block_rows)


def rows_of(batch: pa.Table, text_column: str, id_column: str, label_column: str | None) -> list[Row]:
    """The rows of one block, checked by the local reader's own value checks (so both backends judge a row
    alike): a missing, null, non-string or empty text, or a missing id, is a per-row error.
    (Row.index is the position in the block.)"""
    rows = []
    for i, record in enumerate(batch.to_pylist()):
        gold = optional_str(record.get(label_column)) if label_column else None
        row_id = optional_str(record.get(id_column))
        if record.get(ERROR_COLUMN):
            text, error = None, record[ERROR_COLUMN]
        else:
            text, error = text_of(record, text_column)
        if row_id is None:
            text, error = None, error or f"id column {id_column!r} is empty in this row"
        rows.append(Row(i, row_id, text, gold, error))
    return rows


# --------------------------------------------------------------------------- classifying


class ClassifierActor:
    """One replica: builds its router from the recipe (the model and the prefix cache, once), then classifies each
    block it is given (the engine still sorts and buckets by length inside the block).

    recipe: a slimroute.Recipe (or anything with its fields `model` and `threads` and a build() giving an object
    with an `engine`): the driver chose the dtype once, every replica builds with that choice."""

    def __init__(self, recipe, model_path: str, threads: int, text_column: str = "text", id_column: str = "id",
                 label_column: str | None = None, telemetry: bool = False):
        start = time.perf_counter()
        # The driver resolved (converted) the model; a node that cannot see that folder resolves its own.
        source = model_path if Path(model_path).is_dir() else recipe.model
        self.engine = replace(recipe, model=source, threads=threads).build().engine
        self.engine.classify([WARMUP_TEXT])  # first-call allocations belong to startup, not the first block
        self.load_seconds = time.perf_counter() - start
        self.labels = list(self.engine.labels)
        self.columns = (text_column, id_column, label_column)
        self.telemetry = telemetry
        self.routed = self.engine.fallback is not None  # a fallback floor: model_label follows label
        self.schema = output_schema(self.labels, routed=self.routed)
        if telemetry:
            self.schema = pa.schema(list(self.schema) + list(TELEMETRY_SCHEMA))
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: pa.Table) -> pa.Table:
        start = time.time()
        rows = rows_of(batch, *self.columns)
        records = [output_record(row, pred, self.labels, routed=self.routed)
                   for row, pred in zip(rows, classify_rows(self.engine, rows), strict=True)]
        if self.telemetry:
            rss_mb = psutil.Process().memory_info().rss / 2**20
            extra = {"_replica": self.replica, "_batch_start": start, "_batch_end": time.time(),
                     "_load_seconds": self.load_seconds, "_rss_mb": rss_mb}
            for record, row in zip(records, rows, strict=True):
                record.update(extra, _gold=row.gold)
        return pa.Table.from_pylist(records, schema=self.schema)


def classify_dataset(ds: ray.data.Dataset, recipe, *, replicas: int = 1, threads_per_replica: int = 1,
                     text_column: str = "text",
                     id_column: str = "id", label_column: str | None = None, block_rows: int = DEFAULT_BLOCK_ROWS,
                     max_restarts: int = 3, telemetry: bool = False,
                     replica_cls: type = ClassifierActor) -> ray.data.Dataset:
    """Lazily classify `ds` on `replicas` actors of `threads_per_replica` CPUs each, each built from `recipe`
    (slimroute.Recipe: the model, the task, the dtype chosen once, the engine settings).

    Rows come back in the output schema (id, label, p_<label>..., truncated, error), in no particular
    order; `telemetry` adds the _replica, _gold, _batch_start/_end, _load_seconds and _rss_mb columns.
    A replica that dies is restarted (up to `max_restarts` times) and its block retried, so each row
    comes out once. The model is resolved (a GGUF converted into the cache) once, here on the driver.
    If `ds` is read by tasks that need a CPU, leave one CPU free of replicas or they wait forever.
    """
    for name, value in (("replicas", replicas), ("threads_per_replica", threads_per_replica),
                        ("block_rows", block_rows)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    kwargs = dict(recipe=recipe, model_path=str(resolve(recipe.model)), threads=threads_per_replica,
                  text_column=text_column, id_column=id_column, label_column=label_column,
                  telemetry=telemetry)
    with warnings.catch_warnings():  # Ray 2.60 has no named parameter for max_restarts / max_task_retries
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return ds.map_batches(
            replica_cls, fn_constructor_kwargs=kwargs, batch_size=block_rows, batch_format="pyarrow",
            # one block at a time per replica: a replica that starts first cannot hoard blocks others wait for
            compute=ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1),
            num_cpus=threads_per_replica, max_restarts=max_restarts, max_task_retries=max_restarts,
        )


# --------------------------------------------------------------------------- the job


class _JsonlDatasink(BlockBasedFileDatasink):
    """JSONL shards with the bytes of the local backend's JSONL output."""

    def __init__(self, path: str, **kwargs):
        super().__init__(path, file_format="jsonl", **kwargs)

    def write_block_to_file(self, block, file) -> None:
        file.write(encode_records("jsonl", block.to_arrow().to_pylist()).encode("utf-8"))


def output_format(out_path) -> str:
    suffix = Path(out_path).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in ("", ".parquet"):
        return "parquet"
    raise ValueError(f"--out {str(out_path)!r}: the Ray backend writes Parquet or JSONL shards into a "
                     "folder; name it like out.parquet or out.jsonl")


def _prepare_output(out: Path, files: list[Path]) -> None:
    """Empty `out` if it is a previous slimroute output; refuse any other non-empty folder or a file."""
    if out.is_file():
        raise ValueError(f"--out {str(out)!r} is a file; the Ray backend writes a folder of shards")
    if any(out.resolve() in f.resolve().parents for f in files):
        raise ValueError(f"--out {str(out)!r} holds input files; choose another folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / SUMMARY_FILE).is_file():
            raise ValueError(f"--out {str(out)!r} is a non-empty folder that is not a slimroute output; "
                             "choose another folder or empty it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(json.dumps({"status": "running"}) + "\n")


def connect(ray_address: str | None = None, runtime_env: dict | None = None) -> bool:
    """Join a cluster ("auto", "ray://head:10001") or, with no address, start a local Ray with this
    machine's cores. True when this call started Ray, which the caller then shuts down."""
    if ray.is_initialized():
        if ray_address:
            log.warning("Ray is already initialised; ignoring ray_address=%r", ray_address)
        return False
    ray.init(address=ray_address, runtime_env=runtime_env)
    return True


def _check_cpus(replicas: int, threads: int, local: bool) -> None:
    cpus = ray.cluster_resources().get("CPU", 0)
    if replicas * threads > cpus:
        message = (f"{replicas} replica(s) x {threads} thread(s) need {replicas * threads} CPUs but the Ray "
                   f"cluster has {cpus:g}")
        if local:
            raise ValueError(f"{message}; lower --replicas or --threads-per-replica")
        log.warning("%s; replicas wait until the autoscaler adds nodes", message)


def summarise(result: ray.data.MaterializedDataset, labels: list[str], start: float,
              fallback: Fallback | None = None) -> dict:
    """JobSummary fields plus per-replica counts, from the telemetry columns of a classified dataset.
    `seconds` runs from the first block's start to the last block's end, so replica startup (model
    load, prefix cache, warm-up) is left out of items/s; `startup_seconds` is `start` to the first block."""
    summary = JobSummary(list(labels), fallback=fallback)
    per_replica: dict[str, dict] = {}
    first, last = math.inf, -math.inf
    for batch in result.iter_batches(batch_format="pyarrow", batch_size=None):
        for rec in batch.to_pylist():
            summary.count(rec["error"], rec["truncated"], rec["label"], rec.get("model_label"), rec["_gold"])
            replica = per_replica.setdefault(
                rec["_replica"], {"items": 0, "load_seconds": round(rec["_load_seconds"], 3), "peak_rss_mb": 0.0})
            replica["items"] += 1
            replica["peak_rss_mb"] = max(replica["peak_rss_mb"], round(rec["_rss_mb"], 1))
            first, last = min(first, rec["_batch_start"]), max(last, rec["_batch_end"])
    summary.seconds = max(0.0, last - first) if summary.num_items else 0.0
    return {**summary.to_dict(), "startup_seconds": round(first - start, 3) if summary.num_items else None,
            "per_replica": dict(sorted(per_replica.items()))}


def run_ray_job(input_path, out_path, recipe, replicas: int = 1, threads_per_replica: int | None = None,
                ray_address: str | None = None, text_column: str = "text", id_column: str = "id",
                label_column: str | None = None, block_rows: int = DEFAULT_BLOCK_ROWS,
                runtime_env: dict | None = None) -> dict:
    """Classify a file, folder or glob of CSV / JSONL / Parquet into a folder of Parquet (or, for an
    `out_path` ending in .jsonl, JSONL) shards; returns the summary, also written to the folder.

    `threads_per_replica` defaults to the cluster's CPUs divided by `replicas`. Input and output paths
    must be visible to every node (on a cluster: a shared file system). recipe: as classify_dataset's."""
    task, fallback = recipe.task, recipe.config.fallback
    if fallback is not None:
        fallback.check(task.labels)  # before Ray starts
    files = input_files(input_path)
    out, fmt = Path(out_path), output_format(out_path)
    prefixes = check_inputs(files, text_column, id_column, label_column)
    _prepare_output(out, files)
    began = time.perf_counter()
    started_ray = connect(ray_address, runtime_env)
    try:
        ray_init_seconds = time.perf_counter() - began
        cpus = ray.cluster_resources().get("CPU", 1)
        threads = threads_per_replica or max(1, int(cpus // replicas))
        _check_cpus(replicas, threads, local=ray_address is None and not os.environ.get("RAY_ADDRESS"))
        # Read everything first: read tasks need a CPU, and replicas may hold all of them once started.
        rows = _rows_dataset(files, prefixes, text_column, id_column, label_column, block_rows).materialize()
        read_seconds = time.perf_counter() - began - ray_init_seconds
        result = classify_dataset(rows, recipe, replicas=replicas, threads_per_replica=threads, label_column="gold",
                                  block_rows=block_rows, telemetry=True)
        classify_start = time.time()
        result = result.materialize()
        summary = summarise(result, list(task.labels), classify_start, fallback)
        shards = result.drop_columns(TELEMETRY_SCHEMA.names)
        if fmt == "jsonl":
            shards.write_datasink(_JsonlDatasink(str(out), min_rows_per_file=ROWS_PER_FILE))
        else:
            shards.write_parquet(str(out), min_rows_per_file=ROWS_PER_FILE)
        summary.update(backend="ray", replicas=replicas, threads_per_replica=threads, block_rows=block_rows,
                       files=len(files), format=fmt, out=str(out), ray_init_seconds=round(ray_init_seconds, 3),
                       read_seconds=round(read_seconds, 3), wall_seconds=round(time.perf_counter() - began, 3))
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    finally:
        if started_ray:
            ray.shutdown()
