"""SGLang host pages as kvtier blocks: where a page's bytes lie, how it is stored, and the
page slots that pages move through when they cannot move in place.

A host pool describes a page as equal runs of its buffer (`get_page_buffer_meta`): K and V
in the page-first layout, K and V per layer in the layer-first one, one (or one per layer)
for MLA. `PageRuns` reads that description.

One storage layout per pool geometry, whichever SGLang path stores a page (`BlockLayout`):

- **in place**, where each run is a multiple of 4096 bytes at a 4096-aligned offset: each run
  is one block, keyed by the page's key and the run's number. The v1 path reads and writes
  the runs in the host pool itself (the pool is the tier's primary memory).
- **packed**, otherwise (small pages, few heads): the page is one block, its runs in order,
  zero-padded to a multiple of 4096 bytes, so the tier keeps its O_DIRECT path. Each page is
  copied between the pool (or SGLang's flat page) and a page slot (`PageSlots`).

SGLang's generic path hands over flat pages (`get_data_page`): the pool's bytes in its own
index order, which is not the run order in the layer-first layout (all K layers, then all
V). `flat_order` learns from the pool which run each run-sized piece of a flat page is, so a
flat page is stored as the same blocks as the v1 path stores, and either path finds and
loads the other's pages.

A **logical** KV pool (SGLang's `LogicalHostPool`, DeepSeek V4's KV anchor) holds no bytes: its
pages are empty and the model's data lies in other pools. Each of its pages is stored as one
anchor block (`ANCHOR`: 4096 bytes of a fixed content, `AnchorShape`), which says only that
the page was stored, as HiCacheFile's zero-byte files do.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import ConfigError, InvalidArgumentError
from ..primary import reserve_host_memory

if TYPE_CHECKING:
    from ..tier import SecondaryTierManager as KVTier
    from .bridge import LoopThread

__all__ = [
    "ALIGNMENT",
    "ANCHOR",
    "AnchorShape",
    "BlockLayout",
    "PageRuns",
    "PageShape",
    "PageSlots",
    "StagedPages",
    "flat_order",
]

ALIGNMENT = 4096
#: Page slots at most, however small the pages: a batch of SGLang's is far fewer.
MAX_SLOTS = 1024
RUN_NUMBER_BYTES = 2  # a block's key: the page key, then the run's number (big-endian)
#: What a logical pool's page is stored as: the smallest block the tiers take, of a content that
#: says what it is (checked on load, so no other block is ever read as an anchor).
_ANCHOR_LINE = b"kvtier SGLang logical host pool page anchor v1\n"
ANCHOR = torch.frombuffer(
    bytearray((_ANCHOR_LINE * (ALIGNMENT // len(_ANCHOR_LINE) + 1))[:ALIGNMENT]), dtype=torch.uint8
)


class PageShape(Protocol):
    """A page as page slots hold it: `runs` runs of `run_nbytes`, `page_nbytes` in all."""

    runs: int
    run_nbytes: int
    page_nbytes: int


@dataclass
class AnchorShape:
    """A logical pool's page as page slots hold it: one anchor block (`ANCHOR`)."""

    runs: int = 1
    run_nbytes: int = ALIGNMENT
    page_nbytes: int = ALIGNMENT


