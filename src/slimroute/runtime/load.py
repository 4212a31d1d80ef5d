"""Load a causal LM and its tokenizer from a packaged name, a Hugging Face repo id or folder, or a .gguf file, and
prepare it for this CPU in the chosen dtype (kernels, attention, int8 quantisation).

GGUF files are dequantised once by transformers and kept as a converted copy (safetensors + config + tokenizer) under
the cache directory, so later loads take seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimroute.runtime.attention import set_attention
from slimroute.runtime.dtypes import TORCH_DTYPES, DtypeChoice, choose_dtype
from slimroute.runtime.fingerprint import remember_fingerprint
from slimroute.runtime.fused import fuse
from slimroute.runtime.int8 import pick_kernel
from slimroute.runtime.linear import set_linear_kernels
from slimroute.runtime.packaged import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    ModelNotFoundError,
    fetch_packaged_gguf,
    packaged_help,
)
from slimroute.runtime.paths import cache_dir, sha256_files
from slimroute.runtime.quantize import int8_cache_file, quantize_model
from slimroute.runtime.threads import configure_threads

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype  # of the model's parameters (float32 for int8: embeddings, norms and head stay fp32)
    device: torch.device
    threads: int
    kernels: str = "default"
    attention: str = "sdpa"
    precision: str = "float32"  # float32, bfloat16 or int8: what --dtype resolved to
    precision_reason: str = "requested"  # why (e.g. "AVX2 without native BF16" for --dtype auto)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def converted_dir_for(gguf_path: Path, sha256: str | None = None) -> Path:
    sha256 = sha256 or sha256_files([gguf_path])
    return cache_dir() / "converted" / f"{gguf_path.stem}-{sha256[:16]}"


def convert_gguf(gguf_path: Path, sha256: str | None = None) -> Path:
    """Dequantise a GGUF once into safetensors + config + tokenizer; written atomically."""
    target = converted_dir_for(gguf_path, sha256)
    if (target / "model.safetensors").is_file():
        return target
    log.warning("converting %s once into %s (dequantising takes a while)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        kw = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
        # A GGUF-loaded model refuses save_pretrained; its layers are plain fp32 nn.Linear.
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf_path}\n")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(spec: str) -> Path | str:
    """Map a model spec to something `from_pretrained` can load (a folder or a repo id)."""
    if spec in PACKAGED_MODELS:
        pm = PACKAGED_MODELS[spec]
        done = converted_dir_for(Path(pm.gguf_name), pm.sha256)
        if (done / "model.safetensors").is_file():
            return done
        return convert_gguf(fetch_packaged_gguf(spec), pm.sha256)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r} does not exist.\n{packaged_help()}")
        return convert_gguf(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"folder {spec!r} has no config.json: not a Hugging Face model folder")
        return path
    if spec.count("/") == 1 and not path.exists() and not spec.startswith((".", "/")):
        return spec  # a hub repo id (hub or local HF cache)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not a packaged name, a HF repo id, a model folder or a .gguf file.\n"
        f"{packaged_help()}"
    )


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype | DtypeChoice = "auto",
    threads: int | None = None,
    device: str = "cpu",
    kernels: str = "auto",
    attention: str = "auto",
) -> LoadedModel:
    """dtype: "auto" (the fastest batch-invariant dtype for this CPU: dtypes.py), "float32", "bfloat16" or "int8"
    (int8.py), or a DtypeChoice already made (dtypes.choose_dtype: then it is not chosen again); a dtype the CPU
    cannot run raises dtypes.UnsupportedDtypeError naming the missing feature.
    kernels: "auto" (oneDNN linear on CPU when it works here), "onednn" or "default" (plain torch).
    attention: "auto" (eager for bf16 on CPU, the batch-invariant kernel for int8, sdpa otherwise), "eager", "sdpa"
    or "invariant" (attention.pick_attention)."""
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    choice = dtype if isinstance(dtype, DtypeChoice) else choose_dtype(dtype, device=device)
    torch_dtype = TORCH_DTYPES[choice.name]
    threads = configure_threads(threads)
    source = resolve(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {spec!r}: {exc}\n{packaged_help()}") from exc
    model.to(device).eval()
    remember_fingerprint(model)  # of the checkpoint's weights, before int8 smoothing changes its norms (head.py)
    if choice.name == "int8":
        kernel = pick_kernel()
        quantize_model(model, int8_cache_file(source), tokenizer, kernel)
        used = f"int8 ({kernel})"
    else:
        used = set_linear_kernels(model, kernels)
    attn = set_attention(model, attention)
    if choice.name == "int8" and (why := fuse(model)) is None:
        used += ", fused layers"
    elif choice.name == "int8":
        log.info("int8: the decoder runs as the model's own modules, not fused (%s)", why)
    return LoadedModel(spec, model, tokenizer, torch_dtype, torch.device(device), threads, used, attn,
                       choice.name, choice.reason)
