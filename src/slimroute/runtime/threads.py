"""Torch's threads, and the vector-math warm-up every process and thread count needs before its first forward pass."""

from __future__ import annotations

import functools
import os

import psutil
import torch


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def configure_threads(threads: int | None) -> int:
    threads = threads or physical_cores()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    warm_up_vector_math()  # before any forward pass: a thread's first vector-math call can round differently
    return threads


# torch's unary float functions that call MKL's vector math (VML) on a contiguous CPU tensor (aten/src/ATen/cpu/vml.h)
VECTOR_MATH = ("exp", "expm1", "log", "log10", "log1p", "log2", "sin", "cos", "tan", "sinh", "cosh", "tanh",
               "asin", "acos", "atan", "erf", "erfc", "sqrt", "rsqrt")
VECTOR_MATH_GRAIN = 2048  # elements per thread before ATen splits such a call over its threads


def warm_up_vector_math() -> None:
    """Call each of torch's vector-math functions once, over every thread, before a model runs: MKL's vector math
    can compute a worker thread's share of a process's first call differently from every later call, and a
    process's first forward pass (the prompt prefix's: rotary cos/sin) would then give other keys, and other
    log-probs, than every other process (docs/design.md). One call per function is enough; it costs about a
    millisecond, once per process and thread count (load_model and every Engine ask)."""
    _warm_up_vector_math(torch.get_num_threads())


@functools.cache
def _warm_up_vector_math(threads: int) -> None:
    x = torch.linspace(0.1, 0.9, VECTOR_MATH_GRAIN * 2 * max(1, threads))
    with torch.inference_mode():
        for name in VECTOR_MATH:
            getattr(torch, name)(x)
