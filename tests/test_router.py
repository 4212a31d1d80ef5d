"""slimroute.load() and the Router: the one way a model and a task become a classifier, built on a tiny model saved as
a folder (as a user's own model would be). It answers as the engine does, chooses the dtype once, verifies itself,
writes the file the CLI writes, and a Recipe rebuilds it in another process."""

from __future__ import annotations

import json
import pickle

import pytest
from typer.testing import CliRunner

import slimroute
from slimroute import cli, router
from slimroute.accuracy.calibration import content_free_offsets
from slimroute.engine.fast import Engine
from slimroute.io.synth import synthetic_tickets
from slimroute.runtime import dtypes
from slimroute.runtime.dtypes import UnsupportedDtypeError
from slimroute.runtime.load import load_model
from slimroute.runtime.packaged import ModelNotFoundError

LABELS = ["billing", "technical", "account"]
TEXTS = [t["text"] for t in synthetic_tickets(12, 3)]


def same(a, b) -> bool:
    return [(p.label, p.logprobs) for p in a] == [(p.label, p.logprobs) for p in b]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_load_answers_as_the_engine_and_says_what_runs(model_dir, dtype):
    r = slimroute.load(model_dir, LABELS, dtype=dtype, threads=1)
    engine = Engine.from_loaded(load_model(model_dir, dtype, threads=1), slimroute.Task(tuple(LABELS)))
    assert same(r.classify(TEXTS), engine.classify(TEXTS))
    assert r.labels == tuple(LABELS)
    info = r.info
    assert info["dtype"] == dtype and info["dtype_reason"] == "requested" and info["threads"] == 1
    assert info["labels"] == LABELS and info["prefix_tokens"] == len(engine.prompt.prefix_ids)
    assert info["kernels"].startswith("int8") == (dtype == "int8")


def test_the_dtype_is_chosen_once(model_dir, monkeypatch):
    calls = []
    real = dtypes.choose_dtype

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(router, "choose_dtype", counted)
    monkeypatch.setattr("slimroute.runtime.load.choose_dtype", counted)
    r = slimroute.load(model_dir, LABELS, threads=1)
    assert len(calls) == 1 and r.info["dtype_reason"] != "requested"  # auto's reason, not patched in afterwards


def test_verify_compares_the_reference_with_the_fast_path(model_dir):
    r = slimroute.load(model_dir, LABELS, dtype="int8", threads=1)
    agreement = r.verify(TEXTS[:5])
    assert agreement.ok and agreement.num_items == 5 and agreement.max_abs_logprob_diff == 0.0
    assert same(r.reference.classify(TEXTS[:5]), r.classify(TEXTS[:5]))


def test_classify_file_writes_the_bytes_the_cli_writes(model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS))
                   + '{"id": "bad", "text": ""}\n')
    r = slimroute.load(model_dir, LABELS, dtype="float32", threads=1)
    summary = r.classify_file(src, tmp_path / "python.jsonl", window=5)
    result = CliRunner().invoke(cli.app, ["classify", str(src), "--labels", ",".join(LABELS), "--model", model_dir,
                                          "--dtype", "float32", "--threads", "1", "--window", "5",
                                          "--out", str(tmp_path / "cli.jsonl")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "python.jsonl").read_bytes() == (tmp_path / "cli.jsonl").read_bytes()
    assert summary.num_items == len(TEXTS) + 1 and summary.num_errors == 1


def test_with_task_shares_the_loaded_model(model_dir, tmp_path):
    r = slimroute.load(model_dir, LABELS, dtype="float32", threads=1)
    task_file = tmp_path / "urgency.yaml"
    task_file.write_text("labels: [low, high]\ninstructions: How urgent is the ticket?\n")
    urgent = r.with_task(task_file)
    assert urgent.loaded is r.loaded and urgent.labels == ("low", "high")
    fresh = slimroute.load(model_dir, task_file, dtype="float32", threads=1)
    assert same(urgent.classify(TEXTS[:4]), fresh.classify(TEXTS[:4]))


def test_calibrate_content_free_equals_the_offsets_applied_by_hand(model_dir):
    r = slimroute.load(model_dir, LABELS, dtype="float32", threads=1, calibrate="content-free")
    plain = slimroute.load(model_dir, LABELS, dtype="float32", threads=1)
    by_hand = plain.engine.with_calibration(content_free_offsets(plain.engine, plain.labels))
    assert r.info["calibration"]["mode"] == "content-free"
    got, expected = r.classify(TEXTS), by_hand.classify(TEXTS)
    assert [(p.label, p.calibrated_logprobs) for p in got] == [(p.label, p.calibrated_logprobs) for p in expected]
    with pytest.raises(ValueError, match="batch calibration needs texts"):
        plain.calibrated("batch")


def test_a_recipe_pickles_and_builds_the_same_router(model_dir):
    r = slimroute.load(model_dir, LABELS, dtype="int8", threads=1)
    rebuilt = pickle.loads(pickle.dumps(r.recipe)).build()
    assert rebuilt.info["dtype"] == "int8" and same(rebuilt.classify(TEXTS[:4]), r.classify(TEXTS[:4]))


def test_bad_arguments_say_what_is_wrong(model_dir, tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        slimroute.load(str(tmp_path / "nothing-here"), LABELS)
    with pytest.raises(ValueError, match="no task"):
        slimroute.load(model_dir)
    with pytest.raises(ValueError, match="is given twice"):
        slimroute.load(model_dir, ["billing", "billing"])
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", "avx2 fma")  # an AVX2-only CPU: no bf16 kernels
    with pytest.raises(UnsupportedDtypeError, match="bfloat16 needs AVX-512"):
        slimroute.load(model_dir, LABELS, dtype="bfloat16")
    with pytest.raises(ValueError, match="fallback_label 'billing' is one of the labels"):
        slimroute.load(model_dir, LABELS, config=slimroute.EngineConfig(min_prob=0.5, fallback_label="billing"))
