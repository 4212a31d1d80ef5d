"""What this CPU can run, and which dtype `--dtype auto` picks for it.

The fastest dtype whose fast path is batch-invariant here (the batched engine gives the one-at-a-time reference's
bits): int8 on x86 CPUs with AVX2 (integer GEMMs with per-row activation scales, invariant by construction; see
int8.py), float32 elsewhere (ARM, macOS, CPUs without AVX2) and on GPUs. bfloat16 (oneDNN's bf16 GEMMs, eager
attention, invariant where BF16 is native through AVX-512 BF16 alone) only where such a CPU has no VNNI for int8,
which no CPU we know of is: on an AMD EPYC with AVX-512 BF16 and VNNI (CPUID family 25 model 17, Zen 4), 2 threads,
bf16 ran 1.9x fp32 and int8 (oneDNN on AVX512-VNNI) 1.33x bf16 (`slimroute bench`, 600 tickets: 10.34 against
7.78 items/s; int8 through fbgemm, where oneDNN's probe fails, 1.29x).

CPUs with AMX (Intel Xeon since Sapphire Rapids) get int8 too: oneDNN runs bf16 there on AMX tiles, about as fast as
int8 (`slimroute bench`, 600 tickets, Intel Xeon with AMX, 2 threads: bf16 17.4, int8 17.7 items/s) but not
batch-invariant: a row's bits follow the GEMM's shape (bf16 fast path vs reference on 60 sample tickets: max |Δ
log-prob| 0.21, 3 labels flipped). Capping oneDNN below AMX (ONEDNN_MAX_CPU_ISA) restores invariance and costs
the speed (4.1 items/s, below fp32's 5.7). `--dtype bfloat16` still runs there, for whoever prefers speed to
bitwise answers (`verify` shows the differences).

The CPU's flags come from /proc/cpuinfo (or, elsewhere, torch's reported capability). SLIMROUTE_CPU_FLAGS
(space-separated flags) replaces them, to see what another CPU would get: tests simulate both CPU kinds with it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16", "int8")
ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
FLAGS_ENV = "SLIMROUTE_CPU_FLAGS"


class UnsupportedDtypeError(ValueError):
    """The requested dtype cannot run on this machine; the message names the missing feature and what works."""


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "DEFAULT", ...
    machine: str  # platform.machine(): x86_64, aarch64, arm64

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i686", "x86")

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags or self.capability in ("AVX2", "AVX512")

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def native_bf16(self) -> bool:
        """BF16 dot products in hardware (AVX-512 BF16 or AMX): bf16 GEMMs at about twice fp32's rate."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def onednn_bf16(self) -> bool:
        """What oneDNN's bf16 linear needs (its own words: avx_ne_convert, or avx512bw, avx512vl and avx512dq)."""
        return "avx_ne_convert" in self.flags or {"avx512bw", "avx512vl", "avx512dq"} <= self.flags

    @property
    def amx(self) -> bool:
        """AMX tiles, where oneDNN runs bf16 GEMMs whose rounding follows their shape (module docstring)."""
        return "amx_bf16" in self.flags

    @property
    def vnni(self) -> bool:
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    def describe(self) -> str:
        named = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
        shown = [f for f in named if f in self.flags]
        return f"{self.model} ({', '.join(shown) or 'no AVX2/AVX-512 flags'})"


def _proc_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.processor() or platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpuid(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, int]:
    """x86 CPUID family and model from /proc/cpuinfo, which tell apart CPUs of one name ("AMD EPYC": family 25 model
    1 is a Zen 3, model 17 a Zen 4; family 26 a Zen 5); empty elsewhere."""
    found: dict[str, int] = {}
    try:
        with open(cpuinfo_path) as cpuinfo:
            for line in cpuinfo:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key in ("cpu family", "model") and key not in found and value.isdigit():
                    found[key] = int(value)
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        pass
    return {"family": found["cpu family"], "model_number": found["model"]} if len(found) == 2 else {}


