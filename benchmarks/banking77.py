"""BANKING77 accuracy of a tuned head, and what the head costs in items/s against plain zero-shot.

Tunes heads (tune.py: the engine's final hidden states and, by cross-validation, the mean of a middle layer's
output; cross-validated logistic regression or shrinkage LDA) on
`split=train` rows of data/banking77/train.csv and evaluates them on the held-out `split=valid` rows
(1,001), once per --per-intent size: the first N rows of each intent in file order (every intent has at
least 32 train rows, so N <= 32 is balanced; 0: every train row). Then times `Engine.classify` with the
largest size's head against plain zero-shot label scoring (the same 77-label task) on the first
--speed-rows valid rows, and checks the classify path gives the answers of the head on the cached features.

Features are cached under --out (text -> features, one file per model identity and task), so a rerun only
extracts rows it has not seen and refits.
Prints a Markdown table and writes one JSON record (command, git sha, CPU, threads, versions).

    nice -n 10 python benchmarks/banking77.py --per-intent 8 32 0 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shlex
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from slimroute.accuracy.head import Head
from slimroute.accuracy.tune import TuneConfig, fit_tuned, option_columns, parse_layer
from slimroute.bench.speed import machine_info
from slimroute.engine.fast import Engine
from slimroute.router import Router, load
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


def first_per_label(labels: list[str], n: int) -> list[int]:
    """Indices of the first n rows of each label in file order (n = 0: all rows), listed round by round
    (every label's 1st row, then every label's 2nd, ...), so that a smaller n picks a prefix."""
    seen: Counter = Counter()
    rounds: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        if not n or seen[label] < n:
            rounds.setdefault(seen[label], []).append(i)
            seen[label] += 1
    return [i for k in sorted(rounds) for i in rounds[k]]


def cached_features(engine: Engine, texts: list[str], folder: Path, log, with_mean: bool, layers: tuple[int, ...],
                    chunk: int = 256) -> tuple[torch.Tensor, float | None]:
    """(N, H) features and the extraction rate in items/s (None when every row came from the cache).

    The cache (one file per model identity and task) maps text -> features and is saved after every chunk,
    so an interrupted run, or a later one with more rows per intent, only extracts what is missing."""
    key = (json.dumps(identity(engine.model, engine.tokenizer, engine.task)) + ("+mean" if with_mean else "")
           + (f"+layers{list(layers)}" if layers else ""))
    path = folder / f"features-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    cache: dict[str, torch.Tensor] = torch.load(path) if path.is_file() else {}
    missing = list(dict.fromkeys(t for t in texts if t not in cache))
    log(f"{len(texts) - len(missing)} of {len(texts)} rows' features from {path}")
    start, rate = time.perf_counter(), None
    for i in range(0, len(missing), chunk):
        part = missing[i: i + chunk]
        states = "last+mean" if with_mean else "last"
        cache.update(zip(part, engine.features(part, states=states, layers=layers), strict=True))
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(cache, path)
        rate = (i + len(part)) / (time.perf_counter() - start)
        log(f"  {i + len(part)}/{len(missing)} rows extracted, {rate:.2f} items/s")
    return torch.stack([cache[t] for t in texts]), rate


def head_columns(features: torch.Tensor, head: Head, layers: tuple[int, ...], hidden: int) -> torch.Tensor:
    """The cached features (final states, then the means of every extracted layer) cut to the head's own."""
    width = features.shape[1] - hidden * len(layers)
    return features[:, torch.from_numpy(option_columns(features.shape[1], width, hidden, list(layers), head.layers))]


def evaluate(head: Head, features: torch.Tensor, gold: list[str]) -> dict:
    from sklearn.metrics import accuracy_score, f1_score

    predicted = [head.labels[j] for j in head.logprobs(features).argmax(dim=1).tolist()]
    return {"accuracy": float(accuracy_score(gold, predicted)),
            "macro_f1": float(f1_score(gold, predicted, average="macro")), "predicted": predicted}


