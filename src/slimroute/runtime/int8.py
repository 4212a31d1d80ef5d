"""int8: every linear layer of the decoder as an integer GEMM, batch-invariant by construction.

Weights: symmetric int8 per output channel (scale = max |w| / 127). Activations: quantised per row, at every linear
layer, with the row's own scale (max |x| / act_max), then the kernel multiplies the integers with exact int32
accumulation and the output row is multiplied back by its scale. Nothing in a row's output depends on the other rows,
so a ticket gets the same bits alone or in a batch of 32. How many bits the activations get depends on the kernel
(ACTIVATIONS): fbgemm's 7 (act_max 63): on CPUs without VNNI it adds pairs of u8 x s8 products in int16
(vpmaddubsw), which saturates for 8-bit activations and int8 weights; with 7-bit activations no pair can overflow,
so its accumulation is exact on every x86 CPU. oneDNN's (taken on VNNI CPUs only, whose dot products add into int32
directly) 8 (act_max 127), twice the resolution (docs/dtypes.md). pick_kernel's probe checks the 8-bit products are
exact.

Embeddings, norms, attention (attention.py), the residual stream and the label scorer stay fp32; the output head
holds a lossless compact weight (output_head.py): a Q8_0 head runs integer dot products on it (int16 activations
per block of 32: Q8Head), any other head fp32 GEMMs in fixed-size row blocks, and either way its rows do not depend
on the batch. Before quantising, activation outliers are moved into the weights (smoothing.py), folded into
the layers in front.

Two kernels give the exact integer products (integers add exactly in any order; the scales multiply each output
element alike; fed the same integers, the same bits): fbgemm's (`torch.ops.quantized`, AVX2 and AVX512-VNNI) and
oneDNN's (`torch.ops.onednn.qlinear_pointwise`), which also runs on AMX tiles and on AVX-VNNI, where it is the
faster of the two (docs/dtypes.md has the rates). pick_kernel takes oneDNN on CPUs with any VNNI when a probe layer
gives exact products at 8 bits, else fbgemm.

The layers that read one input (q/k/v_proj, gate/up_proj) run as one GEMM over their stacked weights
(SharedProduct, Int8Slice): the same bits, fewer and wider calls. The elementwise work around the GEMMs (quantising
rows; a gated MLP's scales, silu, product and the down projection's quantising: Int8GatedMLP) runs in slimroute's
native kernels where they build here (elementwise(), native.py), else as eager torch ops: the same row-local
arithmetic either way.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from slimroute.runtime.cpu import detect
from slimroute.runtime.linear import KERNEL_ERRORS, failure_line
from slimroute.runtime.native import native

log = logging.getLogger(__name__)

WEIGHT_MAX = 127
# kernel -> (act_max, shift): a row's integers q, |q| <= act_max, go to fbgemm as floats (shift 0: it adds
# FBGEMM_ZERO_POINT itself, u8 in [1, 127]) and to oneDNN as uint8 q + shift (in [1, 255])
ACTIVATIONS = {"fbgemm": (63, 0), "onednn": (127, 128)}
FBGEMM_ZERO_POINT = 64


def activation_bits(kernel: str) -> int:
    """How many bits a kernel's activations get: |q| <= act_max, and a sign."""
    return ACTIVATIONS[kernel][0].bit_length() + 1



def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 and (N,) fp32 scales, symmetric per output channel."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1) / WEIGHT_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
    return q, scale


def _prepack(qweight: torch.Tensor, scale: torch.Tensor):
    zero = torch.zeros(scale.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch but are what fbgemm's ops take
        warnings.simplefilter("ignore")
        qtensor = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qtensor, None)


KERNELS = ("fbgemm", "onednn")


def _prepack_onednn(qweight: torch.Tensor, scale: torch.Tensor):
    # a copy of the scales: a tensor read from the int8 cache file keeps the whole file mapped, and its pages resident
    return (torch.ops.onednn.qlinear_prepack(qweight, None), scale.to(torch.float32, copy=True),
            torch.zeros(scale.shape[0], dtype=torch.long))


def int8_failure(kernel: str = "fbgemm") -> str | None:
    """Why the int8 kernel does not run here (None: it does), tried on a small layer."""
    try:
        Int8Linear.from_linear(nn.Linear(16, 8), kernel=kernel)(torch.ones(2, 16))
    except KERNEL_ERRORS as exc:
        return failure_line(exc)
    return None


_KERNEL: dict[str, str] = {}


ONEDNN_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")  # where oneDNN's int8 GEMM outruns fbgemm's (pick_kernel)


