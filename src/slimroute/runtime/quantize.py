"""A whole model to int8 (int8.py's layers), once per checkpoint, cached.

`quantize_model` swaps every linear layer of the decoder for an Int8Linear, the layers that read one input (q/k/v_proj,
gate/up_proj) for slices of one GEMM over their stacked weights (Int8Slice), a gated SiLU MLP for an Int8GatedMLP,
and the output head for a Q8Head (a Q8_0 head's integer dot products) or a RowBlockedLinear on its lossless compact
form (output_head.py). Where slimroute's native kernels run, the model also gets its decoder as a few of them per
layer (fused.FusedDecoder), which the engine runs and the reference does not. Activation outliers are first smoothed
into the weights (smoothing.py). The int8 weights, the norms and biases smoothing changed and the compact head (in the
checkpoint's order) are written to one file next to the checkpoint (int8_cache_file); a later load reads only that
file and never touches the fp32 linear weights' pages.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from slimroute.runtime.int8 import (
    EAGER,
    WEIGHT_MAX,
    Int8GatedMLP,
    Int8Linear,
    Int8Slice,
    RowQuantizer,
    SharedProduct,
    elementwise,
    quantize_weight,
)
from slimroute.runtime.linear import onednn_failure
from slimroute.runtime.memory import FileMappedMemory, return_freed_memory
from slimroute.runtime.output_head import Q8Head, RowBlockedLinear, compact_head
from slimroute.runtime.paths import cache_dir, sha256_files
from slimroute.runtime.smoothing import smoothed_weight, smoothing_factors

log = logging.getLogger(__name__)

# Part of the cache key: change it when the cached numbers or keys change (docs/design.md has the history).
SCHEME = f"w{WEIGHT_MAX}-smooth-v5"


def int8_cache_file(source: Path | str) -> Path | None:
    """Where the quantised weights of a checkpoint folder are kept: next to a converted checkpoint (its folder name
    carries the GGUF's sha256), or under the cache keyed by the checkpoint's sha256 (a hub snapshot: its commit)."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    if folder.parent == cache_dir() / "converted":
        return folder / f"int8-{SCHEME}.safetensors"
    if folder.parent.name == "snapshots":  # the HF hub cache: the folder name is the commit
        key = f"{folder.parent.parent.name}-{folder.name[:16]}"
    else:
        key = f"{folder.name}-{sha256_files(sorted(folder.glob('*.safetensors')))[:16]}"
    return cache_dir() / "int8" / f"{key}-{SCHEME}.safetensors"


def quantize_model(model: nn.Module, cache_file: Path | None = None, tokenizer=None, kernel: str = "fbgemm",
                   native: bool | None = None) -> None:
    """Turn `model` into its int8 form in place (module docstring). tokenizer: smooth first (one fp32 pass over fixed
    calibration prompts; none without it). native: None to use slimroute's native kernels where they run here
    (int8.elementwise), False for the eager torch ops."""
    head = model.get_output_embeddings()
    targets = {name: module for name, module in model.named_modules() if type(module) is nn.Linear
               and module is not head}
    gated = [name for name, module in model.named_modules() if Int8GatedMLP.replaces(module)]
    fused = elementwise() if native is None else EAGER if not native else _required_native()
    checkpoint = FileMappedMemory()  # the fp32 weights' pages, handed back once their int8 form replaced them
    weights = Int8Weights(cache_file)
    if weights.stored is None and tokenizer is not None:
        weights.smooth(model, tokenizer)
    with weights:
        _swap_linears(model, targets, weights, kernel, fused, checkpoint)
    _set_smoothed_params(model, weights.params, targets)
    for name in gated:
        mlp = model.get_submodule(name)
        gate, up = mlp.gate_proj, mlp.up_proj
        if isinstance(gate, Int8Slice) and gate.start == 0 and isinstance(up, Int8Slice) and up.shared is gate.shared:
            _replace(model, name, Int8GatedMLP(mlp.gate_proj.stacked, mlp.down_proj, fused))
    compact = _compact_head(head, weights, checkpoint)
    weights.save()  # before _swap_head: a Q8Head reorders the compact head's int8 values in place
    _swap_head(model, head, compact, fused)
    _warn_about_experts(model)
    return_freed_memory()  # the quantisation's and packing's temporaries


class Int8Weights:
    """A checkpoint's int8 cache file: what it holds (read while the file is open; `stored`), or what is made now
    (`made`: written by save()). `params` are the norms' and biases' new values, `factors` the smoothing factors."""

    def __init__(self, path: Path | None):
        self.path = path
        self.stored = path if path is not None and path.is_file() else None
        self.factors: dict[str, tuple] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.head: dict[str, torch.Tensor] | None = None  # the stored compact head ({} when the file has none)
        self.made: dict[str, torch.Tensor] = {}
        self._file = self._pages = None

    def smooth(self, model: nn.Module, tokenizer) -> None:
        self.factors, self.params = smoothing_factors(model, tokenizer)
        self.made.update({f"param.{name}": value.contiguous() for name, value in self.params.items()})

    def __enter__(self) -> Int8Weights:
        if self.stored is not None:
            # The file's tensors are views of its mapping: whatever is kept is copied, and the pages read are handed
            # back as soon as they are used (else the whole file sits in the RSS beside its copies: the load's peak).
            self._file, self._pages = safe_open(str(self.stored), "pt").__enter__(), FileMappedMemory()
            keys = list(self._file.keys())
            self.params = {key[len("param."):]: self._copied(key) for key in keys if key.startswith("param.")}
            self.head = {key: self._copied(key) for key in keys if key.startswith("head.")}
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.__exit__(*exc)
            self._file = None

    def _copied(self, key: str) -> torch.Tensor:
        tensor = self._file.get_tensor(key)
        copy = tensor.clone()
        self._pages.release(tensor)
        return copy

    def linear(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 weight, scales) of the linear layer `name`: stored, or quantised now from its (smoothed) weight."""
        if self._file is not None:
            return self._file.get_tensor(f"{name}.qweight"), self._file.get_tensor(f"{name}.scale")
        qweight, scale = quantize_weight(smoothed_weight(weight, self.factors.get(name)))
        self.made[f"{name}.qweight"], self.made[f"{name}.scale"] = qweight, scale
        return qweight, scale

    def packed(self, *tensors: torch.Tensor) -> None:
        """The layer holds its own packed copy of these now: their file pages go back."""
        if self._pages is not None:
            for tensor in tensors:
                self._pages.release(tensor)

    def save(self) -> None:
        if not self.made or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".int8-", suffix=".tmp")
            os.close(fd)
            save_file(self.made, tmp, metadata={"scheme": SCHEME})
            os.replace(tmp, self.path)
            _drop_earlier_schemes(self.path)
        except OSError as exc:  # a read-only cache costs the next load a few seconds, nothing more
            log.warning("could not cache the int8 weights at %s (%s); they will be quantised again next time",
                        self.path, exc)


def _swap_linears(model: nn.Module, targets: dict[str, nn.Linear], weights: Int8Weights, kernel: str,
                  fused, checkpoint: FileMappedMemory) -> None:
    """Every target becomes int8: alone an Int8Linear; with the layers that read the same input (_input_group) one
    Int8Linear over their stacked weights, each of them a slice of its output (Int8Slice)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in targets:
        groups.setdefault(_input_group(name), []).append(name)
    for names in groups.values():
        if len({targets[name].in_features for name in names}) > 1:  # not one input after all: one GEMM each
            for name in names:
                _swap_group(model, [name], targets, weights, kernel, fused, checkpoint)
        else:
            _swap_group(model, names, targets, weights, kernel, fused, checkpoint)


def _swap_group(model, names: list[str], targets: dict[str, nn.Linear], weights: Int8Weights, kernel: str, fused,
                checkpoint: FileMappedMemory) -> None:
    parts = [weights.linear(name, targets[name].weight) for name in names]
    biases = [weights.params.get(f"{name}.bias", targets[name].bias) for name in names]
    quantizer = RowQuantizer(kernel=kernel, fused=fused)
    if len(names) == 1:
        _replace(model, names[0], Int8Linear(*parts[0], biases[0], quantizer, kernel))
    else:
        stacked = Int8Linear(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), None, quantizer,
                             kernel)
        shared, start = SharedProduct(stacked, len(names)), 0
        for name, (qweight, _), bias in zip(names, parts, biases, strict=True):
            _replace(model, name, Int8Slice(shared, start, start + qweight.shape[0], bias))
            start += qweight.shape[0]
    for name, (qweight, scale) in zip(names, parts, strict=True):
        checkpoint.release(targets[name].weight)
        weights.packed(qweight, scale)


