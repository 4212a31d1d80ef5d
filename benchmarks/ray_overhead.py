"""Overhead of the Ray backend on one machine: items/s of `--backend ray --replicas R
--threads-per-replica T` against the local Engine with R x T threads, on the same input in the same run.

    flock /tmp/slimroute-heavy.lock python benchmarks/ray_overhead.py --threads 2 --json bench-results/ray.jsonl

Local: load the model (reported as startup), warm up on 8 items, then time `classify_rows` over every
row, which is what `slimroute classify` does. Ray: `run_ray_job` with R replicas; its items/s spans the
first block's start to the last block's end, and its startup (Ray, reading, replica spawn, model load,
warm-up) is reported separately. `--repeats` alternates the two. Prints one JSON record per round
and a table; the labels of the two runs are compared id by id.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def run_local(path: Path, task, model: str, threads: int) -> tuple[dict, dict[str, str]]:
    import slimroute
    from slimroute.backends.local import classify_rows
    from slimroute.io.rows import read_rows

    rows = read_rows(path)
    start = time.perf_counter()
    engine = slimroute.load(model, task, threads=threads).engine
    engine.classify([row.text for row in rows[:8] if row.text])
    load_seconds = time.perf_counter() - start
    start = time.perf_counter()
    preds = classify_rows(engine, rows)
    seconds = time.perf_counter() - start
    record = {"items": len(rows), "seconds": round(seconds, 2), "items_per_s": round(len(rows) / seconds, 2),
              "startup_seconds": round(load_seconds, 2),
              "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1)}
    return record, {row.id: pred.label for row, pred in zip(rows, preds, strict=True)}


def run_ray(path: Path, task, model: str, replicas: int, threads: int, block_rows: int,
            out: Path) -> tuple[dict, dict[str, str]]:
    import pyarrow.parquet as pq

    import slimroute
    from slimroute.backends.ray import run_ray_job

    summary = run_ray_job(path, out, slimroute.Recipe.of(model, task), replicas=replicas,
                          threads_per_replica=threads, block_rows=block_rows)
    per_replica = list(summary["per_replica"].values())
    record = {"items": summary["items"], "seconds": summary["seconds"], "items_per_s": summary["items_per_s"],
              "startup_seconds": summary["startup_seconds"],
              "replica_load_seconds": max(r["load_seconds"] for r in per_replica),
              "replica_items": [r["items"] for r in per_replica],
              "ray_init_seconds": summary["ray_init_seconds"], "read_seconds": summary["read_seconds"],
              "wall_seconds": summary["wall_seconds"],
              "wall_items_per_s": round(summary["items"] / summary["wall_seconds"], 2),
              "rss_mb": max(r["peak_rss_mb"] for r in per_replica)}
    table = pq.read_table(out, columns=["id", "label"]).to_pydict()
    return record, dict(zip(table["id"], table["label"], strict=True))


def versions() -> dict:
    import ray
    import torch
    import transformers

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"torch": torch.__version__, "transformers": transformers.__version__, "ray": ray.__version__,
            "python": sys.version.split()[0], "cpus": psutil.cpu_count(), "git_sha": sha.stdout.strip() or None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, default=ROOT / "data" / "tickets-600.jsonl")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--labels", default="billing,technical,account")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="Threads per replica.")
    parser.add_argument("--block-rows", type=int, default=2048, help="Rows per Ray block (the backend's default).")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="Also append the records to this JSONL file.")
    args = parser.parse_args()

    from slimroute.runtime.load import resolve
    from slimroute.task import Task

    task = Task.from_labels(args.labels)
    resolve(args.model)  # convert once, outside both timings
    records = []
    with tempfile.TemporaryDirectory(prefix="ray-overhead-") as tmp:
        for round_ in range(args.repeats):
            load_before = os.getloadavg()[0]
            local, local_labels = run_local(args.input, task, args.model, args.replicas * args.threads)
            gc.collect()
            ray_, ray_labels = run_ray(args.input, task, args.model, args.replicas, args.threads, args.block_rows,
                                       Path(tmp) / f"out-{round_}.parquet")
            agree = sum(ray_labels.get(key) == label for key, label in local_labels.items())
            record = {"benchmark": "ray_overhead", "round": round_, "input": args.input.name, "model": args.model,
                      "replicas": args.replicas, "threads": args.threads, "block_rows": args.block_rows,
                      "local": local, "ray": ray_,
                      "ratio": round(ray_["items_per_s"] / local["items_per_s"], 3),
                      "labels_agree": f"{agree}/{len(local_labels)}",
                      # other work on the machine skews both runs (Ray's workers run at nice 15)
                      "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "versions": versions()}
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"\n{'round':>5} {'local it/s':>10} {'ray it/s':>9} {'ratio':>6} {'local start s':>13} "
          f"{'ray start s':>11} {'ray wall s':>10} {'local MiB':>9} {'replica MiB':>11} labels")
    for r in records:
        loc, ray_ = r["local"], r["ray"]
        print(f"{r['round']:>5} {loc['items_per_s']:>10.2f} {ray_['items_per_s']:>9.2f} {r['ratio']:>6.1%} "
              f"{loc['startup_seconds']:>13.1f} {ray_['startup_seconds']:>11.1f} {ray_['wall_seconds']:>10.1f} "
              f"{loc['rss_mb']:>9.0f} {ray_['rss_mb']:>11.0f} {r['labels_agree']}")


if __name__ == "__main__":
    main()