def pick_kernel(cpu=None) -> str:
    """oneDNN's int8 kernel where the CPU has a VNNI (AMX-INT8, AVX512-VNNI or AVX-VNNI) and a probe layer gives
    exact integer products through it, else fbgemm (decided once per process; a failing probe is logged in one line).
    With a VNNI oneDNN's GEMM is the faster; without one it is no faster on AVX2 and slower on AVX-512."""
    cpu = cpu or detect()
    if not set(ONEDNN_FLAGS) & cpu.flags:
        return "fbgemm"
    if "onednn" not in _KERNEL:
        _KERNEL["onednn"] = _onednn_problem()
        if _KERNEL["onednn"]:
            log.warning("int8: oneDNN's VNNI kernel is not used (%s); fbgemm's runs instead", _KERNEL["onednn"])
    return "fbgemm" if _KERNEL["onednn"] else "onednn"


def _onednn_problem() -> str:
    """"" when oneDNN's int8 linear runs here and its products are exact for its 8-bit activations (ACTIVATIONS), else
    what went wrong. With a VNNI its dot products add into int32; held below VNNI (ONEDNN_MAX_CPU_ISA=AVX2 or
    AVX512_CORE) its products were off by hundreds, for 7-bit activations too."""
    generator = torch.Generator().manual_seed(0)
    qweight, scale = quantize_weight(torch.randn(40, 96, generator=generator))
    act_max, shift = ACTIVATIONS["onednn"]
    ints = torch.randint(-act_max, act_max + 1, (5, 96), generator=generator).float()
    ints[0] = torch.where(qweight[0] >= 0, act_max, -act_max)  # the largest sum a row can have, on output 0
    try:
        got = Int8Linear(qweight, scale, None, kernel="onednn").integer_product((ints + shift).to(torch.uint8))
    except KERNEL_ERRORS as exc:
        return failure_line(exc)
    exact = (ints.double() @ qweight.double().T).float() * scale  # integer sums below 2**24: exact in fp32 too
    if not torch.equal(got, exact):
        return f"its integer products are not exact for {activation_bits('onednn')}-bit activations on this CPU"
    return ""


# The elementwise work around the integer GEMMs (quantising rows, the MLP's gate): torch ops here, one pass each in
# slimroute's native kernels (native.py) where those run. Each row's numbers depend on that row alone (elementwise ops,
# and a max, which is exact in any order), so batch invariance holds either way.
def _to_ints(rows: torch.Tensor, act_max: int, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) fp32 rows -> their integers round(x / scale), |q| <= act_max (floats; uint8 q + shift when shift),
    and the row scales (M, 1), scale = max |x| / act_max."""
    q = torch.abs(rows)
    scale = q.amax(dim=1, keepdim=True) / act_max  # max is exact in any order
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(rows, scale, out=q).round_()  # integers, as floats (|x|'s buffer)
    if shift:
        q = q.add_(shift).to(torch.uint8)  # exact: integers in shift +- act_max
    return q, scale


def _gated_to_ints(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor, act_max: int, shift: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's silu(gate * scale) * (up * scale), from the integer products of its gate and up projections and
    their input rows' scales, as the down projection's integers and row scales."""
    return _to_ints(F.silu(gate * scale) * (up * scale), act_max, shift)


class Eager:
    """The elementwise functions an int8 model's layers call, as torch ops (where the native kernels do not run)."""

    native = False
    to_ints = staticmethod(_to_ints)
    gated_to_ints = staticmethod(_gated_to_ints)


EAGER = Eager()


def elementwise():
    """What quantize_model gives a model: the native kernels (native.native(): one pass each, the same arithmetic)
    where they run here, else EAGER; SLIMROUTE_COMPILE=0 keeps them eager."""
    return native() or EAGER


