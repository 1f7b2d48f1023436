"""`CopyEngine`: copies KV blocks between device memory and primary-tier slots.

The device KV is a list of tensors whose dim 0 is the device block id (one per
layer, or one for everything); the bytes of block `b` across them, in order,
make one `block_nbytes` primary slot. This is the one seam between device
memory and the host.

CUDA (device tensors and a pinned primary tier): each direction has its own
stream. Device -> host first waits for the stream that produced the KV (the
caller's current stream), gathers the scattered blocks into a contiguous device
staging buffer, and moves each run of neighbouring slots with one DMA. Host ->
device is the mirror image, and the caller's current stream is made to wait
for it. Completion is an event polled from the event loop with a short
backoff: no thread and no `synchronize()` on the loop. A cancelled copy still
waits for its DMA to finish, since it reads or writes buffers the caller owns.

Elsewhere (CPU tensors standing in for device memory, or an unpinned primary
tier) the copies run on worker threads, which release the GIL. CPU-to-CPU
copies go through numpy, on the worker alone: torch would split each large
copy over its intra-op OpenMP pool, a second team of busy threads per worker
that nobody sized. On the 2-core test machine that doubled the event loop's
worst stall while storing (six interleaved runs of `bench/loop_lag.py`:
14-23 ms with torch, 4-11 ms with numpy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy
import torch

from .errors import InvalidArgumentError
from .primary import PrimaryTier
from .workers import WorkerThreads

__all__ = ["CopyEngine", "as_layer_list", "block_widths"]


def as_layer_list(kv_caches: Any) -> list[torch.Tensor]:
    """Accept one tensor, a sequence of tensors, or a mapping of name -> tensor (in order)."""
    if isinstance(kv_caches, torch.Tensor):
        layers = [kv_caches]
    elif isinstance(kv_caches, Mapping):
        layers = list(kv_caches.values())
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        layers = list(kv_caches)
    else:
        raise InvalidArgumentError(
            f"kv_caches must be a tensor or a list of tensors, got {type(kv_caches).__name__}"
        )
    if not layers:
        raise InvalidArgumentError("kv_caches must hold at least one tensor")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise InvalidArgumentError(f"kv_caches[{i}] is a {type(layer).__name__}, not a tensor")
    return layers


def block_widths(layers: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of one device block in each layer tensor, after checking the tensors agree.

    Every tensor needs the same dim 0 (the number of device blocks), the same
    device, and a contiguous layout.
    """
    num_blocks = layers[0].shape[0] if layers[0].dim() > 0 else 0
    if num_blocks == 0:
        raise InvalidArgumentError("kv_caches[0] holds no device blocks (dim 0 is 0)")
    widths = []
    for i, layer in enumerate(layers):
        if layer.dim() == 0 or layer.shape[0] != num_blocks:
            raise InvalidArgumentError(
                f"kv_caches[{i}] has shape {tuple(layer.shape)}; every tensor needs dim 0 "
                f"= number of device blocks ({num_blocks})"
            )
        if layer.device != layers[0].device:
            raise InvalidArgumentError(
                f"kv_caches[{i}] is on {layer.device}, kv_caches[0] on {layers[0].device}"
            )
        if not layer.is_contiguous():
            raise InvalidArgumentError(f"kv_caches[{i}] must be contiguous")
        widths.append(layer[0].numel() * layer.element_size())
    return widths


