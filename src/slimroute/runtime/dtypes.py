"""Which dtype runs on this CPU, and which one `--dtype auto` picks.

The fastest dtype whose fast path is batch-invariant here (the batched engine gives the one-at-a-time reference's
bits): int8 on x86 CPUs with AVX2 (integer GEMMs with per-row activation scales, invariant by construction: int8.py),
float32 elsewhere (ARM, macOS, CPUs without AVX2) and on GPUs. bfloat16 (oneDNN's bf16 GEMMs, eager attention,
invariant where BF16 is native through AVX-512 BF16 alone) only where such a CPU has no VNNI for int8, which no CPU we
know of is: with VNNI, int8 is the faster of the two. CPUs with AMX get int8 too: there oneDNN runs bf16 on AMX tiles,
about as fast, but a row's bits follow the GEMM's shape (not batch-invariant). docs/dtypes.md has the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimroute.runtime.cpu import CpuFeatures, detect
from slimroute.runtime.int8 import int8_failure

DTYPE_NAMES = ("auto", "float32", "bfloat16", "int8")
ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
# The torch dtype each --dtype loads the checkpoint in (int8 loads fp32, then quantises the linear layers).
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}


class UnsupportedDtypeError(ValueError):
    """The requested dtype cannot run on this machine; the message names the missing feature and what works."""


def int8_kernels_available(cpu: CpuFeatures) -> bool:
    """fbgemm's int8 GEMM is built into x86 torch, needs AVX2, and must pass a probe on a small layer."""
    if not (cpu.x86 and cpu.avx2 and "fbgemm" in torch.backends.quantized.supported_engines):
        return False
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


@dataclass(frozen=True)
class Exactness:
    """What the batched fast path gives against the one-at-a-time reference in one dtype on one CPU: the bound the
    tests hold it to (0: bit for bit; None: none is claimed) and whether each answer is independent of the batch (if
    not, a near-tie's label can flip)."""

    max_abs_logprob_diff: float | None
    invariant: bool
    why: str

    def __str__(self) -> str:
        diff = self.max_abs_logprob_diff
        bound = "no bound" if diff is None else "bit for bit" if diff == 0.0 else f"within {diff:g}"
        return f"{bound}{'' if self.invariant else ', not batch-invariant'} ({self.why})"

    def holds(self, max_abs_logprob_diff: float) -> bool:
        return self.max_abs_logprob_diff is None or max_abs_logprob_diff <= self.max_abs_logprob_diff


FLOAT32_BOUND = 1e-4  # fp32 kernels block by shape: the last bits of a row follow its batch
BF16_NATIVE_BOUND = 1e-5  # native BF16 dot products: the same bits but for the normaliser's fp32 rounding
# oneDNN's bf16 without BF16 instructions (Skylake to Ice Lake) has no bound that holds for every model: each GEMM's
# output is fp32 arithmetic blocked by the GEMM's shape, rounded to bf16, so a value near a rounding boundary moves by
# one bf16 step (0.4%) with the batch. Held to Ice Lake on a Zen 4 (2026-12-07, docs/dtypes.md): the default model
# 8.3e-6 on the 600 sample tickets, SmolLM2-135M 0.08 on the first 100 (all labels kept), the tests' tiny Llama 2.5e-5.


def exactness(name: str, cpu: CpuFeatures | None = None, device: str = "cpu") -> Exactness:
    """What `name` (a resolved dtype) gives on this CPU against its own reference (docs/dtypes.md)."""
    cpu = cpu or detect()
    if name == "int8":
        return Exactness(0.0, True, "integer GEMMs and fixed-order fp32 ops: batch-invariant by construction")
    if name == "bfloat16" and torch.device(device).type == "cpu":
        if cpu.amx:
            return Exactness(None, False, "oneDNN runs bf16 on AMX tiles, whose rounding follows the GEMM's shape "
                             "(up to 0.2 nats measured): near-ties can flip; --dtype int8 is bit for bit")
        if cpu.native_bf16:
            return Exactness(BF16_NATIVE_BOUND, True, "native BF16 dot products and eager attention")
        return Exactness(None, False, "no AVX512-BF16 here: oneDNN emulates bf16, fp32 arithmetic blocked by the "
                         "GEMM's shape and rounded to bf16, so a row's log-probs move with its batch (up to 0.08 "
                         "measured) and near-ties can flip; --dtype int8 is bit for bit")
    return Exactness(FLOAT32_BOUND, False, "fp32 kernels block by shape: a row's last bits follow its batch")


def missing_feature(name: str, cpu: CpuFeatures, device: str = "cpu") -> str:
    """Why dtype `name` cannot run here, in a few words naming what is missing."""
    if torch.device(device).type != "cpu":
        return f"{name} runs on the CPU only"
    if name == "bfloat16":
        return (f"bfloat16 needs AVX-512 (avx512bw, avx512vl, avx512dq) or AVX-NE-CONVERT for oneDNN's bf16 "
                f"kernels; this CPU, {cpu.describe()}, has neither")
    if name == "int8":
        failure = int8_failure() if cpu.x86 and cpu.avx2 else None
        if failure:
            return f"torch's int8 kernels failed on a small layer ({failure})"
        return f"int8 needs an x86 CPU with AVX2 and torch's fbgemm kernels; this is {cpu.describe()} on {cpu.machine}"
    return f"{name} is not available"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype a --dtype name loads the checkpoint in ("auto" must be resolved first: choose_dtype)."""
    if isinstance(name, torch.dtype):
        return name
    name = normalise(name)
    if name == "auto":
        raise ValueError("dtype 'auto' must be resolved with slimroute.runtime.dtypes.choose_dtype first")
    return TORCH_DTYPES[name]
