import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimroute.io.records import PredictionWriter, output_record
from slimroute.io.rows import InputError, Row, count_rows, iter_records, iter_rows, read_rows, record_columns
from slimroute.labels import Prediction

FORMATS = ("csv", "jsonl", "parquet")
LABELS = ["billing", "technical", "account"]


def write_input(path: Path, records: list[dict]) -> Path:
    """Write dict records in the format named by the path's extension."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".csv":
        header = list(dict.fromkeys(k for r in records for k in r))
        with path.open("w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows([r.get(k, "") for k in header] for r in records)
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def read_output(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 etc. are not line ends
    return [json.loads(line) for line in lines if line]


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_round_trip(tmp_path, fmt):
    records = [{"id": f"x{i}", "text": f"ticket {i}, ünïcødé ✓\nline 2", "label": LABELS[i % 3]}
               for i in range(5)]
    path = write_input(tmp_path / f"in.{fmt}", records)
    rows = read_rows(path)
    assert rows == [Row(i, f"x{i}", r["text"], r["label"], None) for i, r in enumerate(records)]
    assert count_rows(path) == 5


@pytest.mark.parametrize("fmt", FORMATS)
def test_ids_default_to_row_number_and_no_label_means_no_gold(tmp_path, fmt):
    path = write_input(tmp_path / f"in.{fmt}", [{"text": "a"}, {"text": "b"}, {"text": "c"}])
    rows = read_rows(path)
    assert [(r.index, r.id, r.gold) for r in rows] == [(0, "0", None), (1, "1", None), (2, "2", None)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_explicit_columns(tmp_path, fmt):
    records = [{"body": "hello", "ticket": "A-1", "y": "billing", "label": "other"},
               {"body": "there", "ticket": "A-2", "y": "", "label": "other"}]
    path = write_input(tmp_path / f"in.{fmt}", records)
    rows = read_rows(path, text_column="body", id_column="ticket", label_column="y")
    assert [(r.id, r.text, r.gold) for r in rows] == [("A-1", "hello", "billing"), ("A-2", "there", None)]
    assert [r.gold for r in read_rows(path, text_column="body")] == ["other", "other"]  # 'label' by default


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_gold_and_id_in_a_row(tmp_path, fmt):
    records = [{"id": "a", "text": "one", "label": "billing"}, {"id": "", "text": "two", "label": ""},
               {"id": None, "text": "three", "label": None}]
    if fmt == "csv":
        records[2] = {"id": "", "text": "three", "label": ""}
    rows = read_rows(write_input(tmp_path / f"in.{fmt}", records))
    expected = [("a", "billing", None), ("1", None, None), ("2", None, None)]
    assert [(r.id, r.gold, r.error) for r in rows] == expected


def test_jsonl_bad_rows_are_reported_per_row(tmp_path):
    lines = [
        b'{"id": "ok1", "text": "fine"}',
        b"{not json",
        b'["a", "list"]',
        b'{"id": "nt", "other": "x"}',
        b'{"text": null}',
        b'{"text": 42}',
        b'{"text": ""}',
        b'{"text": "  \\t "}',
        b'{"id": "bad\xff", "text": "caf\xe9"}',
        b'{"id": "lone \\ud800", "text": "lone \\ud800 surrogate"}',
        b'{"text": ["a"]}',
        b'{"id": 7, "text": "fine too", "label": 3}',
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = read_rows(path)
    errors = [r.error for r in rows]
    assert errors[0] is None and errors[-1] is None
    assert errors[1].startswith("row is not valid JSON")
    assert errors[2] == "row is not a JSON object (got list)"
    assert errors[3] == "text column 'text' is missing in this row"
    assert errors[4:8] == ["text is null", "text is not a string (got int)", "text is empty", "text is empty"]
    assert errors[8:10] == ["text is not valid UTF-8", "text is not valid UTF-8"]
    assert errors[10] == "text is not a string (got list)"
    assert all(r.text is None for r in rows if r.error)
    assert [rows[0].text, rows[-1].text, rows[-1].id, rows[-1].gold] == ["fine", "fine too", "7", "3"]
    assert (rows[3].id, rows[8].id, rows[9].id) == ("nt", "bad\ufffd", "lone \ufffd")  # kept, made writable
    assert [r.index for r in rows] == list(range(len(lines)))


def test_csv_bad_rows_are_reported_per_row(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b'id,text,label\na,fine,billing\nb,,billing\nc\nd,caf\xe9,account\ne," ",x\n'
                     b'f,"multi\nline, ""quoted""",technical\n')
    rows = read_rows(path)
    assert [r.error for r in rows] == [None, "text is empty", "text column 'text' is missing in this row",
                                       "text is not valid UTF-8", "text is empty", None]
    assert rows[-1].text == 'multi\nline, "quoted"' and rows[3].gold == "account"
    assert count_rows(path) == 6


