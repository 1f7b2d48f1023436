"""Opening and closing a cache.

The primary tier's memory is made resident (and pinned) when the cache opens
and given back when it closes. Both take ~0.1 to 0.6 s per GiB, so both run
on worker threads, never on the event loop; and closing never takes the
memory from under a call still in flight.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import probe_tier  # imported up front: a first import reads files, which blocks the loop
import pytest
import torch

import kvtier_async as kt

BLOCKS = 16
BLOCK_NBYTES = 2 * 1024


def make_layers() -> list[torch.Tensor]:
    return [torch.randint(0, 256, (BLOCKS, 1024), dtype=torch.uint8) for _ in range(2)]


def make_spec(tiers: list[dict[str, object]] | None = None) -> kt.OffloadingSpec:
    return kt.OffloadingSpec(
        block_nbytes=BLOCK_NBYTES,
        num_cpu_blocks=8,
        secondary_tiers=[{"type": "memory"}] if tiers is None else tiers,
    )


def keys_for(n: int, conversation: int = 0) -> list[bytes]:
    return kt.block_hashes([conversation * 100_000 + t for t in range(16 * n)], 16)


def on_a_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def memory_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(name, ran on an event-loop thread) for each make_resident / release_memory call."""
    calls: list[tuple[str, bool]] = []
    for name in ("make_resident", "release_memory"):
        original: Callable[[kt.PrimaryTier], None] = getattr(kt.PrimaryTier, name)

        def recorded(
            self: kt.PrimaryTier, original: Callable[..., None] = original, name: str = name
        ) -> None:
            calls.append((name, on_a_loop_thread()))
            original(self)

        monkeypatch.setattr(kt.PrimaryTier, name, recorded)
    return calls


@pytest.mark.asyncio
async def test_opening_and_closing_move_the_memory_on_worker_threads(
    memory_calls: list[tuple[str, bool]],
) -> None:
    layers = make_layers()
    cache = kt.TieredKVCache(make_spec(), layers)
    assert not cache.primary.resident and memory_calls == []  # constructing only reserves
    async with cache:
        assert cache.primary.resident
        assert await cache.store(keys_for(4), [0, 1, 2, 3]) == 4
    assert not cache.primary.resident
    assert memory_calls == [("make_resident", False), ("release_memory", False)]


@pytest.mark.asyncio
async def test_the_first_call_opens_a_cache_used_without_async_with(
    memory_calls: list[tuple[str, bool]],
) -> None:
    layers = make_layers()
    original = [layer.clone() for layer in layers]
    cache = kt.TieredKVCache(make_spec(), layers)
    keys = keys_for(6)
    # Two calls at once: the memory is made resident once, and both wait for it.
    stored = await asyncio.gather(cache.store(keys[:3], [0, 1, 2]), cache.store(keys[3:], [3, 4, 5]))
    assert stored == [3, 3] and memory_calls == [("make_resident", False)]
    for layer in layers:
        layer.zero_()
    assert await cache.load(keys, list(range(6))) == 6
    assert all(torch.equal(a[:6], b[:6]) for a, b in zip(layers, original))
    await cache.aclose()
    assert memory_calls[-1] == ("release_memory", False)


@pytest.mark.asyncio
async def test_a_failed_opening_is_raised_and_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    failures = [RuntimeError("cudaHostRegister failed (2)")]
    original = kt.PrimaryTier.make_resident

    def failing_once(self: kt.PrimaryTier) -> None:
        if failures:
            raise failures.pop()
        original(self)

    monkeypatch.setattr(kt.PrimaryTier, "make_resident", failing_once)
    cache = kt.TieredKVCache(make_spec(), make_layers())
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        await cache.store(keys_for(2), [0, 1])
    assert cache.stats()["stored_blocks"] == 0 and cache.stats()["primary_used_blocks"] == 0
    assert await cache.store(keys_for(2), [0, 1]) == 2
    await cache.aclose()
    # Failing in `async with`, the cache is closed again before the error comes out.
    failures.append(RuntimeError("cudaHostRegister failed (2)"))
    cache = kt.TieredKVCache(make_spec(), make_layers())
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        async with cache:
            raise AssertionError("not reached")
    with pytest.raises(kt.ClosedError):
        await cache.store(keys_for(2), [0, 1])


@pytest.mark.asyncio
async def test_closing_waits_for_a_load_in_flight_before_giving_the_memory_back(
    memory_calls: list[tuple[str, bool]],
) -> None:
    layers = make_layers()
    tiers = [{"type": "GatedTier", "module_path": "probe_tier"}]
    keys = keys_for(4)
    cache = kt.TieredKVCache(make_spec(tiers), layers)
    async with cache:
        gated = cache.tiers[0]
        assert isinstance(gated, probe_tier.GatedTier)
        assert await cache.store(keys, [0, 1, 2, 3]) == 4
        await cache.flush()
        assert await cache.store(keys_for(8, conversation=1), list(range(8, 16))) == 8  # evicts all four
        await cache.flush()
        original = [layer.clone() for layer in layers]
        for layer in layers:
            layer[:4].zero_()
        gated.gated.update(keys)
        load = asyncio.ensure_future(cache.load(keys, [0, 1, 2, 3]))
        await gated.waiting.wait()
        closing = asyncio.ensure_future(cache.aclose())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done() and cache.primary.resident  # the load still needs the buffer
        load.add_done_callback(lambda _: memory_calls.append(("load returned", True)))
        gated.gate.set()
        assert await load == 4
        await closing
    assert [name for name, _ in memory_calls] == ["make_resident", "load returned", "release_memory"]
    assert not cache.primary.resident
    assert all(torch.equal(a, b) for a, b in zip(layers, original))  # not zeros from given-back pages


@pytest.mark.asyncio
@pytest.mark.parametrize("tier_type", ["memory", "fs"])
async def test_a_dropped_cache_is_freed_without_the_cycle_collector(tier_type: str, tmp_path: Path) -> None:
    """Neither the cache nor its tiers are called back by what they own (the primary tier, a
    tier's rooms): no reference cycle keeps the cache or a tier (and, were they not closed,
    their memory) alive until a collection on the event loop."""
    tier: dict[str, object] = {"type": tier_type} | ({"root": str(tmp_path)} if tier_type == "fs" else {})
    gc.disable()
    try:
        cache = kt.TieredKVCache(make_spec([tier]), make_layers())
        async with cache:
            assert await cache.store(keys_for(2), [0, 1]) == 2
            await cache.flush()
        collected = [weakref.ref(cache), *(weakref.ref(t) for t in cache.tiers)]
        del cache
        assert [ref() for ref in collected] == [None] * len(collected)
    finally:
        gc.enable()
