"""`CopyEngine`: copies KV blocks between device memory and primary-tier slots.

The device KV is a list of tensors whose dim 0 is the device block id (one per
layer, or one for everything); the bytes of block `b` across them, in order,
make one `block_nbytes` primary slot. This is the one seam between device
memory and the host: on machines without CUDA the copies run as torch ops on
worker threads (they release the GIL), so the event loop never copies bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .errors import InvalidArgumentError
from .primary import PrimaryTier
from .scheduler import wait_uncancellable

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
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None

    async def to_host(self, device_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device blocks into primary slots; the device blocks may be reused on return."""
        await self._run(self._copy_to_host, list(device_ids), list(slots))

    async def to_device(self, slots: Sequence[int], device_ids: Sequence[int]) -> None:
        """Copy primary slots into device blocks; they are valid on return."""
        await self._run(self._copy_to_device, list(slots), list(device_ids))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def _run(self, fn: Any, *args: Any) -> None:
        if not args[0]:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="kvtier-copy")
        # Awaited to the end even when cancelled: the thread touches buffers the caller owns.
        await wait_uncancellable(asyncio.wrap_future(self._executor.submit(fn, *args)))

    def _copy_to_host(self, device_ids: list[int], slots: list[int]) -> None:
        host = self._primary.buffer
        slot_index = torch.tensor(slots, dtype=torch.long)
        device_index = torch.tensor(device_ids, dtype=torch.long, device=self.device)
        for part, offset, width in self._parts:
            gathered = part.index_select(0, device_index).cpu()
            host.narrow(1, offset, width).index_copy_(0, slot_index, gathered)

    def _copy_to_device(self, slots: list[int], device_ids: list[int]) -> None:
        host = self._primary.buffer
        slot_index = torch.tensor(slots, dtype=torch.long)
        device_index = torch.tensor(device_ids, dtype=torch.long, device=self.device)
        for part, offset, width in self._parts:
            gathered = host.narrow(1, offset, width).index_select(0, slot_index)
            part.index_copy_(0, device_index, gathered.to(self.device))