class PageRuns:
    """Where each host-pool page's bytes lie: `runs` equal runs of the pool's buffer, read from the
    pool's own `get_page_buffer_meta`, as row numbers of `run_nbytes` in the buffer."""

    def __init__(self, pool: Any) -> None:
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ConfigError(
                f"kvtier SGLang backend: host pool {type(pool).__name__} has no contiguous CPU kv_buffer "
                "(this layout is not supported)"
            )
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.base = buffer.data_ptr()
        self.nbytes = buffer.numel() * buffer.element_size()
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        except (NotImplementedError, ValueError, AssertionError) as exc:
            raise ConfigError(
                f"kvtier SGLang backend: host pool {type(pool).__name__} with layout "
                f"{getattr(pool, 'layout', '?')!r} does not describe its pages ({exc})"
            ) from exc
        if not ptrs or len(set(sizes)) != 1:
            raise ConfigError(
                f"kvtier SGLang backend: host pool layout {getattr(pool, 'layout', '?')!r} splits a page "
                f"into runs of different sizes {sorted(set(sizes))}; not supported"
            )
        self.runs = len(ptrs)
        self.run_nbytes = int(sizes[0])
        self.page_nbytes = self.runs * self.run_nbytes
        if self.nbytes % self.run_nbytes:
            raise ConfigError(
                f"kvtier SGLang backend: the host pool's {self.nbytes} bytes are not whole runs of "
                f"{self.run_nbytes}; not supported"
            )
        #: Runs of 4096-byte multiples at 4096-aligned offsets move in place (see `BlockLayout`).
        self.in_place = self.run_nbytes % ALIGNMENT == 0 and self.base % ALIGNMENT == 0
        # The buffer as bytes: the in-place tier's primary memory, and its runs as rows.
        flat = buffer.view(torch.uint8).reshape(-1)
        self.view: memoryview = flat.numpy().data
        self.rows_tensor = flat.view(-1, self.run_nbytes)
        # For scattering runs: numpy assigns rows by index at memcpy speed, torch's index_copy_
        # at 2 GB/s here.
        self.rows_array = self.rows_tensor.numpy()

    def rows(self, pages: int, host_indices: torch.Tensor) -> list[int]:
        """The rows of `pages` pages named by `host_indices` (their token slots), page by page."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-D tensor of host-pool token slots")
        if host_indices.numel() != pages * self.page_size:
            raise InvalidArgumentError(
                f"{pages} keys need {pages * self.page_size} host_indices (page size {self.page_size}), "
                f"got {host_indices.numel()}"
            )
        ptrs, _ = self.pool.get_page_buffer_meta(host_indices.to("cpu", torch.int64))
        rows = []
        for ptr in ptrs:
            offset = int(ptr) - self.base
            if offset % self.run_nbytes or not 0 <= offset < self.nbytes:
                raise InvalidArgumentError(
                    f"host_indices name a slot outside the host pool (offset {offset})"
                )
            rows.append(offset // self.run_nbytes)
        return rows

    def in_place_page_size(self) -> int:
        """The smallest page size whose runs would be whole multiples of 4096 bytes."""
        per_token = self.run_nbytes // self.page_size
        return ALIGNMENT // math.gcd(ALIGNMENT, per_token)


@dataclass(frozen=True)
class BlockLayout:
    """How a page is stored: `blocks_per_page` blocks of `block_nbytes` each."""

    blocks_per_page: int
    block_nbytes: int
    packed: bool

    @classmethod
    def of(cls, runs: PageRuns) -> BlockLayout:
        if runs.in_place:
            return cls(runs.runs, runs.run_nbytes, packed=False)
        return cls.packed_page(runs.page_nbytes)

    @classmethod
    def packed_page(cls, page_nbytes: int, max_block_nbytes: int | None = None) -> BlockLayout:
        """A page of `page_nbytes` as one block, zero-padded to a multiple of 4096 bytes; or, past
        `max_block_nbytes`, as that many equal blocks of at most that size as are needed (the
        page's bytes in order, the last block's tail zero-padded)."""
        pieces = 1 if max_block_nbytes is None else max(1, -(-page_nbytes // max_block_nbytes))
        piece = -(-page_nbytes // pieces)
        return cls(pieces, -(-piece // ALIGNMENT) * ALIGNMENT, packed=True)

    def keys(self, pages: Sequence[bytes]) -> list[bytes]:
        """The block keys of `pages`, page by page."""
        return [
            page + run.to_bytes(RUN_NUMBER_BYTES, "big")
            for page in pages
            for run in range(self.blocks_per_page)
        ]

    def per_page(self, results: Sequence[bool]) -> list[bool]:
        """Per page, whether all its blocks' results are True (a lookup that stopped at a miss
        may end mid-page: that page is False)."""
        n = self.blocks_per_page
        return [
            len(results) >= (i + 1) * n and all(results[i * n : (i + 1) * n])
            for i in range(-(-len(results) // n))
        ]

    @staticmethod
    def page_of(block_key: bytes) -> bytes:
        return block_key[:-RUN_NUMBER_BYTES]


def flat_order(runs: PageRuns) -> torch.Tensor | None:
    """Which run each run-sized piece of a flat page is (`get_data_page`'s order), as a tensor of
    run numbers; None where the flat order is the run order. Learned from the pool's own view of
    its first page (`get_data_page(0, flat=False)`), not from our reading of its layouts; a pool
    whose flat pages are not made of whole runs raises `ConfigError`."""
    pool = runs.pool
    try:
        page = pool.get_data_page(0, flat=False)
    except (NotImplementedError, ValueError) as exc:
        raise ConfigError(
            f"kvtier SGLang backend: host pool {type(pool).__name__} has no flat pages ({exc})"
        ) from exc
    itemsize = page.element_size() if isinstance(page, torch.Tensor) else 0
    if (
        not isinstance(page, torch.Tensor)
        or page.untyped_storage().data_ptr() != runs.base
        or page.numel() * itemsize != runs.page_nbytes
    ):
        raise ConfigError(
            f"kvtier SGLang backend: host pool {type(pool).__name__}'s flat pages are not views of its "
            'buffer; the generic path cannot serve it (set "interface_v1": 1)'
        )
    # Byte offset of each element of the flat page, in flat order.
    offsets = torch.tensor(page.storage_offset() * itemsize, dtype=torch.int64)
    for size, stride in zip(page.shape, page.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * (stride * itemsize)
    pieces = offsets.reshape(runs.runs, -1)
    starts = pieces[:, 0]
    within = torch.arange(pieces.shape[1], dtype=torch.int64) * itemsize
    if not bool((pieces - starts.unsqueeze(-1) == within).all()):  # each piece one run, in order
        raise ConfigError(
            f"kvtier SGLang backend: host pool {type(pool).__name__}'s flat pages interleave its runs; "
            'the generic path cannot serve it (set "interface_v1": 1)'
        )
    ptrs, _ = pool.get_page_buffer_meta(torch.arange(runs.page_size, dtype=torch.int64))
    run_of = {int(ptr) - runs.base: number for number, ptr in enumerate(ptrs)}
    order = [run_of.get(int(start), -1) for start in starts]
    if sorted(order) != list(range(runs.runs)):
        raise ConfigError(
            f"kvtier SGLang backend: host pool {type(pool).__name__}'s flat pages do not hold its runs; "
            'the generic path cannot serve it (set "interface_v1": 1)'
        )
    return None if order == list(range(runs.runs)) else torch.tensor(order, dtype=torch.int64)


class PageSlots:
    """Page slots in memory of our own, each one page's runs in order (then zero padding), leased
    to one batch at a time: the primary memory of a tier that pages are copied in and out of."""

    def __init__(self, runs: PageShape, layout: BlockLayout, budget_bytes: int) -> None:
        self.runs, self.run_nbytes, self.page_nbytes = runs.runs, runs.run_nbytes, runs.page_nbytes
        self.layout = layout
        self.stride = layout.blocks_per_page * layout.block_nbytes
        self.slots = max(2, min(MAX_SLOTS, budget_bytes // self.stride))
        #: Pages per lease: two batches can move at once (SGLang's prefetch and backup threads).
        self.chunk = self.slots // 2
        self.memory = reserve_host_memory(self.slots * self.stride)
        self.tensor = torch.frombuffer(self.memory, dtype=torch.uint8).view(self.slots, self.stride)
        self.tensor.zero_()  # faulted in now, not during the first batches' copies
        self.view = memoryview(self.memory)
        self._free = list(range(self.slots))
        self._changed = threading.Condition()

    def page(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s page, as (runs, run_nbytes) bytes."""
        return self.tensor[slot, : self.page_nbytes].view(self.runs, self.run_nbytes)

    def block_ids(self, slots: Sequence[int]) -> list[int]:
        per_page = self.layout.blocks_per_page
        return [slot * per_page + block for slot in slots for block in range(per_page)]

    @contextmanager
    def lease(self, pages: int) -> Iterator[list[int]]:
        """`pages` slots (at most `chunk`) for the caller's thread until it leaves the block."""
        if not 0 < pages <= self.chunk:
            raise InvalidArgumentError(f"a lease is 1 to {self.chunk} page slots, not {pages}")
        with self._changed:
            self._changed.wait_for(lambda: len(self._free) >= pages)
            leased, self._free = self._free[:pages], self._free[pages:]
        try:
            yield leased
        finally:
            with self._changed:
                self._free += leased
                self._changed.notify_all()


#: Told, on the tier's loop, which pages of a part were stored or loaded whole (True) or not.
Outcome = Callable[[list[bytes], list[bool]], None]


class StagedPages:
    """Pages copied through page slots: a tier whose primary memory is the slots. The copies run on
    the calling (SGLang) thread; each batch leases its slots, so SGLang's threads move at once.

    `outcome` (optional) hears each part's result on the tier's loop, as soon as the tier gives
    it: before any removal the tier reports afterwards (a later part's store evicting this one's
    pages, another thread's store), so what it remembers is never older than a removal."""

    def __init__(self, tier: KVTier, slots: PageSlots, bridge: LoopThread) -> None:
        self.tier, self.slots, self.bridge = tier, slots, bridge

    def store(
        self, pages: list[bytes], fill: Callable[[int, torch.Tensor], None], outcome: Outcome | None = None
    ) -> list[bool]:
        """Store `pages`, `fill(i, slot page)` putting page i's runs into its slot first."""
        layout, stored = self.slots.layout, []
        for start in range(0, len(pages), self.slots.chunk):
            part = pages[start : start + self.slots.chunk]
            with self.slots.lease(len(part)) as leased:
                for i, slot in enumerate(leased):
                    fill(start + i, self.slots.page(slot))
                ids = self.slots.block_ids(leased)
                stored += self.bridge.call(self._told(part, self.tier.store(layout.keys(part), ids), outcome))
        return stored

    def store_blocks(
        self,
        pages: list[bytes],
        fill_block: Callable[[int, int, torch.Tensor], None],
        outcome: Outcome | None = None,
    ) -> list[bool]:
        """Store `pages` block by block: `fill_block(i, j, piece)` puts page i's bytes of block j
        (`piece`: those bytes of its slot, as uint8) into place, and that block's store starts at
        once, so the copy of the next block runs while this one is written (and the blocks of a
        large page are written side by side). `outcome` hears each page's result on the loop as
        soon as its last block is stored."""
        layout, slots, stored = self.slots.layout, self.slots, []
        per_page, block_nbytes = layout.blocks_per_page, layout.block_nbytes
        for start in range(0, len(pages), slots.chunk):
            part = pages[start : start + slots.chunk]
            with slots.lease(len(part)) as leased:
                tallies = [_Tally(page, per_page, outcome) for page in part]
                pending: list[concurrent.futures.Future[None]] = []
                try:
                    for i, slot in enumerate(leased):
                        keys = layout.keys([part[i]])
                        for j in range(per_page):
                            lo = j * block_nbytes
                            fill_block(
                                start + i,
                                j,
                                slots.tensor[slot, lo : min(lo + block_nbytes, slots.page_nbytes)],
                            )
                            stores = self.tier.store(keys[j : j + 1], [slot * per_page + j])
                            pending.append(self.bridge.submit(tallies[i].told(stores)))
                finally:
                    # The slots are the tier's to read until every block's store has ended.
                    concurrent.futures.wait(pending)
                for future in pending:
                    future.result()  # a store that raised raises here
            stored += [tally.whole for tally in tallies]
        return stored

    def load(
        self, pages: list[bytes], drain: Callable[[int, torch.Tensor], None], outcome: Outcome | None = None
    ) -> list[bool]:
        """Load `pages`, `drain(i, slot page)` taking page i's runs from its slot where it arrived."""
        layout, loaded = self.slots.layout, []
        for start in range(0, len(pages), self.slots.chunk):
            part = pages[start : start + self.slots.chunk]
            with self.slots.lease(len(part)) as leased:
                ids = self.slots.block_ids(leased)
                arrived = self.bridge.call(self._told(part, self.tier.load(layout.keys(part), ids), outcome))
                for i, (slot, ok) in enumerate(zip(leased, arrived)):
                    if ok:
                        drain(start + i, self.slots.page(slot))
            loaded += arrived
        return loaded

    async def _told(
        self, part: list[bytes], moved: Awaitable[list[bool]], outcome: Outcome | None
    ) -> list[bool]:
        """Per page of `part`, whether `moved` (the tier's store or load of its blocks) moved it
        whole; `outcome` told on the loop, with nothing else run in between."""
        whole = self.slots.layout.per_page(await moved)
        if outcome is not None:
            outcome(part, whole)
        return whole


class _Tally:
    """One page's block stores (`StagedPages.store_blocks`), counted on the loop: `outcome` told
    of the page when its last block's store ends, with nothing else run in between."""

    def __init__(self, page: bytes, blocks: int, outcome: Outcome | None) -> None:
        self.page, self.left, self.outcome = page, blocks, outcome
        self.whole = True

    async def told(self, stored: Awaitable[list[bool]]) -> None:
        try:
            self.whole = all(await stored) and self.whole
        except BaseException:
            self.whole = False
            raise
        finally:
            self.left -= 1
            if not self.left and self.outcome is not None:
                self.outcome([self.page], [self.whole])
