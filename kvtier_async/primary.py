"""`PrimaryTier`: the pinned host buffer between device memory and the secondary tiers.

All state changes here are plain synchronous methods, called on the event-loop
thread; nothing in this module awaits or does I/O.

A slot is in one of three states:

    free ──allocate(key)──> filling ──publish──> ready ──evict──> free
                               └─────abort──────────────────────> free

`filling` slots are invisible to `lookup`; only their owner, which holds a pin,
touches them. A `ready` slot with no pins sits in the LRU and may be evicted
to make room; a pinned slot is never evicted or reused.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import OrderedDict
from collections.abc import Callable

import torch

from .spec import ALIGNMENT, OffloadingSpec

__all__ = ["PrimaryTier"]


def _host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, memoryview]:
    """A flat uint8 tensor and a writable memoryview over the same 4096-aligned bytes."""
    if pin:
        # cudaHostAlloc hands out page-aligned memory.
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        array = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
        view = memoryview(array).cast("B")
    else:
        # An anonymous mapping is page-aligned. It is populated now, like pinned memory:
        # left to fault in during O_DIRECT reads, the page zeroing and the mmap lock
        # it takes stalled the event loop for tens of ms (bench/loop_lag.py).
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        view = memoryview(mapping)
    assert tensor.data_ptr() % ALIGNMENT == 0
    return tensor, view


class PrimaryTier:
    """Slots of `spec.block_stride` bytes in one host buffer, with pins and LRU eviction.

    The buffer is made resident when constructed (pinned, or populated), which
    takes ~0.7 s per GiB on a small VM: build it before serving, or in a thread.
    """

    def __init__(self, spec: OffloadingSpec, *, pin_memory: bool | None = None) -> None:
        self.spec = spec
        self.num_slots = spec.num_cpu_blocks
        self.stride = spec.block_stride
        self.block_nbytes = spec.block_nbytes
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        flat, self.view = _host_buffer(self.num_slots * self.stride, self.pinned)
        #: `[num_slots, block_stride]` uint8; row i is slot i.
        self.buffer = flat.view(self.num_slots, self.stride)
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._ready: dict[bytes, int] = {}
        self._filling: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._pins = [0] * self.num_slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # ready, unpinned; oldest first
        self._pinned_slots = 0
        self.evictions = 0
        #: Called whenever a slot may have become allocatable (unpinned or freed).
        self.on_release: Callable[[], None] | None = None

    # -- queries ---------------------------------------------------------------------------
    def slot_view(self, slot: int) -> memoryview:
        """The `block_nbytes` bytes of one slot."""
        start = slot * self.stride
        return self.view[start : start + self.block_nbytes]

    def lookup(self, key: bytes) -> int | None:
        """The ready slot holding `key`, or None."""
        return self._ready.get(key)

    def is_filling(self, key: bytes) -> bool:
        return key in self._filling

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def pinned_slots(self) -> int:
        return self._pinned_slots

    @property
    def ready_slots(self) -> int:
        return len(self._ready)

    def allocatable(self) -> int:
        """How many `allocate` calls would succeed right now."""
        return len(self._free) + len(self._lru)

    # -- state changes ---------------------------------------------------------------------
    def pin(self, slot: int) -> None:
        if self._pins[slot] == 0:
            self._pinned_slots += 1
            self._lru.pop(slot, None)
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        pins = self._pins[slot]
        assert pins > 0, f"slot {slot} is not pinned"
        self._pins[slot] = pins - 1
        if pins == 1:
            self._pinned_slots -= 1
            key = self._key_of.get(slot)
            if key is not None and self._ready.get(key) == slot:
                self._lru[slot] = None
            if self.on_release is not None:
                self.on_release()

    def acquire(self, key: bytes) -> int | None:
        """Pin and return the ready slot of `key` (marking it recently used), or None."""
        slot = self._ready.get(key)
        if slot is not None:
            self.pin(slot)
        return slot

    def allocate(self, key: bytes) -> int | None:
        """A pinned `filling` slot for `key`, evicting the least recently used free slot.

        Returns None when every slot is pinned. `key` must be neither ready nor filling.
        """
        assert key not in self._ready and key not in self._filling, "key already held"
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            del self._ready[self._key_of.pop(slot)]
            self.evictions += 1
        else:
            return None
        self._key_of[slot] = key
        self._filling[key] = slot
        self.pin(slot)
        return slot

    def publish(self, slot: int) -> None:
        """A filling slot's bytes are complete: make its key visible. The pin stays."""
        key = self._key_of[slot]
        del self._filling[key]
        self._ready[key] = slot

    def abort(self, slot: int) -> None:
        """Give back a filling slot whose bytes never became complete; drops its pin."""
        key = self._key_of.pop(slot)
        del self._filling[key]
        assert self._pins[slot] == 1, "an aborted slot is pinned only by its owner"
        self._pins[slot] = 0
        self._pinned_slots -= 1
        self._free.append(slot)
        if self.on_release is not None:
            self.on_release()

    def stats(self) -> dict[str, int]:
        return {
            "primary_capacity_blocks": self.num_slots,
            "primary_used_blocks": self.used_slots,
            "primary_ready_blocks": self.ready_slots,
            "primary_pinned_blocks": self.pinned_slots,
            "primary_evictions": self.evictions,
        }
