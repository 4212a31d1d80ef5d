"""The bench's own measuring tools (the bench itself runs the real model: `slimroute bench --quick`)."""

import numpy as np

from slimroute.bench.speed import PeakRSS, classify_process_rss


def test_peak_rss_is_the_blocks_own_peak():
    big = np.ones(64 * 2**20 // 8)  # an earlier 64 MiB peak, freed before the block
    del big
    with PeakRSS() as before:
        pass
    with PeakRSS() as during:
        block = np.ones(256 * 2**20 // 8)  # 256 MiB touched inside the block
        del block
    assert during.peak - before.peak > 200 * 2**20


def test_fresh_classify_process_reports_its_peak_rss(model_dir):
    record = classify_process_rss(model_dir, ["refund my card", "app crash", "reset password"], 1, 32, None)
    assert record["items"] == 3
    assert 0.1 < record["peak_rss_gb"] < 8


def test_bench_runs_on_any_cpu_skips_what_it_cannot_run_and_survives_a_failing_row(model_dir, monkeypatch):
    """On a simulated AVX2-only CPU: bf16 is a row saying why, one failing row is reported, the rest run."""
    from slimroute.bench import speed as bench
    from slimroute.bench.speed import markdown, run_bench

    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", "avx2 fma f16c")
    real_run_row = bench.run_row

    def flaky(name, dtype, *args, **kwargs):
        if dtype == "float32" and name.startswith("all combined"):
            raise RuntimeError("simulated kernel failure")
        return real_run_row(name, dtype, *args, **kwargs)

    monkeypatch.setattr(bench, "run_row", flaky)
    record = run_bench(n=6, model=model_dir, threads=1, quick=True, log=lambda line: None)
    rows = {(r["name"].split(" (")[0], r["dtype"]): r for r in record["rows"]}
    assert "avx512bw" in rows[("bfloat16 rows", "bfloat16")]["note"]
    assert "simulated kernel failure" in rows[("all combined", "float32")]["note"]
    int8_combined = rows[("all combined", "int8")]
    assert int8_combined["agreement"] == 1.0 and int8_combined["max_dlogprob"] == 0.0
    assert record["auto_dtype"]["dtype"] == "int8" and "avx2" in record["machine"]["cpu_flags"]
    assert "int8" in record["vs_fp32"]
    table = markdown(record, "slimroute bench --quick")
    assert "skipped: --dtype bfloat16 cannot run here" in table and "**int8**" in table
    timed = sum(r["seconds"] for r in record["rows"] if r["note"] is None)  # a skipped row's 1.0 s is no time
    assert record["wall_s"] > timed  # the whole bench, loads included
    assert " in all" in table.splitlines()[0]
    from slimroute.bench.peers import llama_cpp_unavailable_reason

    reason = llama_cpp_unavailable_reason()
    if reason is not None:  # the optional peer row names why it did not run
        assert rows[("llama.cpp", "-")]["note"] == f"skipped: {reason}"
