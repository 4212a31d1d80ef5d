"""The accuracy bench on a tiny model: every row present and every option equal to the reference."""

from pathlib import Path

from slimroute.bench.accuracy import DESCRIPTIONS, labelled_tickets, markdown, run_accuracy_bench
from slimroute.io.synth import synthetic_tickets
from slimroute.task import Task

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_task_file_has_the_bench_descriptions():
    task = Task.from_file(ROOT / "data" / "tickets-task.yaml")
    assert dict(task.descriptions) == DESCRIPTIONS and task.labels == ("billing", "technical", "account")


def test_labelled_tickets_are_balanced_and_not_evaluated():
    evaluated = {t["text"] for t in synthetic_tickets(600, 0)}
    rows = labelled_tickets(30, evaluated)
    assert len(rows) == 30 and [r["label"] for r in rows[:3]] == ["billing", "technical", "account"]
    assert not {r["text"] for r in rows} & evaluated


def test_every_row_agrees_with_the_reference(model_dir):
    record = run_accuracy_bench(n=9, model=model_dir, dtype="float32", threads=1, shots=1, calibration_rows=12, check=3,
                                log=lambda line: None)
    names = [r["name"] for r in record["rows"]]
    assert record["dtype"] == "float32"  # what the dtype resolved to
    assert len(names) == 18 and names[:4] == ["zero-shot", "zero-shot + content-free calibration",
                                              "zero-shot + batch calibration", "zero-shot + fitted calibration"]
    for row in record["rows"]:
        assert row["agreement"] == 1.0 and row["max_dlogprob"] <= 1e-4, row
        assert 0 <= row["accuracy"] <= 1 and row["items_per_s"] > 0
        assert [point["target"] for point in row["floors"]] == [0.9, 0.8]
        for point in row["floors"]:  # a floor answering at least that share of the 9 tickets, and no more than all
            assert point["target"] * 9 <= point["answered"] <= 9 and 0 <= point["accuracy"] <= 1
    assert names[16:] == ["head from the descriptions (no labelled rows)", "head tuned on 12 labelled tickets"]
    few_shot = next(r for r in record["rows"] if r["name"].startswith("few-shot"))
    assert few_shot["prefix_tokens"] > record["rows"][0]["prefix_tokens"]
    table = markdown(record, "slimroute bench --accuracy")
    assert "| zero-shot + fitted calibration |" in table and "| 90% answered | 80% answered |" in table
    first = record["rows"][0]["floors"][0]
    assert f"| {100 * first['accuracy']:.1f}% (≥ {first['min_prob']:.3f}) |" in table
