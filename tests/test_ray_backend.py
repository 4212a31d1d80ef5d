"""The Ray Data backend on a tiny model and a local 2-CPU Ray: same answers as the local backend, bad
rows as row errors, each row exactly once even when a replica is killed mid-job."""

from __future__ import annotations

import json
import os
import signal

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")  # Ray's own, on copy


from slimroute.backends.local import classify_rows  # noqa: E402
from slimroute.backends.ray import (  # noqa: E402
    SUMMARY_FILE,
    ClassifierActor,
    classify_dataset,
    input_files,
    read_rows_dataset,
    rows_of,
    run_ray_job,
)
from slimroute.engine.fast import Engine  # noqa: E402
from slimroute.io.records import output_record  # noqa: E402
from slimroute.io.rows import InputError, read_rows  # noqa: E402
from slimroute.io.synth import synthetic_tickets  # noqa: E402
from slimroute.router import Recipe  # noqa: E402
from slimroute.runtime.load import load_model  # noqa: E402
from slimroute.task import Task  # noqa: E402

TASK = Task.from_labels("billing,technical,account")


def recipe(model_dir, config=None):
    return Recipe.of(str(model_dir), TASK, config=config)

LABELS = list(TASK.labels)
BAD_LINES = [
    '{"id": "empty", "text": "", "label": "billing"}',
    '{"id": "blank", "text": "   \\n "}',
    '{"id": "null", "text": null}',
    '{"id": "number", "text": 42}',
    '{"id": "list", "text": ["a", "b"]}',
    '{"id": "no-text", "body": "the text is under another key"}',
    "this line is not JSON",
]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    context = ray.data.DataContext.get_current()
    context.wait_for_min_actors_s = 120  # dispatch only once every replica is up, so each gets blocks
    yield
    context.wait_for_min_actors_s = -1
    ray.shutdown()


@pytest.fixture(scope="module")
def tickets_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "tickets.jsonl"
    lines = [json.dumps(t) for t in synthetic_tickets(36, seed=3)]
    lines.insert(5, json.dumps({"id": "long", "text": "my invoice was charged twice " * 700}))  # truncated
    for i, bad in enumerate(BAD_LINES):
        lines.insert(3 + 4 * i, bad)
    path.write_text("\n".join(lines) + "\n")
    with path.open("ab") as f:
        f.write(b'{"id": "latin-1", "text": "caf\xe9 cr\xe8me"}\n')  # not UTF-8
    return path


def local_records(path, model_dir) -> dict[str, dict]:
    """What `--backend local` writes for this file, by id."""
    rows = read_rows(path)
    engine = Engine.from_loaded(load_model(model_dir, threads=1), TASK)
    preds = classify_rows(engine, rows)
    return {row.id: output_record(row, pred, LABELS) for row, pred in zip(rows, preds, strict=True)}


def read_shards(folder) -> list[dict]:
    if str(folder).endswith(".jsonl"):
        return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]
    return pq.read_table(folder).to_pylist()


def by_id(records: list[dict]) -> dict[str, dict]:
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an id came out more than once"
    return {r["id"]: r for r in records}