def detect() -> CpuFeatures:
    model, flags = _proc_cpuinfo()
    capability = torch.backends.cpu.get_cpu_capability()
    if os.environ.get(FLAGS_ENV) is not None:
        flags = frozenset(os.environ[FLAGS_ENV].split())
        capability = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "DEFAULT"
        model = f"{model} [flags simulated by {FLAGS_ENV}]"
    return CpuFeatures(model, flags, capability, platform.machine())


def int8_kernels_available(cpu: CpuFeatures) -> bool:
    """fbgemm's int8 GEMM is built into x86 torch, needs AVX2, and must pass a probe on a small layer."""
    if not (cpu.x86 and cpu.avx2 and "fbgemm" in torch.backends.quantized.supported_engines):
        return False
    from slimroute.int8 import int8_failure

    return int8_failure() is None


def normalise(name: str) -> str:
    name = ALIASES.get(str(name), str(name))
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    return name


def supported_dtypes(cpu: CpuFeatures, device: str = "cpu") -> list[str]:
    if torch.device(device).type != "cpu":
        return ["float32", "bfloat16"]
    names = ["float32"]
    if cpu.onednn_bf16:
        names.append("bfloat16")
    if int8_kernels_available(cpu):
        names.append("int8")
    return names


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # float32, bfloat16 or int8
    reason: str  # why, in a few words: shown in summaries, /health, bench and verify records

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_dtype(requested: str = "auto", cpu: CpuFeatures | None = None, device: str = "cpu") -> DtypeChoice:
    """Resolve --dtype: "auto" picks from the CPU; an explicit dtype is checked against it.

    Raises UnsupportedDtypeError (a ValueError: the CLI exits 2) naming the missing CPU feature."""
    requested = normalise(requested)
    cpu = cpu or detect()
    on_cpu = torch.device(device).type == "cpu"
    works = supported_dtypes(cpu, device)
    if requested != "auto":
        if requested not in works:
            why = missing_feature(requested, cpu, device)
            raise UnsupportedDtypeError(f"--dtype {requested} cannot run here: {why}. "
                                        f"Dtypes that work on this machine: auto, {', '.join(works)}")
        return DtypeChoice(requested, "requested")
    if not on_cpu:
        return DtypeChoice("float32", f"on {device}: batched within 1e-4 of the reference")
    bf16 = cpu.native_bf16 and cpu.onednn_bf16 and not cpu.amx  # invariant and twice fp32's rate (docstring)
    if (cpu.vnni or not bf16) and int8_kernels_available(cpu):
        if cpu.amx:
            return DtypeChoice("int8", "VNNI; bf16 on AMX is as fast but not batch-invariant")
        if bf16:
            return DtypeChoice("int8", "VNNI: faster than native BF16 on these CPUs")
        return DtypeChoice("int8", f"{'VNNI' if cpu.vnni else 'AVX2'} without native BF16")
    if bf16:
        return DtypeChoice("bfloat16", "native BF16 (AVX-512 BF16) and no VNNI for int8 on this CPU")
    return DtypeChoice("float32", "no native BF16 and no int8 kernels (fbgemm needs x86 AVX2) here")


def missing_feature(name: str, cpu: CpuFeatures, device: str = "cpu") -> str:
    """Why dtype `name` cannot run here, in a few words naming what is missing."""
    if torch.device(device).type != "cpu":
        return f"{name} runs on the CPU only"
    if name == "bfloat16":
        return (f"bfloat16 needs AVX-512 (avx512bw, avx512vl, avx512dq) or AVX-NE-CONVERT for oneDNN's bf16 "
                f"kernels; this CPU, {cpu.describe()}, has neither")
    if name == "int8":
        from slimroute.int8 import int8_failure

        failure = int8_failure() if cpu.x86 and cpu.avx2 else None
        if failure:
            return f"torch's int8 kernels failed on a small layer ({failure})"
        return f"int8 needs an x86 CPU with AVX2 and torch's fbgemm kernels; this is {cpu.describe()} on {cpu.machine}"
    return f"{name} is not available"
