"""`slimroute bench --accuracy`: how often the router is right on the sample tickets, per accuracy option.

Rows, per prompt (zero-shot; with label descriptions; few-shot examples read from a file): the plain
decision, then each calibration mode (content-free, batch, fitted). Then two heads on the zero-shot prompt:
one built from the label descriptions alone (tune.description_head), one tuned on the labelled tickets that
the fitted calibration uses (tune.tune_head); their setup time is building or tuning the head. Each row gives
accuracy, macro-F1 and items/s, and checks the fast path against the reference on the first `check` tickets (label
agreement with the row's offsets applied to both paths; max |Δ log-prob| of the model's log-probs).

A calibration row reuses its prompt's timed forward pass: calibration only re-decides over label
log-probs the engine has already computed, so its items/s adds the measured re-decision time, and the
one-off cost of estimating or fitting the offsets is its own column. Batch offsets are the 600
tickets' means (what `classify --calibrate batch` does with its 2048-row first window). The labelled
rows for fitted offsets and the few-shot examples are other synthetic tickets (seed 1, none among the
evaluated ones), read through the same file readers as `--calibration-data` and `--examples`.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slimroute.accuracy.calibration import content_free_offsets, estimate_offsets, fit_offsets
from slimroute.accuracy.examples import read_examples
from slimroute.accuracy.metrics import Metrics, floor_points
from slimroute.accuracy.tune import TuneConfig, description_head, tune_head
from slimroute.bench.speed import machine_info
from slimroute.config import EngineConfig
from slimroute.engine.verify import compare
from slimroute.io.records import write_records
from slimroute.io.rows import read_labelled
from slimroute.io.synth import CLASSES, synthetic_tickets
from slimroute.labels import redecide
from slimroute.router import load
from slimroute.task import Task

# The same descriptions as data/tickets-task.yaml (a test keeps them equal).
DESCRIPTIONS = {
    "billing": 'questions about money: charges, payments, refunds, invoices, prices, plans, discounts, the card on '
               'file (e.g. "I was charged twice", "where is my refund?")',
    "technical": 'the product not working: errors, crashes, bugs, slow or blank pages, sync, upload, install or API '
                 'problems (e.g. "the app crashes when I open it", "I get error 500")',
    "account": 'access to the account: signing in, passwords, two-factor codes, locked accounts, email or username '
               'changes, profile, team members, deleting the account (e.g. "I can\'t log in", "please delete my '
               'account")',
}
MODES = ("content-free", "batch", "fitted")
FLOOR_COVERAGES = (0.9, 0.8)  # each row's floors (metrics.floor_points): route the least sure 10% / 20% to a person


@dataclass
class AccuracyRow:
    name: str
    accuracy: float
    macro_f1: float
    items_per_s: float
    prefix_tokens: int
    agreement: float  # fast == reference on the first `check` tickets, with the row's offsets
    max_dlogprob: float
    setup_s: float = 0.0  # one-off: estimating or fitting the offsets
    floors: list[dict] = field(default_factory=list)  # per FLOOR_COVERAGES: its "target" and a FloorPoint.to_dict()


def labelled_tickets(n: int, exclude: set[str], seed: int = 1) -> list[dict]:
    """Synthetic tickets of another seed whose texts are not among `exclude`, balanced over the classes."""
    pool = [t for t in synthetic_tickets(4 * n + 30, seed) if t["text"] not in exclude]
    per_label = {label: [t for t in pool if t["label"] == label][: n // len(CLASSES)] for label in CLASSES}
    return [per_label[label][k] for k in range(n // len(CLASSES)) for label in CLASSES]


def score_row(name, preds, refs, golds, labels, seconds, prefix_tokens, setup_s=0.0) -> AccuracyRow:
    cmp = compare([str(i) for i in range(len(refs))], refs, preds[: len(refs)])
    metrics = Metrics.from_pairs(golds, [p.label for p in preds], labels)
    confidences, correct = [p.probs[p.label] for p in preds], [p.label == g for p, g in zip(preds, golds, strict=True)]
    floors = [{"target": c, **floor_points(confidences, correct, (c,))[0].to_dict()} for c in FLOOR_COVERAGES]
    return AccuracyRow(name, metrics.accuracy, metrics.macro_f1, len(preds) / seconds, prefix_tokens, cmp.agreement,
                       cmp.max_abs_logprob_diff, setup_s, floors)


def run_accuracy_bench(n=600, model="qwen2.5-coder-0.5b", dtype="auto", threads=None, batch_size=32,
                       max_batch_tokens=512, shots=2, calibration_rows=90, check=50, log=print) -> dict:
    tickets = synthetic_tickets(600, 0)[:n]
    texts, golds = [t["text"] for t in tickets], [t["label"] for t in tickets]
    config = EngineConfig(batch_size=batch_size, max_batch_tokens=max_batch_tokens or None)
    labels = tuple(CLASSES)
    zero_shot = load(model, Task(labels), dtype=dtype, threads=threads, config=config)
    with tempfile.TemporaryDirectory() as tmp:
        extra = labelled_tickets(calibration_rows + 3 * shots, set(texts))
        examples_file, data_file = Path(tmp) / "examples.jsonl", Path(tmp) / "labelled.jsonl"
        write_records(examples_file, extra[:3 * shots])
        write_records(data_file, extra[3 * shots:])
        examples = read_examples(examples_file, labels, shots)
        labelled = read_labelled(data_file, what="calibration data")
    prompts = {
        "zero-shot": Task(labels),
        "descriptions": Task(labels, descriptions=DESCRIPTIONS),
        f"few-shot from a file ({shots} per label)": Task(labels, examples=examples),
        f"descriptions + few-shot ({shots} per label)": Task(labels, examples=examples, descriptions=DESCRIPTIONS),
    }
    rows: list[AccuracyRow] = []

    def add(row: AccuracyRow):
        rows.append(row)
        log(f"{row.name:60s} acc {100 * row.accuracy:5.1f}%  macro-F1 {row.macro_f1:.3f}  "
            f"90/80% answered {_floors(asdict(row))}  {row.items_per_s:6.2f} items/s  "
            f"agree {100 * row.agreement:.1f}%  max|Δ| {row.max_dlogprob:.1e}")

    for name, task in prompts.items():
        router = zero_shot.with_task(task)
        engine = router.engine
        engine.classify(texts[:4])  # warm-up, excluded from the timing
        start = time.perf_counter()
        fast = engine.classify(texts)
        seconds = time.perf_counter() - start
        ref = router.reference.classify(texts[:check])
        prefix = len(engine.prompt.prefix_ids)
        add(score_row(name, fast, ref, golds, labels, seconds, prefix))
        for mode in MODES:
            start = time.perf_counter()
            if mode == "content-free":
                offsets = content_free_offsets(engine, labels)
            elif mode == "batch":
                offsets = estimate_offsets("batch", fast, labels, f"the {len(texts)} tickets")
            else:
                offsets = fit_offsets(engine.classify([t for t, _ in labelled]), [g for _, g in labelled], labels,
                                      f"{len(labelled)} labelled tickets (seed 1)")
            setup_s = time.perf_counter() - start if mode != "batch" else 0.0
            start = time.perf_counter()
            calibrated = [redecide(p, labels, engine.label_ids, config.decision, offsets.values) for p in fast]
            redecide_s = time.perf_counter() - start
            refs = [redecide(p, labels, engine.label_ids, config.decision, offsets.values) for p in ref]
            add(score_row(f"{name} + {mode} calibration", calibrated, refs, golds, labels, seconds + redecide_s,
                          prefix, setup_s))
    folds = min(5, *Counter(g for _, g in labelled).values())
    heads = {"head from the descriptions (no labelled rows)": lambda: description_head(zero_shot.engine, DESCRIPTIONS),
             f"head tuned on {len(labelled)} labelled tickets": lambda: tune_head(
                 zero_shot.engine, [t for t, _ in labelled], [g for _, g in labelled], TuneConfig(folds=folds),
                 list(labels))[0]}
    for name, make in heads.items():
        start = time.perf_counter()
        head = make()
        setup_s = time.perf_counter() - start
        router = zero_shot.with_task(head.task, head)  # the prompt the head reads (tune: the representation one)
        engine = router.engine
        engine.classify(texts[:4])
        start = time.perf_counter()
        fast = engine.classify(texts)
        seconds = time.perf_counter() - start
        ref = router.reference.classify(texts[:check])
        add(score_row(name, fast, ref, golds, labels, seconds, len(engine.prompt.prefix_ids), setup_s))
    return {"machine": machine_info(threads), "n": n, "model": model, "dtype": zero_shot.loaded.precision,
            "check": check, "shots": shots, "calibration_rows": len(labelled), "descriptions": DESCRIPTIONS,
            "rows": [asdict(r) for r in rows]}


def markdown(record: dict, command: str) -> str:
    m = record["machine"]
    lines = [
        f"`{command}` — {record['n']} tickets, {record['model']} ({record['dtype']}), {m['cpu']}, "
        f"{m['threads']} threads, torch {m['torch']}, git {m['git_sha']}, {m['date']}",
        "",
        f"| row | accuracy | macro-F1 | {' | '.join(f'{100 * c:.0f}% answered' for c in FLOOR_COVERAGES)} | items/s "
        f"| prefix tokens | agreement (first {record['check']}) | max \\|Δ log-prob\\| | setup s |",
        "|---|---:|---:|" + "---:|" * len(FLOOR_COVERAGES) + "---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        lines.append(f"| {r['name']} | {100 * r['accuracy']:.1f}% | {r['macro_f1']:.3f} | {_floors(r)} | "
                     f"{r['items_per_s']:.2f} | {r['prefix_tokens']} | {100 * r['agreement']:.1f}% | "
                     f"{r['max_dlogprob']:.1e} | {r['setup_s']:.1f} |")
    lines += ["", "*N% answered*: the accuracy on the rows a fallback floor still answers when it routes the least "
              "sure rest to a person, and that floor (`--min-prob`; rounded down to 3 decimals: it may answer a few "
              "more)."]
    return "\n".join(lines) + "\n"


def _floors(row: dict) -> str:
    """A row's floor cells, one per FLOOR_COVERAGES: "accuracy (≥ min-prob)", or "-" (an older record)."""
    points = {point["target"]: point for point in row.get("floors", [])}
    return " | ".join(f"{100 * points[c]['accuracy']:.1f}% (≥ {points[c]['min_prob']:.3f})" if c in points else "-"
                      for c in FLOOR_COVERAGES)


def write_outputs(record: dict, out_dir: Path, command: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "accuracy.json", "markdown": out_dir / "accuracy.md"}
    paths["json"].write_text(json.dumps({**record, "command": command}, indent=2))
    paths["markdown"].write_text(markdown(record, command))
    return paths