def assert_same_answers(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for key, record in want.items():
        assert got[key]["label"] == record["label"], key
        assert got[key]["error"] == record["error"], key
        assert got[key]["truncated"] == record["truncated"], key
        for label in LABELS:
            expected = record[f"p_{label}"]
            assert got[key][f"p_{label}"] == (None if expected is None else pytest.approx(expected, abs=1e-6))


@pytest.fixture(scope="module")
def ray_job(local_ray, model_dir, tickets_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "predictions.parquet"
    summary = run_ray_job(tickets_path, out, recipe(model_dir), replicas=2, threads_per_replica=1, block_rows=8)
    return summary, out


@pytest.mark.slow  # with the module's Ray start and the shared job: about 25 s
def test_same_ids_labels_and_probabilities_as_the_local_backend(ray_job, tickets_path, model_dir):
    summary, out = ray_job
    got = by_id(read_shards(out))
    want = local_records(tickets_path, model_dir)
    assert_same_answers(got, want)
    assert got["long"]["truncated"] is True
    assert pq.read_schema(next(out.glob("*.parquet"))).names == ["id", "label", *(f"p_{x}" for x in LABELS),
                                                                 "truncated", "error"]


@pytest.mark.slow
def test_bad_rows_come_back_as_row_errors(ray_job, tickets_path):
    summary, out = ray_job
    not_json_row = tickets_path.read_bytes().splitlines().index(BAD_LINES[-1].encode())
    got = by_id(read_shards(out))
    errors = {key: r["error"] for key, r in got.items() if r["error"]}
    assert errors == {
        "empty": "text is empty", "blank": "text is empty", "null": "text is null",
        "number": "text is not a string (got int)", "list": "text is not a string (got list)",
        "no-text": "text column 'text' is missing in this row", "latin-1": "text is not valid UTF-8",
        # without an id a row is named by its row number, as the local backend names it
        str(not_json_row): "row is not valid JSON (Expecting value at column 1)",
    }
    assert all(got[key]["label"] is None and got[key]["p_billing"] is None for key in errors)
    assert summary["errors"] == len(errors) and summary["items"] == len(got) == 45


@pytest.mark.slow
def test_summary_counts_items_per_replica(ray_job):
    summary, out = ray_job
    per_replica = summary["per_replica"]
    assert len(per_replica) == 2 and all(r["items"] > 0 for r in per_replica.values())
    assert sum(r["items"] for r in per_replica.values()) == summary["items"]
    assert all(r["peak_rss_mb"] > 0 and r["load_seconds"] > 0 for r in per_replica.values())
    assert summary["items_per_s"] > 0 and summary["startup_seconds"] > 0
    assert summary["accuracy"] is not None and sum(n for _, _, n in summary["confusion"]) == 36
    assert json.loads((out / SUMMARY_FILE).read_text()) == summary


def test_a_folder_of_csv_parquet_and_jsonl_files(local_ray, model_dir, tmp_path):
    folder = tmp_path / "in"
    (folder / "nested").mkdir(parents=True)
    tickets = synthetic_tickets(12, seed=5)
    pa.csv.write_csv(pa.Table.from_pylist(tickets[:4] + [{"id": "csv-empty", "text": "", "label": "billing"}]),
                     folder / "a.csv")
    pq.write_table(pa.Table.from_pylist(tickets[4:8] + [{"id": "pq-null", "text": None, "label": None}]),
                   folder / "nested" / "b.parquet")
    no_ids = folder / "c.jsonl"  # no id column: ids become "<file>:<row>"
    no_ids.write_text("".join(json.dumps({"text": t["text"]}) + "\n" for t in tickets[8:]))
    (folder / "_ignored.jsonl").write_text("{}\n")
    out = tmp_path / "out.jsonl"

    summary = run_ray_job(folder, out, recipe(model_dir), replicas=1, threads_per_replica=1, block_rows=4)

    got = by_id(read_shards(out))
    want = {**local_records(folder / "a.csv", model_dir), **local_records(folder / "nested" / "b.parquet", model_dir),
            **{f"c.jsonl:{k}": v | {"id": f"c.jsonl:{k}"} for k, v in local_records(no_ids, model_dir).items()}}
    assert_same_answers(got, want)
    assert got["csv-empty"]["error"] == "text is empty" and got["pq-null"]["error"] == "text is null"
    assert summary["files"] == 3 and summary["items"] == 14 and summary["format"] == "jsonl"


@pytest.mark.slow
def test_a_killed_replica_is_restarted_and_no_row_is_lost_or_duplicated(ray_job, tickets_path, model_dir,
                                                                       tmp_path):
    marker = str(tmp_path / "killed")

    class KilledOnce(ClassifierActor):
        """SIGKILLs its own process on its second block, once per test (the marker is created atomically)."""

        calls = 0

        def __call__(self, batch):
            self.calls += 1
            if self.calls == 2:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().__call__(batch)

    rows = read_rows_dataset(tickets_path, block_rows=8).materialize()
    result = classify_dataset(rows, recipe(model_dir), replicas=1, threads_per_replica=1, label_column="gold",
                              block_rows=8, telemetry=True, replica_cls=KilledOnce).take_all()

    assert os.path.exists(marker), "the replica was never killed"
    assert len({r["_replica"] for r in result}) == 2  # the killed process answered a block, its successor the rest
    uninterrupted = by_id(read_shards(ray_job[1]))
    assert_same_answers(by_id(result), uninterrupted)


def test_classify_dataset_takes_any_dataset_and_its_column_names(local_ray, model_dir):
    records = [{"key": 1, "body": "I was charged twice this month"}, {"key": 2, "body": None},
               {"key": 3, "body": ""}, {"key": None, "body": "the app crashes on start"},
               {"key": 5, "body": "I cannot log in to my account"}]
    ds = ray.data.from_items(records)

    got = by_id(classify_dataset(ds, recipe(model_dir), text_column="body", id_column="key").take_all())

    assert set(got) == {"1", "2", "3", "5", None}
    assert got[None]["error"] == "id column 'key' is empty in this row"
    assert got["2"]["error"] == "text is null" and got["3"]["error"] == "text is empty"
    engine = Engine.from_loaded(load_model(model_dir, threads=1), TASK)
    for key, text in (("1", records[0]["body"]), ("5", records[4]["body"])):
        pred = engine.classify([text])[0]
        assert got[key]["label"] == pred.label and got[key]["error"] is None
        assert got[key]["p_billing"] == pytest.approx(pred.probs["billing"], abs=1e-6)
    assert "_replica" not in got["1"]


def test_usage_errors_are_raised_before_any_work(local_ray, model_dir, tickets_path, tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("id,text\n1,hello\n")
    with pytest.raises(InputError, match="text column 'body' is not in"):
        run_ray_job(csv_path, tmp_path / "o1", recipe(model_dir), text_column="body")
    with pytest.raises(InputError, match="does not exist"):
        run_ray_job(tmp_path / "missing.jsonl", tmp_path / "o2", recipe(model_dir))
    with pytest.raises(ValueError, match="Parquet or JSONL shards"):
        run_ray_job(tickets_path, tmp_path / "o3.csv", recipe(model_dir))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not ours")
    with pytest.raises(ValueError, match="not a slimroute output"):
        run_ray_job(tickets_path, foreign, recipe(model_dir))
    assert (foreign / "keep.txt").read_text() == "not ours"
    with pytest.raises(ValueError, match="need 4 CPUs but the Ray cluster has 2"):
        run_ray_job(tickets_path, tmp_path / "o4", recipe(model_dir), replicas=2, threads_per_replica=2)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        classify_dataset(ray.data.from_items([{"id": "1", "text": "x"}]), recipe(model_dir), replicas=0)


def test_input_files_from_a_file_a_folder_or_a_glob(tmp_path):
    for name in ("b.jsonl", "a.csv", "sub/c.parquet", "sub/.hidden.jsonl", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert input_files(tmp_path / "a.csv") == [tmp_path / "a.csv"]
    assert input_files(tmp_path) == [tmp_path / "a.csv", tmp_path / "b.jsonl", tmp_path / "sub" / "c.parquet"]
    assert input_files(f"{tmp_path}/**/*.parquet") == [tmp_path / "sub" / "c.parquet"]
    with pytest.raises(InputError, match="no .csv"):
        input_files(f"{tmp_path}/*.txt")


def test_rows_of_a_block_check_text_and_id_like_the_local_reader():
    block = pa.Table.from_pylist([
        {"id": "a", "text": "fine", "gold": " billing ", "_error": None},
        {"id": "b", "text": None, "gold": None, "_error": "row is not valid JSON (x)"},
        {"id": None, "text": "no id", "gold": None, "_error": None},
        {"id": "d", "text": "\t", "gold": "", "_error": None},
    ])
    rows = rows_of(block, "text", "id", "gold")
    assert [(r.id, r.text, r.gold, r.error) for r in rows] == [
        ("a", "fine", "billing", None), ("b", None, None, "row is not valid JSON (x)"),
        (None, None, None, "id column 'id' is empty in this row"), ("d", None, None, "text is empty"),
    ]


def test_a_replica_with_a_floor_writes_the_route_and_the_models_choice(model_dir):
    from slimroute.config import EngineConfig

    texts = [t["text"] for t in synthetic_tickets(6, 11)]
    plain = Engine.from_loaded(load_model(model_dir, threads=1), TASK).classify(texts)
    chosen = sorted(p.probs[p.label] for p in plain)
    config = EngineConfig(min_prob=(chosen[2] + chosen[3]) / 2, fallback_label="human")
    replica = ClassifierActor(recipe(model_dir, config), str(model_dir), threads=1)
    out = replica(pa.table({"id": [str(i) for i in range(6)], "text": texts})).to_pylist()
    assert replica.schema.names[:3] == ["id", "label", "model_label"]
    assert [r["model_label"] for r in out] == [p.label for p in plain]
    assert [r["label"] for r in out] == [p.label if p.probs[p.label] >= config.min_prob else "human" for p in plain]
