"""The weights behind a model name go into the integrations' namespaces: updating a model in
place under the same name never loads the old weights' KV."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier_async.integrations.model_identity import weights_identity


def make_model(directory: Path, config: str = '{"model_type": "llama"}') -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config)
    (directory / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 1000)
    return directory


def test_a_local_model_directory_changes_identity_with_its_weights_or_config(tmp_path: Path) -> None:
    model = make_model(tmp_path / "llama")
    first = weights_identity(str(model))
    assert first is not None and first == weights_identity(str(model))
    weights = model / "model-00001-of-00001.safetensors"
    weights.write_bytes(b"\1" * 1001)  # new weights in place
    second = weights_identity(str(model))
    assert second != first
    (model / "config.json").write_text('{"model_type": "llama", "quantization_config": {"bits": 4}}')
    assert weights_identity(str(model)) not in (first, second)
    os.utime(weights, ns=(1, 1))
    assert weights_identity(str(model)) is not None


def test_a_hub_id_uses_the_cached_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert weights_identity("meta-llama/Llama-3.1-8B") is None  # not cached: unknown
    ref = tmp_path / "models--meta-llama--Llama-3.1-8B" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("a" * 40)
    first = weights_identity("meta-llama/Llama-3.1-8B")
    ref.write_text("b" * 40)
    assert first is not None and weights_identity("meta-llama/Llama-3.1-8B") not in (None, first)


def test_unknown_or_hostile_names_are_none(tmp_path: Path) -> None:
    fifo_model = tmp_path / "fifo-model"
    fifo_model.mkdir()
    os.mkfifo(fifo_model / "config.json")  # never hangs the read
    assert weights_identity(str(fifo_model)) is not None
    for name in ("", "gpt2", "a/b/c", "no-such-org/no-such-model"):
        assert weights_identity(name) is None
