"""Linear-layer kernels. On this class of CPU torch's default fp32 `nn.Linear` goes through MKL,
which does not use AVX-512 on AMD; oneDNN's linear gives the same results about 1.8x faster
in fp32 and about 1.2x faster in bf16. Weights are reordered once into oneDNN's blocked layout
(same bits out, about 10% less time per batch in bf16 on 600 tickets)."""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys

import torch
from torch import nn

log = logging.getLogger(__name__)

KERNELS = ("auto", "onednn", "default")
ATTENTION = ("auto", "eager", "sdpa", "invariant")
PACK_BATCH_HINT = 512  # rows per GEMM the blocked layout is chosen for (a batch's padded tokens)


class OneDNNLinear(nn.Module):
    """Drop-in for nn.Linear that calls oneDNN (private ops: torch is pinned).

    pack=True keeps only a copy of the weight reordered once into oneDNN's blocked layout (bit-identical
    results for every batch shape, checked in tests/test_kernels.py) instead of letting oneDNN reorder it
    on every call. The output head stays plain: the label scorer reads its rows, and it may be tied to the
    input embeddings (packing would hold it twice); it runs once per item, where packing gains little.
    """

    def __init__(self, linear: nn.Linear, pack: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias, self.packed = linear.bias, pack
        # packed: a plain (oneDNN) tensor attribute, not a Parameter
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT) if pack \
            else linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        weight = nn.Parameter(self.weight.to_dense(), requires_grad=False) if self.packed else self.weight
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta", dtype=weight.dtype)
        linear.weight, linear.bias = weight, self.bias
        return linear


def onednn_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and dtype in (torch.float32, torch.bfloat16)
    )


def set_linear_kernels(model: nn.Module, kernels: str = "auto") -> str:
    """Swap every nn.Linear for oneDNN (or back); returns the kernels in use.

    "auto" first tries oneDNN on one small layer of the model's dtype: where its op is missing or raises (another
    build of torch, an ARM CPU, bf16 on a CPU oneDNN's bf16 path refuses) the model keeps torch's default kernels
    and a one-line note says why."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    param = next(model.parameters())
    use = kernels == "onednn" or (kernels == "auto" and onednn_available(param.device, param.dtype))
    if use and not onednn_available(param.device, param.dtype):
        raise ValueError(f"oneDNN kernels need a CPU model in float32 or bfloat16, got {param.device}/{param.dtype}")
    if use:
        failure = onednn_failure(param.dtype)
        if failure and kernels == "onednn":
            raise ValueError(f"oneDNN kernels do not work here: {failure}")
        if failure:
            log.warning("oneDNN linear kernels unavailable here (%s); using torch's default kernels", failure)
            use = False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    mapped = FileMappedMemory() if use else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if use and type(child) is nn.Linear:
                pack = child is not head
                setattr(parent, name, OneDNNLinear(child, pack=pack))
                if pack:
                    mapped.release(child.weight)
            elif not use and isinstance(child, OneDNNLinear):
                setattr(parent, name, child.to_linear())
    return "onednn" if use else "default"


KERNEL_ERRORS = (RuntimeError, AttributeError, NotImplementedError)  # how a special kernel fails (AttributeError:
# its op is missing from this torch build)


def failure_line(exc: Exception) -> str:
    """A kernel's exception as one line for a note."""
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


def onednn_failure(dtype: torch.dtype) -> str | None:
    """Why oneDNN's packed linear does not run here in this dtype (None: it does); tried on a small layer."""
    try:
        probe = OneDNNLinear(nn.Linear(16, 8).to(dtype), pack=True)
        probe(torch.ones(2, 16, dtype=dtype))
    except KERNEL_ERRORS as exc:
        return failure_line(exc)
    return None


class FileMappedMemory:
    """Hands back the pages of a weight that was read from a memory-mapped checkpoint once it has been packed.

    transformers loads safetensors through mmap, so an fp32 weight is the file's own pages; packing reads
    them, and they stay in the RSS as long as the mapping lives, which other tensors of the file (the
    embeddings) keep alive: +1.4 GB for the 0.5B model in fp32 (a 4.1 GB peak instead of 2.7 GB).
    madvise(MADV_DONTNEED) drops the clean pages; they would be read from the file again if anything
    touched them, and nothing does: the packed copy replaced the weight. Weights in anonymous memory
    (converted to bf16 at load, say) are left alone: they are freed with the module."""

    MADV_DONTNEED = 4

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self.libc = None
        if sys.platform.startswith("linux"):
            try:
                self.libc = ctypes.CDLL(None, use_errno=True)
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6 and fields[5].startswith("/"):  # a file, not heap / anon / [vdso]
                            start, end = (int(x, 16) for x in fields[0].split("-"))
                            self.ranges.append((start, end))
            except OSError:
                self.libc = None

    def release(self, weight: torch.Tensor) -> None:
        if self.libc is None or weight.device.type != "cpu":
            return
        start, size, page = weight.data_ptr(), weight.numel() * weight.element_size(), mmap.PAGESIZE
        if not any(lo <= start and start + size <= hi for lo, hi in self.ranges):
            return
        first, last = -(-start // page) * page, (start + size) // page * page  # whole pages inside the weight
        if last > first:
            self.libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), self.MADV_DONTNEED)


def return_freed_memory() -> None:
    """Hand glibc's cached free heap back to the system (malloc_trim): loading and packing weights frees
    hundreds of MB of temporaries that would otherwise stay in the RSS. A no-op where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


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


def pick_attention(device: torch.device | str, dtype: torch.dtype, attention: str = "auto", int8: bool = False) -> str:
    """"auto": the batch-invariant kernel (attention.py) for int8, eager for bf16 on CPU, else sdpa.

    Why: bf16 results must not depend on the batch. Its GEMMs (oneDNN, fp32 accumulation) give each row
    the same bits whatever the other rows, but SDPA's CPU flash kernel picks its block sizes from the
    sequence lengths, so a cached prefix or a padded batch rounds differently from the one-at-a-time
    prompt (measured: 1-4% of labels flipped, max |Δ log-prob| 0.2). Eager attention (bf16 matmuls, fp32
    softmax; padded keys add exact zeros) made the fast path bit-identical to the reference on the 600
    tickets. int8 needs more: every fp32 op must give the same bits, or a row quantises differently; eager's
    matmuls still follow the padded shapes on AVX2, the invariant kernel does not. fp32 differences are ~1e-5
    either way, so fp32 keeps the kernel that measured faster."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if attention != "auto":
        return attention
    if int8:
        return "invariant"
    return "eager" if torch.device(device).type == "cpu" and dtype == torch.bfloat16 else "sdpa"


def set_attention(model: nn.Module, attention: str = "auto") -> str:
    """Set the attention implementation (the reference and the engine share it); returns the one in use."""
    from slimroute.int8 import Int8Linear

    param = next(model.parameters())
    int8 = any(isinstance(m, Int8Linear) for m in model.modules())
    used = pick_attention(param.device, param.dtype, attention, int8)
    if used == "sdpa" and not getattr(model, "_supports_sdpa", True):
        used = "eager"  # Gemma 2: torch's sdpa cannot soft-cap its scores
    if used == "invariant":
        from slimroute.attention import register

        model.set_attn_implementation(register())
    else:
        model.set_attn_implementation(used)
    return used