class CopyEngine:
    """Moves blocks between `layers` (dim 0 = device block id) and primary slots."""

    def __init__(self, layers: Sequence[torch.Tensor], primary: PrimaryTier, *, threads: int) -> None:
        widths = block_widths(layers)
        if sum(widths) != primary.block_nbytes:
            raise InvalidArgumentError(
                f"one device block is {sum(widths)} bytes across kv_caches "
                f"({len(layers)} tensors), but spec.block_nbytes is {primary.block_nbytes}"
            )
        num_blocks = layers[0].shape[0]
        self.num_device_blocks = num_blocks
        self.device = layers[0].device
        self._primary = primary
        # Each layer as [num_blocks, width] bytes, with its byte offset inside a slot.
        self._parts: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for layer, width in zip(layers, widths):
            self._parts.append((layer.view(num_blocks, -1).view(torch.uint8), offset, width))
            offset += width
        # The same parts as numpy arrays, made once, where the layers are in host memory too.
        self._numpy_parts = (
            [(part.detach().numpy(), offset, width) for part, offset, width in self._parts]
            if self.device.type == "cpu"
            else None
        )
        self._workers = WorkerThreads(threads, "kvtier-copy")
        self._streams: dict[str, Any] = {}

    @property
    def uses_streams(self) -> bool:
        """Streams and events: when the device is a GPU and the host buffer is pinned (which it
        is once the primary tier is resident; until then, copies wait in worker threads)."""
        return self.device.type == "cuda" and self._primary.pinned

    async def to_host(self, device_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device blocks into primary slots; the device blocks may be reused on return."""
        if not device_ids:
            return
        if self.uses_streams:
            await _await_event(*self._enqueue_to_host(list(device_ids), list(slots)))
        else:
            # Awaited to the end even when cancelled: the thread touches buffers the caller owns.
            await self._workers.run(self._copy_to_host, list(device_ids), list(slots))

    async def to_device(self, slots: Sequence[int], device_ids: Sequence[int]) -> None:
        """Copy primary slots into device blocks; they are valid on return (and for work
        queued afterwards on the caller's current stream)."""
        if not slots:
            return
        if self.uses_streams:
            await _await_event(*self._enqueue_to_device(list(slots), list(device_ids)))
        else:
            await self._workers.run(self._copy_to_device, list(slots), list(device_ids))

    # -- CUDA: enqueue on a side stream, then poll an event ------------------------------------
    def _stream(self, direction: str) -> Any:
        if direction not in self._streams:
            self._streams[direction] = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._streams[direction]

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        # From pinned memory, so the small upload is asynchronous too.
        return torch.tensor(ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _enqueue_to_host(self, device_ids: list[int], slots: list[int]) -> tuple[Any, list[Any]]:
        host = self._primary.buffer
        producer = torch.cuda.current_stream(self.device)
        stream = self._stream("to_host")
        with torch.cuda.stream(stream):
            stream.wait_stream(producer)  # the KV must be complete before we read it
            index = self._device_index(device_ids)
            staging = torch.empty((len(device_ids), host.shape[1]), dtype=torch.uint8, device=self.device)
            for part, offset, width in self._parts:
                staging.narrow(1, offset, width).copy_(part.index_select(0, index))
            for start, first, count in _slot_runs(slots):
                host[first : first + count].copy_(staging[start : start + count], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event, [index, staging]  # kept alive until the event has fired

    def _enqueue_to_device(self, slots: list[int], device_ids: list[int]) -> tuple[Any, list[Any]]:
        host = self._primary.buffer
        stream = self._stream("to_device")
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_stream(consumer)  # earlier work on those device blocks goes first
            staging = torch.empty((len(slots), host.shape[1]), dtype=torch.uint8, device=self.device)
            for start, first, count in _slot_runs(slots):
                staging[start : start + count].copy_(host[first : first + count], non_blocking=True)
            index = self._device_index(device_ids)
            for part, offset, width in self._parts:
                part.index_copy_(0, index, staging.narrow(1, offset, width))
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        consumer.wait_event(event)  # work queued later on the caller's stream sees the blocks
        return event, [index, staging]

    def close(self) -> None:
        self._workers.close()

    # -- elsewhere: copies on worker threads (numpy for host to host, torch otherwise) ---------------

    def _copy_to_host(self, device_ids: list[int], slots: list[int]) -> None:
        host, parts, copy = self._host_side()
        for device_first, slot_first, count in _paired_runs(device_ids, slots):
            rows = host[slot_first : slot_first + count]
            for part, offset, width in parts:
                copy(rows[:, offset : offset + width], part[device_first : device_first + count])

    def _copy_to_device(self, slots: list[int], device_ids: list[int]) -> None:
        host, parts, copy = self._host_side()
        for device_first, slot_first, count in _paired_runs(device_ids, slots):
            rows = host[slot_first : slot_first + count]
            for part, offset, width in parts:
                copy(part[device_first : device_first + count], rows[:, offset : offset + width])

    def _host_side(self) -> tuple[Any, list[tuple[Any, int, int]], Callable[[Any, Any], Any]]:
        """(primary buffer, layer parts, copy(into, source)): numpy arrays and `numpy.copyto`,
        single-threaded with the GIL released, where the layers are in host memory; tensors
        and `Tensor.copy_` otherwise."""
        if self._numpy_parts is not None:
            return self._primary.buffer.numpy(), self._numpy_parts, numpy.copyto
        return self._primary.buffer, self._parts, torch.Tensor.copy_


def _paired_runs(device_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first device id, first slot, count) for runs where both go up by one: a serving
    engine's blocks are often neighbours, and so are freshly allocated slots, so
    whole runs move with one strided copy per layer instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for device_id, slot in zip(device_ids, slots):
        if runs and runs[-1][0] + runs[-1][2] == device_id and runs[-1][1] + runs[-1][2] == slot:
            first_device, first_slot, count = runs[-1]
            runs[-1] = (first_device, first_slot, count + 1)
        else:
            runs.append((device_id, slot, 1))
    return runs


def _slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position in `slots`, first slot, count) for each run of consecutive slot numbers."""
    return _paired_runs(list(range(len(slots))), slots)  # positions always go up by one


async def _await_event(event: Any, keep_alive: list[Any]) -> None:
    """Poll a CUDA event from the event loop (backing off to 1 ms) until it has fired.

    If cancelled meanwhile, keeps waiting, then re-raises: the copy reads or
    writes buffers the caller owns. `keep_alive` holds the staging tensors until then.
    """
    delay = 50e-6
    cancelled: asyncio.CancelledError | None = None
    while not event.query():
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError as exc:
            cancelled = exc
        delay = min(delay * 2, 1e-3)
    del keep_alive[:]
    if cancelled is not None:
        raise cancelled