def _required_native():
    """native=True: the native kernels, or the reason they do not run here."""
    kernels = elementwise()
    if not kernels.native:
        raise RuntimeError("slimroute's native kernels do not run here (see the log's note)")
    return kernels


def _set_smoothed_params(model: nn.Module, params: dict[str, torch.Tensor], targets: dict) -> None:
    """The norms' weights (and the biases of layers that are not int8 now) with smoothing's divisions folded in."""
    for name, value in params.items():
        if not name.endswith(".bias") or name.rpartition(".")[0] not in targets:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, nn.Parameter(value, requires_grad=False))


def _compact_head(head: nn.Linear, weights: Int8Weights, checkpoint: FileMappedMemory) -> dict | None:
    """The output head's compact form (compact_head): the stored one (none in the file: it has none), else made now
    and added to what gets cached; None where it has none or is not on the CPU. The fp32 weight's file pages are
    then handed back (a tied embedding reads the few rows it needs from the file again)."""
    if head.weight.device.type != "cpu":
        return None
    if weights.head is not None:
        compact = weights.head or None
    else:
        compact = compact_head(head.weight.data, checkpoint.release)
        if compact and weights.path is not None:
            weights.made.update({key: value.contiguous() for key, value in compact.items()})
    if compact:
        checkpoint.release(head.weight)
    return compact


