"""`slimroute info`: what the machine is to slimroute, on simulated CPUs of each kind."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from slimroute import cli
from slimroute.runtime.cpu import detect
from slimroute.runtime.dtypes import int8_kernels_available
from slimroute.runtime.int8 import _onednn_problem

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

AVX2_ONLY = "avx avx2 fma f16c sse4_2"  # AMD Zen 3 and most laptops
ZEN4 = "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni"
needs_int8 = pytest.mark.skipif(not int8_kernels_available(detect()),
                                reason=f"int8 needs x86 AVX2 and torch's fbgemm kernels; this is {detect().describe()}")


def facts(monkeypatch, tmp_path, flags: str, onednn_cap: str | None = None) -> dict:
    """info --json on a CPU with these flags (oneDNN held to onednn_cap, else to nothing: the simulated flags are
    the whole CPU, whatever cap the run's CPU kind set)."""
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", flags)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    if onednn_cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_cap)
    monkeypatch.setenv("SLIMROUTE_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli.app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@needs_int8
def test_an_avx2_only_cpu_gets_int8_on_fbgemm_and_is_told_why_not_bfloat16(monkeypatch, tmp_path):
    got = facts(monkeypatch, tmp_path, AVX2_ONLY)
    assert got["dtype_auto"] == {"name": "int8", "reason": "AVX2 without native BF16"}
    assert got["dtypes"]["float32"] == got["dtypes"]["int8"] == "works"
    assert "bfloat16 needs AVX-512 (avx512bw, avx512vl, avx512dq)" in got["dtypes"]["bfloat16"]
    assert got["kernels"]["int8"].startswith("fbgemm's integer GEMMs, 7-bit activations, ")  # no VNNI: fbgemm
    assert got["exactness"]["int8"].startswith("bit for bit")
    assert "bfloat16" not in got["kernels"]
    assert got["cpu"]["flags"] == ["avx2", "fma"] and got["cpu"]["torch_capability"] == "AVX2"
    assert "[flags simulated by SLIMROUTE_CPU_FLAGS]" in got["cpu"]["model"]
    assert got["environment"]["SLIMROUTE_CPU_FLAGS"] == AVX2_ONLY
    assert got["models"]["qwen2.5-coder-0.5b"]["converted"] == "no"  # an empty cache
    assert got["cache"] == str(tmp_path / "cache")


@needs_int8
def test_a_vnni_cpu_gets_onednns_8_bit_kernel_where_its_probe_passes(monkeypatch, tmp_path):
    got = facts(monkeypatch, tmp_path, ZEN4)
    assert got["dtype_auto"] == {"name": "int8", "reason": "VNNI: faster than native BF16 on these CPUs"}
    # the flags are simulated, the probe runs on the real CPU: without a real VNNI it fails and fbgemm runs
    expected = "fbgemm's integer GEMMs, 7-bit activations" if _onednn_problem() else \
        "onednn's integer GEMMs, 8-bit activations"
    assert got["kernels"]["int8"].startswith(expected)


def test_an_ice_lake_is_told_its_bfloat16_is_emulated_without_a_bound_not_invariant(monkeypatch, tmp_path):
    """AVX-512 with VNNI and without AVX512-BF16 (Ice Lake, Cascade Lake), or a Zen 4 held to it: oneDNN runs bf16
    there without BF16 instructions, so info says what bf16 gives against its reference (dtypes.exactness)."""
    got = facts(monkeypatch, tmp_path, "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_vnni")
    assert got["exactness"].get("bfloat16", "oneDNN's bf16 does not run here").startswith(
        ("no bound, not batch-invariant (no AVX512-BF16 here", "oneDNN's bf16 does not run here"))
    got = facts(monkeypatch, tmp_path, ZEN4, onednn_cap="AVX512_CORE_VNNI")
    assert got["cpu"]["onednn_held_to"] == "AVX512_CORE_VNNI" and "avx512_bf16" not in got["cpu"]["flags"]
    assert got["environment"]["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_VNNI"
    assert got["dtype_auto"]["reason"] == "VNNI without native BF16"


def test_a_cpu_without_avx2_gets_float32_and_the_reasons(monkeypatch, tmp_path):
    got = facts(monkeypatch, tmp_path, "sse4_2")
    assert got["dtype_auto"]["name"] == "float32"
    assert "int8 needs an x86 CPU with AVX2" in got["dtypes"]["int8"]
    assert got["dtypes"]["float32"] == "works" and set(got["kernels"]) == {"float32"}


def test_the_table_shows_the_choice_and_the_cpu_as_plain_text(monkeypatch):
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", AVX2_ONLY)
    result = CliRunner().invoke(cli.app, ["info"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "--dtype auto" in text and "float32 works" in text
    assert "[flags simulated by SLIMROUTE_CPU_FLAGS]" in text  # not eaten as rich markup


def test_version():
    from slimroute import __version__

    result = CliRunner().invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith(f"slimroute {__version__} (torch ")