def test_parquet_bad_rows_are_reported_per_row(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table({"text": pa.array([b"fine", None, b"", b"caf\xe9", b"  "], pa.binary())})
    pq.write_table(table, path)
    assert [r.error for r in read_rows(path)] == [None, "text is null", "text is empty",
                                                 "text is not valid UTF-8", "text is empty"]
    pq.write_table(pa.table({"text": [1, 2]}), path)
    assert [r.error for r in read_rows(path)] == ["text is not a string (got int)"] * 2


def test_parquet_streams_in_batches(tmp_path):
    path = write_input(tmp_path / "big.parquet", [{"text": f"t{i}"} for i in range(2500)])
    rows = iter_rows(path)
    assert next(rows) == Row(0, "0", "t0", None, None)
    rest = list(rows)
    assert len(rest) == 2499 and rest[-1] == Row(2499, "2499", "t2499", None, None)


def test_bom_and_blank_lines(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\n{"text": "b"}\r\n   \n')
    assert [(r.index, r.text) for r in read_rows(jsonl)] == [(0, "a"), (1, "b")]
    assert count_rows(jsonl) == 2
    csv_path = tmp_path / "in.csv"
    csv_path.write_bytes(b"\xef\xbb\xbftext\r\na\r\n\r\nb\r\n")
    assert [(r.index, r.text) for r in read_rows(csv_path)] == [(0, "a"), (1, "b")]
    assert count_rows(csv_path) == 2


def test_empty_inputs(tmp_path):
    for name in ("e.csv", "e.jsonl"):
        (tmp_path / name).write_bytes(b"")
        assert read_rows(tmp_path / name) == [] and count_rows(tmp_path / name) == 0


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match=r"input file '.*nope\.jsonl' does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    assert count_rows(tmp_path / "nope.jsonl") is None


def test_unknown_extension(tmp_path):
    (tmp_path / "in.xlsx").write_text("hello\n")
    with pytest.raises(InputError, match=r"unsupported extension '\.xlsx'; use one of \.csv, \.jsonl.*\.txt"):
        read_rows(tmp_path / "in.xlsx")
    assert count_rows(tmp_path / "in.xlsx") is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_several_text_columns_make_one_text(tmp_path, fmt):
    """--text-column subject,body: a paragraph "<column>: <value>" per filled column, in the order given."""
    path = write_input(tmp_path / f"in.{fmt}", [
        {"id": "a", "subject": "Refund", "body": "I was charged twice.\n", "other": "x"},
        {"id": "b", "subject": "", "body": "The app crashes", "other": "x"},  # no subject: the body alone
        {"id": "c", "subject": "  ", "body": "", "other": "x"},  # nothing left
    ])
    rows = read_rows(path, "subject,body")
    assert [(r.id, r.text, r.error) for r in rows] == [
        ("a", "subject: Refund\n\nbody: I was charged twice.", None),
        ("b", "body: The app crashes", None),
        ("c", None, "text columns 'subject', 'body' are all empty or missing in this row")]
    assert read_rows(path, "body, subject")[0].text == "body: I was charged twice.\n\nsubject: Refund"
    assert read_rows(path, "body")[0].text == "I was charged twice.\n"  # one column: the value as it is
    with pytest.raises(InputError, match=r"text column 'title' is not in .*available columns: 'id', 'subject'"):
        read_rows(path, "subject,title")


def test_several_text_columns_keep_the_per_row_checks(tmp_path):
    path = write_input(tmp_path / "in.jsonl", [
        {"subject": "Invoice", "body": 5}, {"subject": None, "body": "ok"}, {"body": "no subject key"}])
    rows = read_rows(path, "subject,body")
    assert rows[0].error == "text column 'body' is not a string (got int)"
    assert [r.text for r in rows[1:]] == ["body: ok", "body: no subject key"]
    odd = write_input(tmp_path / "odd.csv", [{"a,b": "whole", "a": "x", "b": "y"}])
    assert read_rows(odd, "a,b")[0].text == "whole"  # a column named with a comma is taken whole


def test_text_lines_are_rows_numbered_from_zero(tmp_path):
    """.txt: a text per non-blank line (BOM, line ends and blank lines as in JSONL); no columns, ids are row numbers."""
    path = tmp_path / "in.txt"
    path.write_bytes(b'\xef\xbb\xbfI was charged twice\r\n\n  \n{"text": "kept as text"}\nbad \xff byte\n  spaced  \n')
    rows = read_rows(path, label_column=None)
    assert [(r.index, r.id, r.text, r.gold) for r in rows] == [
        (0, "0", "I was charged twice", None), (1, "1", '{"text": "kept as text"}', None),
        (2, "2", None, None), (3, "3", "  spaced  ", None)]
    assert rows[2].error == "text is not valid UTF-8" and count_rows(path) == 4
    assert record_columns(path) == ["text"]
    with pytest.raises(InputError, match=r"one text per line and no columns, so --label-column 'intent' cannot"):
        read_rows(path, label_column="intent")
    assert [r["text"] for r in iter_records(path)][2] == "bad \ufffd byte"


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_text_column(tmp_path, fmt):
    path = write_input(tmp_path / f"in.{fmt}", [{"body": "x", "id": "1"}])
    with pytest.raises(InputError, match=r"text column 'text' is not in .*'body', 'id'.*--text-column"):
        iter_rows(path)  # raised before iterating: the caller can fail fast


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_explicit_label_or_id_column(tmp_path, fmt):
    path = write_input(tmp_path / f"in.{fmt}", [{"text": "x"}])
    with pytest.raises(InputError, match=r"label column 'gold' is not in .*'text'.*--label-column"):
        read_rows(path, label_column="gold")
    with pytest.raises(InputError, match=r"id column 'key' is not in .*--id-column"):
        read_rows(path, id_column="key")


def test_jsonl_column_check_tolerates_a_bad_first_row(tmp_path):
    path = tmp_path / "in.ndjson"
    path.write_text('garbage\n{"other": 1}\n{"text": "hi"}\n', encoding="utf-8")
    assert [r.error is None for r in read_rows(path)] == [False, False, True]


def test_unreadable_parquet(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        read_rows(tmp_path / "bad.parquet")


nonblank_text = st.text(min_size=1, max_size=200).filter(lambda s: s.strip())


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(nonblank_text, min_size=1, max_size=8))
def test_arbitrary_unicode_texts_round_trip(tmp_path, fmt, texts):
    path = write_input(tmp_path / f"in.{fmt}", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])
    assert [(r.text, r.error) for r in read_rows(path)] == [(t, None) for t in texts]


# --------------------------------------------------------------------------- writing


def sample_preds() -> tuple[list[Row], list[Prediction]]:
    rows = [Row(0, "a", "text a", None, None), Row(1, "b", None, None, "text is empty"),
            Row(2, "c", "text c", "account", None), Row(3, "d", "text d", None, None)]
    preds = [Prediction("billing", {"billing": -0.1, "technical": -2.5, "account": -3.0}, 12, False),
             Prediction.failed("text is empty"),
             Prediction("account", {"billing": -4.0, "technical": -3.0, "account": -0.05}, 900, True),
             Prediction.failed("model failed: out of memory")]
    return rows, preds


def test_output_record():
    rows, preds = sample_preds()
    ok = output_record(rows[0], preds[0], LABELS)
    assert list(ok) == ["id", "label", "p_billing", "p_technical", "p_account", "truncated", "error"]
    assert ok["label"] == "billing" and ok["error"] is None and ok["truncated"] is False
    assert sum(ok[f"p_{label}"] for label in LABELS) == pytest.approx(1.0)
    assert ok["p_billing"] > ok["p_technical"] > ok["p_account"]
    bad = output_record(rows[1], Prediction("billing", {"billing": 0.0}), LABELS)
    assert bad == {"id": "b", "label": None, "p_billing": None, "p_technical": None, "p_account": None,
                   "truncated": False, "error": "text is empty"}
    assert output_record(rows[3], preds[3], LABELS)["error"] == "model failed: out of memory"


@pytest.mark.parametrize("fmt", FORMATS)
def test_prediction_writer_round_trip(tmp_path, fmt):
    rows, preds = sample_preds()
    path = tmp_path / "nested" / "dir" / f"out.{fmt}"
    with PredictionWriter(path, LABELS) as writer:
        writer.write(rows[:2], preds[:2])
        writer.write([], [])
        writer.write(rows[2:], preds[2:])
    expected = [output_record(r, p, LABELS) for r, p in zip(rows, preds, strict=True)]
    got = read_output(path)
    if fmt == "csv":  # CSV is text: nulls are empty, booleans are true/false
        expected = [{k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                     for k, v in rec.items()} for rec in expected]
        assert [{k: v for k, v in rec.items() if not k.startswith("p_")} for rec in got] == \
               [{k: v for k, v in rec.items() if not k.startswith("p_")} for rec in expected]
        got = [{k: v if not k.startswith("p_") or not v else float(v) for k, v in rec.items()} for rec in got]
        expected = [{k: v if not k.startswith("p_") or not v else float(v) for k, v in rec.items()}
                    for rec in expected]
    assert got == expected
    assert list(got[0]) == ["id", "label", "p_billing", "p_technical", "p_account", "truncated", "error"]
    if fmt == "parquet":
        meta = pq.ParquetFile(path)
        assert meta.num_row_groups == 2
        assert meta.schema_arrow == pa.schema(
            [("id", pa.string()), ("label", pa.string())] + [(f"p_{lab}", pa.float64()) for lab in LABELS]
            + [("truncated", pa.bool_()), ("error", pa.string())])


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.text(min_size=1, max_size=50), min_size=1, max_size=6))
def test_writer_keeps_arbitrary_ids(tmp_path, fmt, ids):
    rows = [Row(i, id_, "t", None, None) for i, id_ in enumerate(ids)]
    preds = [Prediction("billing", {"billing": 0.0, "technical": -1.0, "account": -2.0})] * len(ids)
    path = tmp_path / f"out.{fmt}"
    with PredictionWriter(path, LABELS) as writer:
        writer.write(rows, preds)
    assert [rec["id"] for rec in read_output(path)] == ids


def test_writer_rejects_bad_usage(tmp_path):
    with pytest.raises(InputError, match=r"unsupported extension '\.xlsx'"):
        PredictionWriter(tmp_path / "out.xlsx", LABELS)
    with pytest.raises(ValueError, match="distinct"):
        PredictionWriter(tmp_path / "out.jsonl", ["a", "a"])
    rows, preds = sample_preds()
    writer = PredictionWriter(tmp_path / "out.jsonl", LABELS)
    with pytest.raises(ValueError, match="4 rows but 3 predictions"):
        writer.write(rows, preds[:3])
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(rows, preds)
