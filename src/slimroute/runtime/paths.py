"""Where slimroute keeps what it makes once (converted checkpoints, int8 weights, compiled kernels), and the one
sha256 of files every checksum and cache key uses."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

CHUNK_BYTES = 1 << 22


def cache_dir() -> Path:
    """~/.cache/slimroute, or $SLIMROUTE_CACHE."""
    return Path(os.environ.get("SLIMROUTE_CACHE") or Path.home() / ".cache" / "slimroute")


def sha256_files(paths: Iterable[str | Path], copy_to: BinaryIO | None = None) -> str:
    """The sha256 hex digest of the files' bytes, one after another; with copy_to, the bytes are also written there
    (assembling a file from its parts while checking it)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
                if copy_to is not None:
                    copy_to.write(chunk)
    return digest.hexdigest()
