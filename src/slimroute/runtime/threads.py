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
    """Call each of torch's vector-math functions once, over every thread, before a model runs. Measured with torch
    2.13 (MKL VML) on an Intel Xeon, 2 threads: a process's first torch.log over 12800 floats gave the second
    thread's half off the correctly rounded values (5714 of them) in 3 of 4 processes, every later call none;
    the first torch.cos did the same in a third of processes. The first forward pass of a process computes the
    rotary cos/sin, so in those processes the cached prompt prefix (the first pass) had keys off by up to 8e-3 in
    layer 0, and the same ticket got other log-probs than in every other process (int8: -1.369 or -1.567 against
    -1.289, 1 process in 4-10). One call per function in the process is enough (later threads read correct
    values); it costs about a millisecond, once per process and thread count (load_model and every Engine ask)."""
    _warm_up_vector_math(torch.get_num_threads())


@functools.cache
def _warm_up_vector_math(threads: int) -> None:
    x = torch.linspace(0.1, 0.9, VECTOR_MATH_GRAIN * 2 * max(1, threads))
    with torch.inference_mode():
        for name in VECTOR_MATH:
            getattr(torch, name)(x)
