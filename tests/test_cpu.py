"""The dtype chooser on simulated CPUs, and the one-line refusal of a dtype the CPU cannot run."""

import json

import pytest
import torch
from typer.testing import CliRunner

from slimroute.cli import app
from slimroute.runtime.cpu import KINDS, ONEDNN_CAPS, CpuFeatures, cpuid, detect
from slimroute.runtime.dtypes import UnsupportedDtypeError, choose_dtype, exactness, supported_dtypes

pytestmark = pytest.mark.kernels  # rerun under each CPU kind: tests/cpu_kinds.py

ZEN5 = CpuFeatures("AMD EPYC (Zen 5)", frozenset(
    "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni".split()), "AVX512", "x86_64")
ZEN3 = CpuFeatures("AMD EPYC (Zen 3)", frozenset("avx2 fma f16c".split()), "AVX2", "x86_64")
SKYLAKE = CpuFeatures("Intel Xeon (Skylake-SP)", frozenset("avx2 avx512f avx512bw avx512vl avx512dq".split()),
                      "AVX512", "x86_64")
SAPPHIRE_RAPIDS = CpuFeatures("Intel Xeon (AMX)", frozenset(
    "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni avx_vnni amx_bf16 amx_int8 amx_tile".split()),
    "AVX512", "x86_64")
BF16_NO_VNNI = CpuFeatures("a CPU with AVX-512 BF16 and no VNNI", frozenset(
    "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16".split()), "AVX512", "x86_64")
OLD_X86 = CpuFeatures("Intel Core 2", frozenset("sse4_1 sse4_2".split()), "DEFAULT", "x86_64")
ARM = CpuFeatures("Apple M2", frozenset("fp asimd".split()), "DEFAULT", "arm64")
FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines
needs_fbgemm = pytest.mark.skipif(not FBGEMM, reason="this torch build has no fbgemm int8 kernels")


@needs_fbgemm
@pytest.mark.parametrize("cpu, name, why", [
    (ZEN5, "int8", "VNNI: faster than native BF16"),
    (BF16_NO_VNNI, "bfloat16", "native BF16"),
    (ZEN3, "int8", "AVX2 without native BF16"),
    (SKYLAKE, "int8", "AVX2 without native BF16"),  # oneDNN's bf16 runs there, but emulated: no faster than int8
    (SAPPHIRE_RAPIDS, "int8", "VNNI; bf16 on AMX is as fast but not batch-invariant"),
    (OLD_X86, "float32", "no native BF16 and no int8 kernels"),
    (ARM, "float32", "no native BF16 and no int8 kernels"),
])
def test_auto_picks_from_the_cpu(cpu, name, why):
    choice = choose_dtype("auto", cpu)
    assert choice.name == name and why in choice.reason
    assert name in supported_dtypes(cpu)


def test_auto_on_a_gpu_is_float32():
    assert choose_dtype("auto", ZEN3, device="cuda").name == "float32"


@pytest.mark.parametrize("cpu", [ZEN3, ARM, OLD_X86])
def test_bfloat16_where_the_cpu_cannot_run_it_names_the_missing_feature(cpu):
    with pytest.raises(UnsupportedDtypeError) as err:
        choose_dtype("bfloat16", cpu)
    message = str(err.value)
    assert "\n" not in message and "avx512bw" in message and cpu.model in message
    assert "Dtypes that work on this machine: auto, float32" in message


def test_int8_where_the_cpu_cannot_run_it():
    with pytest.raises(UnsupportedDtypeError, match="int8 needs an x86 CPU with AVX2"):
        choose_dtype("int8", ARM)


def test_unknown_dtype_and_aliases():
    with pytest.raises(ValueError, match="float8"):
        choose_dtype("float8", ZEN3)
    assert choose_dtype("fp32", ZEN3).name == "float32"


@needs_fbgemm
def test_failing_int8_kernels_make_auto_fall_back_to_float32(monkeypatch):
    import slimroute.runtime.int8 as int8

    def broken(*args):
        raise RuntimeError("quantized::linear_prepack: simulated failure")

    monkeypatch.setattr(int8, "_prepack", broken)
    assert choose_dtype("auto", ZEN3).name == "float32"
    with pytest.raises(UnsupportedDtypeError, match="simulated failure"):
        choose_dtype("int8", ZEN3)