def _swap_head(model: nn.Module, head: nn.Linear, compact: dict | None, fused) -> None:
    """The output head becomes a Q8Head on a Q8_0 head's compact form (integer dot products, on the native kernels
    where they run), else a RowBlockedLinear (on the compact form where there is one)."""
    if compact and "head.q8" in compact:
        replacement = Q8Head(compact, head.bias, fused if fused.native else None)
    else:
        onednn = head.weight.device.type == "cpu" and onednn_failure(head.weight.dtype) is None
        replacement = RowBlockedLinear(head, onednn, compact)
    for name, module in model.named_modules():
        if module is head:
            _replace(model, name, replacement)


def _warn_about_experts(model: nn.Module) -> None:
    if experts := [name for name, param in model.named_parameters() if param.dim() == 3]:
        log.warning("int8: %d mixture-of-experts weight(s) (%s...) are not linear layers and stay fp32, on torch's "
                    "kernels: answers come within ~1e-5 of the int8 reference, not bit for bit", len(experts),
                    experts[0])


def _input_group(name: str) -> tuple[str, str]:
    """Layers that read the same input share a quantiser: q/k/v_proj, and gate/up_proj (Qwen2, Llama, Mistral...)."""
    parent, _, leaf = name.rpartition(".")
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return parent, shared.get(leaf, leaf)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _drop_earlier_schemes(path: Path) -> None:
    """An earlier scheme's int8 file for the same checkpoint (int8_cache_file's name with another SCHEME) is never
    read again: removed, not left to hold its 0.1-0.5 GB in the cache."""
    suffix = f"{SCHEME}.safetensors"
    if not path.name.endswith(suffix):
        return
    for old in path.parent.glob(f"{path.name[:-len(suffix)]}w*-smooth-*.safetensors"):
        if old != path:
            try:
                old.unlink()
                log.info("removed %s, an earlier int8 scheme's cache", old)
            except OSError:
                pass
