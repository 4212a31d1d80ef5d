"""This CPU's facts: its model name, CPUID family and model, instruction-set flags, and what torch sees.

The flags come from /proc/cpuinfo (or, elsewhere, torch's reported capability). SLIMROUTE_CPU_FLAGS (space-separated
flags) replaces them, to see what another CPU would get: the tests simulate each CPU kind with it. Which dtype runs
where is dtypes.py's business.

Every flag slimroute decides by but AVX2 (fbgemm's) says what oneDNN may use: its AVX-512 GEMMs, BF16, VNNI and AMX
kernels. ONEDNN_MAX_CPU_ISA holds oneDNN below some of them (oneDNN reads it at its first call), so detect() drops
the flags above that cap: a Zen 4 held to AVX512_CORE_VNNI is an Ice Lake to slimroute as to oneDNN. KINDS are the
CPU kinds we know, each with the settings that hold oneDNN, ATen, fbgemm and MKL to it on a CPU that has more
(tests/cpu_kinds.py runs the dtype and kernel tests under each kind this CPU can be held to).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

FLAGS_ENV = "SLIMROUTE_CPU_FLAGS"
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # oneDNN's own switch, and its older name

_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
_VNNI_512 = _AVX512 | {"avx512_vnni", "avx_vnni"}  # (a VNNI level keeps the VEX form too: cpu.vnni either way)
_BF16_512 = _VNNI_512 | {"avx512_bf16"}
_FP16_512 = _BF16_512 | {"avx512_fp16"}
_AMX = _FP16_512 | {"amx_tile", "amx_int8", "amx_bf16"}
# The flags that only tell what oneDNN may use, and which of them each ONEDNN_MAX_CPU_ISA value (oneDNN's ISA names,
# old and new) keeps; a value not listed here (ALL, or one oneDNN ignores) holds nothing.
ONEDNN_GATED = _AMX | {"amx_fp16", "avx_vnni", "avx_ne_convert", "avx_vnni_int8"}
ONEDNN_CAPS: dict[str, frozenset[str]] = {
    "SSE41": frozenset(), "AVX": frozenset(), "AVX2": frozenset(),
    "AVX2_VNNI": frozenset({"avx_vnni"}), "AVX2_VNNI_2": frozenset({"avx_vnni", "avx_ne_convert", "avx_vnni_int8"}),
    "AVX512_CORE": _AVX512, "AVX512_CORE_VNNI": _VNNI_512, "AVX512_CORE_BF16": _BF16_512,
    "AVX512_CORE_FP16": _FP16_512, "AVX10_1_512": _FP16_512,
    "AVX512_CORE_AMX": _AMX, "AVX10_1_512_AMX": _AMX,
    "AVX512_CORE_AMX_FP16": _AMX | {"amx_fp16"}, "AVX10_1_512_AMX_FP16": _AMX | {"amx_fp16"},
}


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "DEFAULT", ...
    machine: str  # platform.machine(): x86_64, aarch64, arm64
    onednn_cap: str | None = None  # ONEDNN_MAX_CPU_ISA where it holds oneDNN below this CPU (its flags already say so)

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

    @property
    def emulated_bf16(self) -> bool:
        """oneDNN runs bf16 here without BF16 dot products: it converts to fp32 around fp32 arithmetic that it blocks
        by the GEMM's shape (AVX-512 without AVX512-BF16: Skylake, Cascade Lake, Ice Lake; AVX-NE-CONVERT), so a
        row's last bits follow the rows beside it."""
        return self.onednn_bf16 and not self.native_bf16

    def describe(self) -> str:
        named = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
        shown = [f for f in named if f in self.flags]
        held = f"; oneDNN held to {self.onednn_cap}" if self.onednn_cap else ""
        return f"{self.model} ({', '.join(shown) or 'no AVX2/AVX-512 flags'}{held})"


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
    cap = onednn_cap()
    if cap is not None and flags & ONEDNN_GATED - ONEDNN_CAPS[cap]:
        return CpuFeatures(model, flags - (ONEDNN_GATED - ONEDNN_CAPS[cap]), capability, platform.machine(), cap)
    return CpuFeatures(model, flags, capability, platform.machine())


def real_flags() -> frozenset[str]:
    """The flags of the CPU this runs on, less those ONEDNN_MAX_CPU_ISA holds oneDNN below: what code may be built
    for (never the flags SLIMROUTE_CPU_FLAGS simulates, which this CPU may lack)."""
    flags = _proc_cpuinfo()[1]
    cap = onednn_cap()
    return flags - (ONEDNN_GATED - ONEDNN_CAPS[cap]) if cap is not None else flags


def onednn_cap() -> str | None:
    """The ONEDNN_MAX_CPU_ISA value in effect, upper-cased, where it is one ONEDNN_CAPS knows (else None)."""
    value = next((os.environ[name] for name in ONEDNN_ISA_ENV if os.environ.get(name)), "").strip().upper()
    return value if value in ONEDNN_CAPS else None


@dataclass(frozen=True)
class CpuKind:
    """A kind of CPU the suite must pass on, and the settings that hold oneDNN, ATen, fbgemm and MKL to it on a CPU
    with more (each library's own switch; slimroute's flags follow oneDNN's: detect)."""

    name: str
    examples: str
    needs: frozenset[str]  # the flags a CPU must have to be held to this kind
    settings: tuple[tuple[str, str], ...]

    def fits(self, cpu: CpuFeatures) -> bool:
        return cpu.x86 and self.needs <= cpu.flags


_HELD_512 = (("ATEN_CPU_CAPABILITY", "avx512"),)
KINDS = (
    CpuKind("avx2", "AVX2 only: AMD Zen 2/3, Intel Haswell to Comet Lake", frozenset({"avx2", "fma"}),
            (("ONEDNN_MAX_CPU_ISA", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2"), ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2"),
             ("MKL_ENABLE_INSTRUCTIONS", "AVX2"))),
    CpuKind("avx512", "AVX-512 without VNNI: Intel Skylake-SP", frozenset({"avx2", "fma"}) | _AVX512 - {"avx512cd"},
            (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE"), *_HELD_512, ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512"),
             ("MKL_ENABLE_INSTRUCTIONS", "AVX512"))),
    CpuKind("avx512-vnni", "AVX-512 VNNI without BF16: Intel Cascade Lake, Ice Lake",
            frozenset({"avx2", "fma", "avx512_vnni"}) | _AVX512 - {"avx512cd"},
            (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI"), *_HELD_512, ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512_E1"),
             ("MKL_ENABLE_INSTRUCTIONS", "AVX512_E1"))),
    CpuKind("avx512-bf16", "AVX-512 BF16 and VNNI: AMD Zen 4/5, Intel Cooper Lake",
            frozenset({"avx2", "fma", "avx512_vnni", "avx512_bf16"}) | _AVX512 - {"avx512cd"},
            (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"), *_HELD_512, ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512_E1"),
             ("MKL_ENABLE_INSTRUCTIONS", "AVX512_E1"))),
    CpuKind("amx", "AMX: Intel Xeon Sapphire Rapids and later",
            frozenset({"avx2", "fma", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"}) | _AVX512 - {"avx512cd"},
            (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX"), *_HELD_512)),
)
