from __future__ import annotations

import gc
import mmap
import weakref

import pytest

import kvtier_async as kt
from kvtier_async.spec import ALIGNMENT


@pytest.fixture
def primary() -> kt.PrimaryTier:
    return kt.PrimaryTier(kt.OffloadingSpec(block_nbytes=5000, num_cpu_blocks=3), pin_memory=False)


def test_buffer_geometry(primary: kt.PrimaryTier) -> None:
    assert tuple(primary.buffer.shape) == (3, 8192)
    assert primary.buffer.data_ptr() % ALIGNMENT == 0
    assert len(primary.view) == 3 * 8192
    primary.slot_view(1)[:] = b"\x07" * 5000
    assert bytes(primary.buffer[1, :5000].tolist()) == b"\x07" * 5000
    assert len(primary.slot_view(2)) == 5000


def test_allocate_publish_lookup(primary: kt.PrimaryTier) -> None:
    slot = primary.allocate(b"a")
    assert slot is not None
    assert primary.lookup(b"a") is None and primary.is_filling(b"a")  # invisible while filling
    primary.publish(slot)
    assert primary.lookup(b"a") == slot
    assert primary.pinned_slots == 1
    primary.unpin(slot)
    assert primary.pinned_slots == 0
    assert primary.used_slots == 1


def test_lru_eviction_skips_pinned(primary: kt.PrimaryTier) -> None:
    slots = {}
    for key in (b"a", b"b", b"c"):
        slot = primary.allocate(key)
        assert slot is not None
        primary.publish(slot)
        primary.unpin(slot)
        slots[key] = slot
    pinned = primary.acquire(b"a")  # a is oldest, but pinned; touching it also makes it recent
    assert pinned == slots[b"a"]
    slot_d = primary.allocate(b"d")
    assert slot_d == slots[b"b"]  # b was the least recently used unpinned slot
    assert primary.lookup(b"b") is None
    assert primary.evictions == 1
    # Everything pinned now but c; after c goes, allocation fails rather than evict a pin.
    assert primary.allocate(b"e") == slots[b"c"]
    assert primary.allocate(b"f") is None
    assert primary.allocatable() == 0


def test_abort_frees_the_slot(primary: kt.PrimaryTier) -> None:
    released = []
    primary.on_release = lambda: released.append(1)
    slot = primary.allocate(b"a")
    assert slot is not None
    primary.abort(slot)
    assert primary.lookup(b"a") is None and not primary.is_filling(b"a")
    assert primary.used_slots == 0 and primary.pinned_slots == 0
    assert released == [1]


def test_memory_is_reserved_then_made_resident_then_given_back() -> None:
    primary = kt.PrimaryTier(kt.OffloadingSpec(block_nbytes=5000, num_cpu_blocks=3), resident=False)
    assert not primary.resident and not primary.pinned
    primary.make_resident()
    assert primary.resident and not primary.pinned  # no CUDA here: nothing to page-lock
    slot = primary.allocate(b"a")
    assert slot is not None
    primary.slot_view(slot)[:] = b"\x05" * 5000
    primary.publish(slot)
    primary.unpin(slot)
    primary.release_memory()
    assert not primary.resident
    assert primary.lookup(b"a") is None and primary.used_slots == 0  # nothing served from given-back pages
    assert bytes(primary.slot_view(slot)) == bytes(5000)
    assert primary.allocate(b"b") is not None  # still usable; its pages fault in again


def test_pinning_registers_the_buffer_with_cuda_and_unregisters_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(
        "kvtier_async.primary._cuda_host_register",
        lambda address, nbytes, device: calls.append(("register", address, nbytes)),
    )
    monkeypatch.setattr(
        "kvtier_async.primary._cuda_host_unregister",
        lambda address, device: calls.append(("unregister", address, 0)),
    )
    primary = kt.PrimaryTier(kt.OffloadingSpec(block_nbytes=5000, num_cpu_blocks=3), pin_memory=True)
    address = primary.buffer.data_ptr()
    assert primary.resident and primary.pinned  # resident=True (the default) does it at once
    primary.make_resident()  # idempotent
    assert calls == [("register", address, 3 * 8192)]
    primary.release_memory()
    assert not primary.pinned and calls[1:] == [("unregister", address, 0)]


def test_transitions_that_do_not_fit_the_slot_state_are_refused_before_any_change(
    primary: kt.PrimaryTier,
) -> None:
    # Real checks, not asserts: they hold under python -O too (test_concurrency runs it so).
    from kvtier_async.primary import SlotStateError

    slot = primary.allocate(b"a")
    assert slot is not None
    before = primary.stats()
    with pytest.raises(SlotStateError, match="already held"):
        primary.allocate(b"a")  # filling
    primary.pin(slot)
    with pytest.raises(SlotStateError, match="only its filler"):
        primary.abort(slot)  # someone else pinned it
    primary.unpin(slot)
    assert primary.stats() == before
    primary.publish(slot)
    with pytest.raises(SlotStateError, match="already held"):
        primary.allocate(b"a")  # ready
    with pytest.raises(SlotStateError, match="not filling"):
        primary.publish(slot)
    with pytest.raises(SlotStateError, match="not filling"):
        primary.abort(slot)
    primary.unpin(slot)
    with pytest.raises(SlotStateError, match="not pinned"):
        primary.unpin(slot)
    assert primary.lookup(b"a") == slot and primary.pinned_slots == 0


def test_a_pinned_tier_dropped_without_giving_its_memory_back_is_unpinned_before_unmap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unmapped while still registered with CUDA, the range stays registered: the next mapping at
    # that address failed to register, or its DMA went to the old pages (wrong bytes on an H200).
    calls: list[tuple[str, int, bool]] = []
    mappings: list[weakref.ref[mmap.mmap]] = []

    def register(address: int, nbytes: int, device: object) -> None:
        calls.append(("register", address, True))

    def unregister(address: int, device: object) -> None:
        calls.append(("unregister", address, mappings[-1]() is not None))  # still mapped?

    monkeypatch.setattr("kvtier_async.primary._cuda_host_register", register)
    monkeypatch.setattr("kvtier_async.primary._cuda_host_unregister", unregister)
    primary = kt.PrimaryTier(kt.OffloadingSpec(block_nbytes=5000, num_cpu_blocks=3), pin_memory=True)
    mappings.append(weakref.ref(primary._mapping))
    address = primary.buffer.data_ptr()
    del primary
    gc.collect()
    assert calls == [("register", address, True), ("unregister", address, True)]
    assert mappings[-1]() is None  # and unmapped after that
    released = kt.PrimaryTier(kt.OffloadingSpec(block_nbytes=5000, num_cpu_blocks=3), pin_memory=True)
    mappings.append(weakref.ref(released._mapping))
    released.release_memory()
    del released
    gc.collect()
    assert [name for name, _, _ in calls] == ["register", "unregister", "register", "unregister"]
