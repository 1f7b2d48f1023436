"""Which weights a model name stands for, so that KV computed with other weights is never loaded.

Engines hand their plug-ins a model *name* (vLLM 0.33's offloading config: the model path or
hub id; SGLang's HiCache storage config: the model path), not the weights' revision or
quantization. A persistent tier outlives the engine: update the weights in place under the
same name, and the old model's KV would be loaded. `weights_identity` tells the weights apart
where it can, and the integrations put it into the namespace:

- a local model directory: a digest of its configuration files (`config.json` carries a
  quantized checkpoint's `quantization_config`) and of each weight file's name, size and
  modification time;
- a hub id with a local Hugging Face cache: the commit the cache's `refs/main` names;
- anything else: None (the namespace is the name alone, as before).

The engine loads its weights from that directory anyway, so symlinks in it are followed (a
hub snapshot is made of them); files are still read within bounds, a FIFO never hangs the
read, and what cannot be read is skipped.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

__all__ = ["weights_identity"]

CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json", "hf_quant_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MAX_CONFIG_BYTES = 1 << 20
MAX_ENTRIES = 100_000
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def weights_identity(model: str) -> str | None:
    """16 hex digits that change when the weights behind `model` change, or None if unknown."""
    if not isinstance(model, str) or not model:
        return None
    try:
        if os.path.isdir(model):
            return _directory_identity(Path(model))
        if _HUB_ID.match(model):
            return _hub_cache_identity(model)
    except OSError:
        return None
    return None


def _directory_identity(directory: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for name in CONFIG_FILES:
        data = _read_bounded(directory / name)
        if data is not None:
            digest.update(name.encode() + b"\0" + data + b"\0")
    entries = []
    with os.scandir(directory) as scan:
        for count, entry in enumerate(scan):
            if count >= MAX_ENTRIES:
                break
            if entry.name.endswith(WEIGHT_SUFFIXES):
                info = entry.stat(follow_symlinks=True)  # hub snapshots link to their blobs
                entries.append(f"{entry.name}\0{info.st_size}\0{info.st_mtime_ns}")
    for line in sorted(entries):
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def _hub_cache_identity(model: str) -> str | None:
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub"
    )
    ref = Path(hub) / ("models--" + model.replace("/", "--")) / "refs" / "main"
    data = _read_bounded(ref, limit=256)
    if data is None:
        return None
    commit = data.decode(errors="replace").strip()
    return hashlib.blake2b(commit.encode(), digest_size=8).hexdigest() if commit else None


def _read_bounded(path: Path, limit: int = MAX_CONFIG_BYTES) -> bytes | None:
    """A regular file's first `limit` bytes, opened without hanging on a FIFO; None where there
    is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    finally:
        os.close(fd)