class RowQuantizer:
    """Per-row activation quantisation, shared by the layers that read one input: q_proj, k_proj and v_proj (and
    gate_proj and up_proj) run one after the other on the same hidden states, so the first quantises them and the
    others, called with that very tensor, reuse the result; after the last member the result is dropped.

    The integers come as the kernel takes them (ACTIVATIONS): floats for fbgemm (it adds its zero point itself),
    uint8 q + shift for oneDNN (made in place: each pass over the activations counts at these sizes)."""

    def __init__(self, members: int = 1, kernel: str = "fbgemm", fused=EAGER):
        self.members = members
        self.kernel = kernel
        self.fused = fused
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._uses = 0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., K) -> the integers (M, K) (floats, or shifted uint8 for oneDNN) and their row scales (M, 1)."""
        if self._last is not None and self._last[0] is x:
            _, q, scale = self._last
        else:
            q, scale = self.fused.to_ints(x.reshape(-1, x.shape[-1]).float().contiguous(), *ACTIVATIONS[self.kernel])
            self._uses = 0
        self._uses += 1
        self._last = (x, q, scale) if self._uses < self.members else None
        return q, scale


class Int8Linear(nn.Module):
    """y = s_row * (q(x) @ W_q^T) * s_col + b, exact integer accumulation (fbgemm's or oneDNN's kernel)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 quantizer: RowQuantizer | None = None, kernel: str = "fbgemm"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if quantizer is not None and quantizer.kernel != kernel:
            raise ValueError(f"a RowQuantizer for {quantizer.kernel} cannot feed the {kernel} kernel")
        self.out_features, self.in_features = qweight.shape
        self.kernel = kernel
        self.packed = _prepack(qweight, scale) if kernel == "fbgemm" else _prepack_onednn(qweight, scale)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.quantizer = quantizer or RowQuantizer(kernel=kernel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantizer: RowQuantizer | None = None, kernel: str = "fbgemm"
                    ) -> Int8Linear:
        return cls(*quantize_weight(linear.weight), linear.bias, quantizer, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self.quantizer(x)  # (M, K), (M, 1)
        out = self.integer_product(q).mul_(scale)  # (M, N)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def integer_product(self, q: torch.Tensor) -> torch.Tensor:
        """(M, K) integers in the kernel's form -> (M, N) fp32 q @ W_q^T * s_col (not yet times the row scales)."""
        if self.kernel == "fbgemm":
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q, 1.0, FBGEMM_ZERO_POINT,
                                                                                     self.packed)
        weight, wscale, wzero = self.packed  # uint8 q + shift in, fp32 acc * 1.0 * weight scale out
        return torch.ops.onednn.qlinear_pointwise(q, 1.0, ACTIVATIONS["onednn"][1], weight, wscale, wzero, None, 1.0, 0,
                                                  torch.float32, "none", [], "")


class SharedProduct:
    """One GEMM for the layers that read one input (q/k/v_proj, gate/up_proj): their int8 weights stacked into one
    Int8Linear (one call over N_q + N_k + N_v columns runs closer to the CPU's rate than three; each output column is
    its own integer sum times its own scale, so the same bits as the layers alone). The first member called with an
    input runs it; the others, called with that very tensor, reuse it; after the last member it is dropped."""

    def __init__(self, linear: Int8Linear, members: int):
        self.linear, self.members = linear, members
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._uses = 0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., K) -> the stacked layers' products (M, N) (not yet times the row scales) and the row scales (M, 1)."""
        if self._last is not None and self._last[0] is x:
            _, products, scale = self._last
        else:
            q, scale = self.linear.quantizer(x)
            products = self.linear.integer_product(q)
            self._uses = 0
        self._uses += 1
        self._last = (x, products, scale) if self._uses < self.members else None
        return products, scale


class Int8Slice(nn.Module):
    """Output columns [start, end) of a SharedProduct, times the row scales, plus the layer's own bias: the layer it
    replaces (q_proj, k_proj...), to the bit."""

    def __init__(self, shared: SharedProduct, start: int, end: int, bias: torch.Tensor | None):
        super().__init__()
        self.shared, self.start, self.end = shared, start, end
        self.stacked = shared.linear  # a child module: GemmCalls and model.modules() find the one GEMM through it
        self.in_features, self.out_features = shared.linear.in_features, end - start
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products, scale = self.shared(x)
        out = products[:, self.start:self.end] * scale  # (M, N)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class Int8GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) (Qwen2, Llama, Mistral...) on the int8 layers: x quantised once, gate and up as one
    GEMM (gate_up: their stacked weights, gate's columns first), then their products' row scales, silu, the product
    and the down projection's quantisation in one function (elementwise().gated_to_ints: one pass in the native
    kernels), where the model's own MLP runs eight passes; the same arithmetic as that MLP."""

    def __init__(self, gate_up: Int8Linear, down_proj: Int8Linear, fused=EAGER):
        super().__init__()
        self.gate_up, self.down_proj = gate_up, down_proj
        self.intermediate = gate_up.out_features // 2
        self.activations = ACTIVATIONS[down_proj.kernel]
        self.fused = fused

    @staticmethod
    def replaces(mlp: nn.Module) -> bool:
        """Whether mlp is a gated SiLU MLP of float linear layers without biases, gate and up of one shape (what
        forward computes once they are int8)."""
        layers = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(mlp, "act_fn", None)
        if not all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers) or act is None:
            return False
        if layers[0].weight.shape != layers[1].weight.shape:
            return False
        probe = torch.linspace(-6, 6, 97)
        return set(dict(mlp.named_children())) == {"gate_proj", "up_proj", "down_proj", "act_fn"} and torch.equal(
            act(probe), F.silu(probe))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self.gate_up.quantizer(x)
        products = self.gate_up.integer_product(q)  # (M, 2I): gate's columns, then up's
        gate, up = products[:, :self.intermediate], products[:, self.intermediate:]
        hidden, hidden_scale = self.fused.gated_to_ints(gate, up, scale, *self.activations)
        out = self.down_proj.integer_product(hidden).mul_(hidden_scale)
        return out.view(*x.shape[:-1], self.down_proj.out_features)