def timed(engine: Engine, texts: list[str]) -> tuple[list, float]:
    engine.classify(texts[:8])  # warm-up: first-call allocations and kernel choices
    start = time.perf_counter()
    preds = engine.classify(texts)
    return preds, len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--per-intent", type=int, nargs="+", default=[8, 0],
                        help="one row per size: train rows per intent, at most (0: all 9,002 train rows)")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--states", choices=["last", "last+mean"], default="last+mean",
                        help="hidden states as features, as `slimroute tune --states`")
    parser.add_argument("--classifier", choices=["auto", "logistic", "lda"], default="auto")
    parser.add_argument("--layer", default="auto", help="as `slimroute tune --layer`: auto, none or a layer number")
    parser.add_argument("--speed-rows", type=int, default=64, help="valid rows timed with and without the head")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "banking77")
    args = parser.parse_args()
    command = shlex.join(["python", "benchmarks/banking77.py", *sys.argv[1:]])

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    splits = read_split(DATA)
    labels = sorted({label for _, label in splits["train"]})
    largest = 0 if 0 in args.per_intent else max(args.per_intent)
    train = [splits["train"][i] for i in first_per_label([label for _, label in splits["train"]], largest)]
    valid = splits["valid"]
    task = Task(tuple(labels), INSTRUCTIONS)
    router = load(args.model, task, dtype=args.dtype, threads=args.threads)
    loaded, engine = router.loaded, router.engine
    meta = {"identity": identity(loaded.model, loaded.tokenizer, task), "model": args.model,
            "task": {"labels": labels, "instructions": INSTRUCTIONS}}
    log(f"{args.model} {args.dtype}, {loaded.threads} threads; prefix {len(engine.prompt.prefix_ids)} tokens; "
        f"{len(train)} train rows, {len(valid)} valid rows")
    with_mean = args.states == "last+mean"
    base = TuneConfig(with_mean=with_mean, classifier=args.classifier, layer=parse_layer(args.layer))
    options = base.layer_options(int(loaded.model.config.num_hidden_layers))
    layers = tuple(sorted({k for option in options for k in option}))
    train_x, train_rate = cached_features(engine, [t for t, _ in train], args.out, log, with_mean, layers)
    valid_x, valid_rate = cached_features(engine, [t for t, _ in valid], args.out, log, with_mean, layers)
    valid_gold = [label for _, label in valid]

    rows, heads = [], {}
    index = {label: j for j, label in enumerate(labels)}
    train_y = np.array([index[label] for _, label in train])
    sizes = sorted(args.per_intent, key=lambda n: n or len(train))
    settings = [(f"up to {n} per intent" if n else "all train rows", first_per_label([lb for _, lb in train], n))
                for n in sizes]
    for name, keep in settings:
        x, y = train_x[keep].numpy(), train_y[keep]
        start = time.perf_counter()
        config = replace(base, folds=min(args.folds, min(np.bincount(y))))
        tensors, cv = fit_tuned(x, y, config, options, int(loaded.model.config.hidden_size))
        fit_s = time.perf_counter() - start
        head = Head(tuple(labels), **tensors, features=config.features, meta=meta, layers=cv.layers)
        heads[name] = head
        result = evaluate(head, head_columns(valid_x, head, layers, int(loaded.model.config.hidden_size)), valid_gold)
        rows.append({"train": name, "train_rows": len(y), "cv_accuracy": cv.accuracy, "cv_macro_f1": cv.macro_f1,
                     "classifier": cv.chosen, "cv_scores": cv.scores, "fit_s": round(fit_s, 1),
                     "layers": list(cv.layers), "layer_cv_scores": cv.layer_scores,
                     "valid_accuracy": result["accuracy"],
                     "valid_macro_f1": result["macro_f1"]})
        log(f"{name}: valid accuracy {100 * result['accuracy']:.1f}%, macro-F1 {100 * result['macro_f1']:.1f}%")

    last = heads[settings[-1][0]]
    speed = measure_speed(router, last, valid[: args.speed_rows],
                          head_columns(valid_x, last, layers, int(loaded.model.config.hidden_size)))
    record = {"command": command, "machine": machine_info(loaded.threads), "model": args.model,
              "dtype": args.dtype, "instructions": INSTRUCTIONS, "features": config.features,
              "valid_rows": len(valid), "rows": rows,
              "speed": speed, "feature_extraction_items_per_s": {"train": train_rate, "valid": valid_rate}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "banking77.json").write_text(json.dumps(record, indent=2) + "\n")
    print(markdown(record))


def measure_speed(zero_shot: Router, head: Head, rows: list, valid_x: torch.Tensor) -> dict:
    """Items/s of classify with the head vs plain zero-shot (same rows, same task), and whether the classify
    path gives the answers of the head applied to the cached features."""
    if not rows:
        return {}
    texts, gold = [t for t, _ in rows], [label for _, label in rows]
    head_preds, head_rate = timed(zero_shot.with_task(zero_shot.task, head).engine, texts)
    zero_preds, zero_rate = timed(zero_shot.engine, texts)
    expected = evaluate(head, valid_x[: len(texts)], gold)["predicted"]
    return {"rows": len(texts), "head_items_per_s": head_rate, "zero_shot_items_per_s": zero_rate,
            "head_vs_zero_shot": head_rate / zero_rate,
            "zero_shot_accuracy": sum(p.label == g for p, g in zip(zero_preds, gold, strict=True)) / len(texts),
            "classify_equals_features": sum(p.label == e for p, e in zip(head_preds, expected, strict=True))}


def markdown(record: dict) -> str:
    m, s = record["machine"], record["speed"]
    lines = [f"`{record['command']}` — {record['model']} {record['dtype']}, {m['cpu']}, {m['threads']} threads, "
             f"git {m['git_sha']}, {m['date']}; evaluated on the {record['valid_rows']} held-out `split=valid` rows",
             "", "| head tuned on | train rows | features | classifier (by CV) | CV accuracy | valid accuracy | "
             "valid macro-F1 |", "|---|---:|---|---|---:|---:|---:|"]
    for r in record["rows"]:
        layer = f" + mean of layer {', '.join(map(str, r['layers']))}" if r["layers"] else ""
        lines.append(f"| {r['train']} | {r['train_rows']} | {record['features']}{layer} | {r['classifier']} | "
                     f"{100 * r['cv_accuracy']:.1f}% | "
                     f"{100 * r['valid_accuracy']:.1f}% | {100 * r['valid_macro_f1']:.1f}% |")
    if not s:
        return "\n".join(lines)
    lines += ["", f"items/s on the first {s['rows']} valid rows: classify --head {s['head_items_per_s']:.2f}, "
              f"plain zero-shot (77 labels) {s['zero_shot_items_per_s']:.2f} "
              f"(ratio {s['head_vs_zero_shot']:.2f}; zero-shot accuracy there {100 * s['zero_shot_accuracy']:.0f}%); "
              f"classify --head agrees with the head on the features on {s['classify_equals_features']}/{s['rows']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
