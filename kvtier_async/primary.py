"""`PrimaryTier`: the pinned host buffer between device memory and the secondary tiers.

All state changes here are plain synchronous methods, called on the event-loop
thread; nothing in this module awaits or does I/O.

A slot is in one of three states:

    free ──allocate(key)──> filling ──publish──> ready ──evict──> free
                               └─────abort──────────────────────> free

`filling` slots are invisible to `lookup`; only their owner, which holds a pin,
touches them. A `ready` slot with no pins sits in the LRU and may be evicted
to make room; a pinned slot is never evicted or reused. A transition that does
not fit the slot's state (allocating a key already held, unpinning an unpinned
slot, publishing a slot that is not filling) raises `SlotStateError` before
changing anything: these are bugs, caught by real checks, not `assert`s.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .spec import ALIGNMENT, OffloadingSpec

__all__ = ["PrimaryTier", "SlotStateError", "reserve_host_memory"]


class SlotStateError(RuntimeError):
    """A primary-tier transition that does not fit the slot's state: a bug in the caller."""


#: madvise(2) advice that faults in every page of a range for writing (Linux >= 5.14).
_MADV_POPULATE_WRITE = 23


def reserve_host_memory(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory: address space only, no pages yet (cheap).

    It asks for transparent huge pages. O_DIRECT I/O into 4 KiB pages has to
    pin and map every page separately, and on a VM the device then sees a
    scatter list of scattered pages: reading 512 MiB into huge pages took
    0.17 s here, into freshly faulted 4 KiB pages 0.35 to 0.93 s, varying with
    where the pages happened to lie. Copies gain fewer TLB misses too.
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no huge pages here: 4 KiB pages work
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def _populate(mapping: mmap.mmap, flat: torch.Tensor) -> None:
    """Fault in every page of `mapping` now rather than during the first copies or reads."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except (AttributeError, OSError, ValueError):  # an old kernel, or no madvise: touch each page
        flat[::ALIGNMENT].zero_()


def _cuda_host_register(address: int, nbytes: int, device: Any) -> Any:
    """Page-lock host memory for asynchronous DMA (what `pin_memory=True` allocations get),
    under `device` (None: the calling thread's current one); returns the device. A raw cudart
    call on a worker thread, whose current device is 0, would make a context on GPU 0
    (0.3-0.5 GiB there) in every process of a multi-GPU host."""
    portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not just the current one
    if device is None:
        device = torch.cuda.current_device()
    with torch.cuda.device(device):
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, nbytes, portable))  # type: ignore[no-untyped-call]
    return device


def _cuda_host_unregister(address: int, device: Any) -> None:
    with torch.cuda.device(device):
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))  # type: ignore[no-untyped-call]


def _unpin_before_unmap(pinned_at: list[tuple[int, Any]], mapping: mmap.mmap) -> None:
    """A `PrimaryTier` that was never told to give its memory back is gone: unpin its buffer
    while the mapping still exists (this finalizer holds the last reference to it).

    Unmapped while still registered, the range stays registered with CUDA: a later mapping at
    the same address then fails to register ("resource already mapped"), or DMA goes to the old
    physical pages and the host reads bytes the device never wrote (bench/gpu_check.py on an
    H200: the second primary tier of a run read back wrong bytes).
    """
    if pinned_at:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            _cuda_host_unregister(*pinned_at.pop())
    del mapping


class PrimaryTier:
    """Slots of `spec.block_stride` bytes in one host buffer, with pins and LRU eviction.

    The buffer's memory goes through three stages. Constructing reserves it
    (address space only). `make_resident()` faults in every page and, with
    `pin_memory`, page-locks them for CUDA; that takes ~0.6 s per GiB on a
    small VM, so `TieredKVCache` runs it on a worker thread when opened (a
    standalone tier does it in the constructor unless `resident=False`).
    `release_memory()` gives the pages back once nothing uses the buffer.
    """

    def __init__(
        self, spec: OffloadingSpec, *, pin_memory: bool | None = None, resident: bool = True
    ) -> None:
        self.spec = spec
        self.num_slots = spec.num_cpu_blocks
        self.stride = spec.block_stride
        self.block_nbytes = spec.block_nbytes
        #: Whether `make_resident` page-locks the buffer (default: when CUDA is available).
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        #: Whether the buffer is page-locked now (DMA to and from it is asynchronous).
        self.pinned = False
        self.resident = False
        self._mapping = reserve_host_memory(self.num_slots * self.stride)
        #: The CUDA device the buffer is registered under: the device of the KV it stages
        #: (`TieredKVCache` sets it); None: the current device of the thread registering it.
        self.cuda_device: Any = None
        #: (address, device) registered with CUDA, while it is (shared with the finalizer).
        self._pinned_at: list[tuple[int, Any]] = []
        weakref.finalize(self, _unpin_before_unmap, self._pinned_at, self._mapping)
        flat = torch.frombuffer(self._mapping, dtype=torch.uint8)  # mmap memory: page-aligned
        self.view = memoryview(self._mapping)
        #: `[num_slots, block_stride]` uint8; row i is slot i.
        self.buffer = flat.view(self.num_slots, self.stride)
        self._empty_slots()
        self.evictions = 0
        #: Called whenever a slot may have become allocatable (unpinned or freed) and whenever a
        #: filling slot's key became ready or gone (published or aborted): what waiters wait for.
        self.on_release: Callable[[], None] | None = None
        if resident:
            self.make_resident()

    def _empty_slots(self) -> None:
        """Every slot free, nothing ready, filling or pinned."""
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._ready: dict[bytes, int] = {}
        self._filling: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._pins = [0] * self.num_slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # ready, unpinned; oldest first
        self._pinned_slots = 0

    # -- memory (blocking: call these from a worker thread where a loop is running) ---------
    def make_resident(self) -> None:
        """Fault in every page of the buffer and, with `pin_memory`, page-lock it. Idempotent."""
        if self.resident:
            return
        _populate(self._mapping, self.buffer.view(-1))
        if self.pin_memory:
            device = _cuda_host_register(self.buffer.data_ptr(), self.buffer.numel(), self.cuda_device)
            self._pinned_at.append((self.buffer.data_ptr(), device))
            self.pinned = True
        self.resident = True

    def release_memory(self) -> None:
        """Unpin the buffer and give its pages back; the tier is empty afterwards.

        Only once nothing reads or writes the buffer any more: its bytes read
        as zeros afterwards. Freeing a populated mapping costs ~0.1 s per GiB,
        which would otherwise fall on whichever thread drops the last reference
        (often the event loop, inside a garbage collection).
        """
        self._empty_slots()
        if self.pinned:
            _cuda_host_unregister(*self._pinned_at.pop())
            self.pinned = False
        self.resident = False
        self._mapping.madvise(mmap.MADV_DONTNEED)

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
        if pins <= 0:
            raise SlotStateError(f"slot {slot} is not pinned")
        self._pins[slot] = pins - 1
        if pins == 1:
            self._pinned_slots -= 1
            key = self._key_of.get(slot)
            if key is not None and self._ready.get(key) == slot:
                self._lru[slot] = None
            self._notify()

    def _notify(self) -> None:
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
        if key in self._ready or key in self._filling:
            raise SlotStateError(f"key {key.hex()[:16]}... is already held in the primary tier")
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
        key = self._filling_key(slot)
        del self._filling[key]
        self._ready[key] = slot
        self._notify()  # a load waiting for this key can take it now

    def abort(self, slot: int) -> None:
        """Give back a filling slot whose bytes never became complete; drops its pin."""
        key = self._filling_key(slot)
        if self._pins[slot] != 1:
            pins = self._pins[slot]
            raise SlotStateError(f"slot {slot} is pinned {pins} times; only its filler may abort it")
        del self._key_of[slot]
        del self._filling[key]
        self._pins[slot] = 0
        self._pinned_slots -= 1
        self._free.append(slot)
        self._notify()

    def _filling_key(self, slot: int) -> bytes:
        key = self._key_of.get(slot)
        if key is None or self._filling.get(key) != slot:
            raise SlotStateError(f"slot {slot} is not filling")
        return key

    def stats(self) -> dict[str, int]:
        return {
            "primary_capacity_blocks": self.num_slots,
            "primary_used_blocks": self.used_slots,
            "primary_ready_blocks": self.ready_slots,
            "primary_pinned_blocks": self.pinned_slots,
            "primary_evictions": self.evictions,
        }
