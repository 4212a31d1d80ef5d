"""This CPU's facts: its model name, CPUID family and model, instruction-set flags, and what torch sees.

The flags come from /proc/cpuinfo (or, elsewhere, torch's reported capability). SLIMROUTE_CPU_FLAGS (space-separated
flags) replaces them, to see what another CPU would get: the tests simulate each CPU kind with it. Which dtype runs
where is dtypes.py's business.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

FLAGS_ENV = "SLIMROUTE_CPU_FLAGS"


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
