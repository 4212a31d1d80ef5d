"""The fp32 and bf16 linear layers' kernel: oneDNN's, where it runs, for every nn.Linear but the output head.

On AMD CPUs torch's default fp32 `nn.Linear` goes through MKL, which does not use AVX-512 there; oneDNN's linear gives
the same results faster, with each weight reordered once into oneDNN's blocked layout (the same bits out for every
batch shape). Where oneDNN's op is missing or raises, the model keeps torch's kernels (a one-line note)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from slimroute.runtime.memory import FileMappedMemory

log = logging.getLogger(__name__)

KERNELS = ("auto", "onednn", "default")
PACK_BATCH_HINT = 512  # rows per GEMM the blocked layout is chosen for (a batch's padded tokens)


class OneDNNLinear(nn.Module):
    """Drop-in for nn.Linear that calls oneDNN (private ops: torch is pinned).

    pack=True keeps only a copy of the weight reordered once into oneDNN's blocked layout (bit-identical
    results for every batch shape, checked in tests/test_linear.py) instead of letting oneDNN reorder it
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