def test_cpuid_family_and_model_come_from_the_first_processor(tmp_path):
    """"AMD EPYC" names a Zen 3 (family 25 model 1) and a Zen 4 (family 25 model 17) alike; the numbers do not."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
                    "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
    assert cpuid(str(info)) == {"family": 25, "model_number": 1}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n")  # ARM: no such lines
    assert cpuid(str(info)) == {} and cpuid(str(tmp_path / "missing")) == {}


def test_onednn_held_below_a_feature_hides_its_flags(monkeypatch):
    """ONEDNN_MAX_CPU_ISA holds oneDNN below the CPU's ISA; slimroute's flags then follow what oneDNN may use, so
    a Zen 4 held to AVX512_CORE_VNNI is an Ice Lake to slimroute (its bf16 emulated) and held to AVX2 a Zen 3.
    fbgemm's AVX2 stays; an unknown value (oneDNN ignores it) holds nothing."""
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", " ".join(sorted(SAPPHIRE_RAPIDS.flags)))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_vnni")
    icelake = detect()
    assert icelake.onednn_cap == "AVX512_CORE_VNNI" and "oneDNN held to AVX512_CORE_VNNI" in icelake.describe()
    assert icelake.vnni and icelake.avx512 and icelake.emulated_bf16 and not (icelake.native_bf16 or icelake.amx)
    assert choose_dtype("auto", icelake).reason == "VNNI without native BF16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    zen3 = detect()
    assert zen3.avx2 and not (zen3.avx512 or zen3.vnni or zen3.onednn_bf16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert detect().amx and detect().onednn_cap is None  # holds nothing this CPU has
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "NOT_AN_ISA")
    assert detect().flags == SAPPHIRE_RAPIDS.flags


def test_every_cpu_kind_names_the_settings_that_hold_each_library_to_it():
    assert [kind.name for kind in KINDS] == ["avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx"]
    for kind in KINDS:
        settings = dict(kind.settings)
        assert settings["ONEDNN_MAX_CPU_ISA"] in ONEDNN_CAPS and "ATEN_CPU_CAPABILITY" in settings
        assert kind.fits(SAPPHIRE_RAPIDS)
    assert [kind.name for kind in KINDS if kind.fits(ZEN5)] == ["avx2", "avx512", "avx512-vnni", "avx512-bf16"]
    assert [kind.name for kind in KINDS if kind.fits(ZEN3)] == ["avx2"]
    assert not any(kind.fits(ARM) for kind in KINDS)


@pytest.mark.parametrize("cpu, dtype, bound, invariant", [
    (ZEN5, "int8", 0.0, True), (ZEN5, "bfloat16", 1e-5, True), (SKYLAKE, "bfloat16", None, False),
    (SAPPHIRE_RAPIDS, "bfloat16", None, False), (ZEN3, "float32", 1e-4, False)])
def test_each_dtype_says_what_it_gives_against_its_reference_on_each_cpu(cpu, dtype, bound, invariant):
    claim = exactness(dtype, cpu)
    assert (claim.max_abs_logprob_diff, claim.invariant) == (bound, invariant)
    said = str(claim)  # what `slimroute info` and `verify` print
    assert said.startswith("no bound" if bound is None else "bit for bit" if bound == 0.0 else f"within {bound:g}")
    assert ("not batch-invariant" in said) != invariant
    assert claim.holds(bound or 0.0) and (bound is None or not claim.holds(bound * 2 + 1e-9))


def test_flags_can_be_simulated(monkeypatch):
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", "avx2 fma")
    cpu = detect()
    assert cpu.avx2 and not cpu.avx512 and "simulated" in cpu.model


def test_cli_refuses_bfloat16_on_an_avx2_cpu_in_one_line(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", "avx2 fma f16c")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "1", "text": "refund my card"}) + "\n")
    for command in (["classify", str(src), "--out", str(out)], ["verify", str(src)]):
        result = CliRunner().invoke(app, [*command, "--labels", "billing,account", "--model", model_dir,
                                          "--dtype", "bfloat16"])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and "avx512bw" in result.output
        assert "auto, float32" in result.output
    assert not out.exists()


@needs_fbgemm
def test_cli_summary_says_which_dtype_auto_chose(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMROUTE_CPU_FLAGS", "avx2 fma f16c")
    src, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(["refund", "crash"])))
    result = CliRunner().invoke(app, ["classify", str(src), "--out", str(out), "--labels", "billing,account",
                                      "--model", model_dir, "--threads", "1", "--summary-json", str(summary)])
    assert result.exit_code == 0, result.output
    assert json.loads(summary.read_text())["dtype"] == "int8 (AVX2 without native BF16)"
    verify_json = tmp_path / "verify.json"
    result = CliRunner().invoke(app, ["verify", str(src), "--labels", "billing,account", "--model", model_dir,
                                      "--threads", "1", "--json", str(verify_json)])
    assert result.exit_code == 0, result.output
    record = json.loads(verify_json.read_text())
    assert (record["dtype"], record["dtype_reason"]) == ("int8", "AVX2 without native BF16")
    assert record["agreement"] == 1.0 and record["max_abs_logprob_diff"] == 0.0
