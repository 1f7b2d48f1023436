"""CopyEngine logic that does not need a GPU: run detection, event polling, CPU copies."""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvtier_async as kt
from kvtier_async.copy_engine import CopyEngine, _await_event, _paired_runs, _slot_runs


def test_runs() -> None:
    assert _slot_runs([4, 5, 6, 9, 1, 2]) == [(0, 4, 3), (3, 9, 1), (4, 1, 2)]
    assert _paired_runs([10, 11, 12, 3], [0, 1, 5, 6]) == [(10, 0, 2), (12, 5, 1), (3, 6, 1)]
    assert _slot_runs([]) == [] and _paired_runs([], []) == []


class FakeEvent:
    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


@pytest.mark.asyncio
async def test_event_wait_outlives_a_cancel() -> None:
    event = FakeEvent(polls=30)
    keep = [object()]
    task = asyncio.ensure_future(_await_event(event, keep))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert event.polls < 0, "returned before the copy had finished"
    assert keep == []  # staging buffers are let go only then


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
async def test_scattered_copies_are_exact_for_any_dtype(dtype: torch.dtype) -> None:
    layers = [torch.randn(40, 3, 8).to(dtype) for _ in range(3)] + [torch.randn(40, 5).to(dtype)]
    nbytes = sum(layer[0].numel() * layer.element_size() for layer in layers)
    spec = kt.OffloadingSpec(block_nbytes=nbytes, num_cpu_blocks=16)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=2)
    device_ids = [7, 3, 4, 5, 30, 0, 1, 39]
    slots = [15, 2, 3, 4, 9, 10, 11, 0]
    original = [layer.clone() for layer in layers]
    await engine.to_host(device_ids, slots)
    targets = [20, 21, 22, 23, 24, 25, 26, 27]
    await engine.to_device(slots, targets)
    for before, after in zip(original, layers):
        assert torch.equal(after[targets], before[device_ids])
        assert torch.equal(after[:20], before[:20])  # nothing else was touched
    engine.close()


@pytest.mark.asyncio
async def test_cpu_copies_stay_off_torchs_thread_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-to-host copies run on the worker alone: `Tensor.copy_` would fan large copies out
    over torch's intra-op threads, which stalled the event loop (see copy_engine's docstring)."""
    layers = [torch.randint(0, 256, (8, 1 << 16), dtype=torch.uint8) for _ in range(2)]
    spec = kt.OffloadingSpec(block_nbytes=2 << 16, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    original = [layer.clone() for layer in layers]

    def no_torch_copy(*args: object) -> None:
        raise AssertionError("Tensor.copy_ used for a host-to-host copy")

    monkeypatch.setattr(torch.Tensor, "copy_", no_torch_copy)
    await engine.to_host([0, 1, 5], [7, 2, 3])
    for layer in layers:
        layer.zero_()
    await engine.to_device([7, 2, 3], [0, 1, 5])
    monkeypatch.undo()
    for before, after in zip(original, layers):
        assert torch.equal(after[[0, 1, 5]], before[[0, 1, 5]])
    engine.close()
