"""`kvtier demo`: a simulated async serving frontend with multi-turn chats over a tiered KV cache.

Many conversations share a system prompt; each turn is a request that loads
the longest cached prefix of its conversation into free device blocks,
"computes" the rest (writes bytes derived from each block's key), and stores
every block back. Every loaded byte is checked against what its key implies,
so a wrong byte anywhere fails the run. CPU tensors stand in for GPU memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from .cache import TieredKVCache
from .keys import block_hashes
from .spec import OffloadingSpec

__all__ = ["DemoConfig", "DemoReport", "run_demo"]


@dataclass(kw_only=True)
class DemoConfig:
    conversations: int = 24
    turns: int = 4
    concurrency: int = 8
    system_prompt_blocks: int = 4
    turn_blocks: int = 3
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    device_blocks: int = 256
    num_cpu_blocks: int = 96
    #: None: a 2 GiB file-system tier in a fresh temporary directory, removed at the end.
    secondary_tiers: list[dict[str, Any]] | None = None
    seed: int = 0
    progress: bool = True

    @property
    def layer_block_nbytes(self) -> int:
        return 2 * self.block_size * self.kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def block_nbytes(self) -> int:
        return self.layers * self.layer_block_nbytes


@dataclass(kw_only=True)
class DemoReport:
    requests: int = 0
    blocks_needed: int = 0
    blocks_loaded: int = 0
    blocks_computed: int = 0
    blocks_verified: int = 0
    mismatches: int = 0
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        reusable = self.blocks_needed
        return self.blocks_loaded / reusable if reusable else 0.0


def _expected_block(key: bytes, layers: int, layer_nbytes: int) -> torch.Tensor:
    """The bytes a block with this key holds: [layers, layer_nbytes] uint8, derived from the key."""
    rows = []
    for layer in range(layers):
        seed = hashlib.blake2b(key + layer.to_bytes(2, "little"), digest_size=64).digest()
        rows.append(torch.frombuffer(bytearray(seed * (layer_nbytes // 64)), dtype=torch.uint8))
    return torch.stack(rows)


class _DeviceBlocks:
    """A free list of device block ids, like a serving engine's block manager."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n))
        self._available = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self._available:
            await self._available.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    async def give(self, ids: list[int]) -> None:
        async with self._available:
            self._free.extend(ids)
            self._available.notify_all()


async def run_demo(config: DemoConfig) -> DemoReport:
    """Run the workload; the report counts mismatches (0 means every loaded byte was right)."""
    if config.secondary_tiers is not None:
        return await _run(config, config.secondary_tiers)
    root = await asyncio.to_thread(tempfile.mkdtemp, prefix="kvtier-demo-")
    try:
        return await _run(config, [{"type": "fs", "root": root, "capacity_bytes": 2 << 30}])
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)


async def _run(config: DemoConfig, secondary_tiers: list[dict[str, Any]]) -> DemoReport:
    max_blocks = config.system_prompt_blocks + config.turns * config.turn_blocks
    if config.device_blocks < max_blocks:
        raise ValueError(f"device_blocks must be at least {max_blocks} (one whole conversation)")
    spec = OffloadingSpec(
        block_nbytes=config.block_nbytes,
        num_cpu_blocks=config.num_cpu_blocks,
        block_size=config.block_size,
        secondary_tiers=secondary_tiers,
        namespace=f"demo-{config.layers}x{config.kv_heads}x{config.head_dim}-bf16",
    )
    # Device memory stand-in: one uint8 tensor per layer, dim 0 = device block id.
    kv = [
        torch.zeros(config.device_blocks, config.layer_block_nbytes, dtype=torch.uint8)
        for _ in range(config.layers)
    ]
    rng = random.Random(config.seed)
    system_prompt = [rng.randrange(32_000) for _ in range(config.system_prompt_blocks * config.block_size)]
    turn_tokens = config.turn_blocks * config.block_size
    histories = {c: list(system_prompt) for c in range(config.conversations)}
    # Turn t of every conversation comes before turn t+1 of any, so each turn reuses the last.
    schedule = [
        (t, c)
        for t in range(config.turns)
        for c in rng.sample(range(config.conversations), config.conversations)
    ]
    report = DemoReport()
    device = _DeviceBlocks(config.device_blocks)
    limit = asyncio.Semaphore(config.concurrency)
    layer_nbytes = config.layer_block_nbytes

    async def verify(keys: list[bytes], ids: list[int]) -> None:
        def check() -> int:
            bad = 0
            for key, block in zip(keys, ids):
                got = torch.stack([layer[block] for layer in kv])
                if not torch.equal(got, _expected_block(key, config.layers, layer_nbytes)):
                    bad += 1
            return bad

        report.mismatches += await asyncio.to_thread(check)
        report.blocks_verified += len(keys)

    async def compute(keys: list[bytes], ids: list[int]) -> None:
        def fill() -> None:
            for key, block in zip(keys, ids):
                expected = _expected_block(key, config.layers, layer_nbytes)
                for layer, row in zip(kv, expected):
                    layer[block].copy_(row)

        await asyncio.to_thread(fill)

    async def request(turn: int, conversation: int, bar: tqdm) -> None:
        async with limit:
            tokens = histories[conversation]
            tokens.extend(rng.randrange(32_000) for _ in range(turn_tokens))
            keys = block_hashes(tokens, config.block_size, namespace=spec.namespace)
            ids = await device.take(len(keys))
            try:
                loaded = await cache.load(keys, ids)
                await verify(keys[:loaded], ids[:loaded])
                await compute(keys[loaded:], ids[loaded:])
                await cache.store(keys, ids)
                report.requests += 1
                report.blocks_needed += len(keys) - config.turn_blocks  # the new turn can't hit
                report.blocks_loaded += loaded
                report.blocks_computed += len(keys) - loaded
            finally:
                await device.give(ids)
                bar.update(1)

    started = time.perf_counter()
    async with TieredKVCache(spec, kv) as cache:
        with tqdm(total=len(schedule), desc="requests", unit="req", disable=not config.progress) as bar:
            # Turns run in waves: a conversation's next turn follows its previous one.
            for turn in range(config.turns):
                wave = [c for t, c in schedule if t == turn]
                await asyncio.gather(*(request(turn, c, bar) for c in wave))
        await cache.flush()
        report.stats = cache.stats()
    report.seconds = time.perf_counter() - started
    return report


def format_report(report: DemoReport, config: DemoConfig) -> str:
    gib = 1 << 30
    stats = report.stats
    lines = [
        f"requests          {report.requests} ({config.conversations} conversations x "
        f"{config.turns} turns, {config.concurrency} at a time)",
        f"block             {config.block_nbytes / (1 << 20):.2f} MiB ({config.layers} layers, "
        f"{config.kv_heads} KV heads, head dim {config.head_dim}, bf16, "
        f"{config.block_size} tokens)",
        f"prefix hit rate   {report.hit_rate:.1%} ({report.blocks_loaded} of "
        f"{report.blocks_needed} reusable blocks loaded, {report.blocks_computed} computed)",
        f"verified          {report.blocks_verified} loaded blocks, {report.mismatches} mismatches",
        f"primary tier      {stats['primary_capacity_blocks']} blocks, "
        f"{stats['primary_hit_blocks']} hits, {stats['promoted_blocks']} promoted, "
        f"{stats['primary_evictions']} evictions",
        f"device <-> host   {stats['bytes_to_host'] / gib:.2f} GiB to host, "
        f"{stats['bytes_to_device'] / gib:.2f} GiB to device",
    ]
    for name, tier in stats["tiers"].items():
        store_rate = (
            tier["stored_bytes"] / tier["store_busy_seconds"] / 1e9 if tier["store_busy_seconds"] else 0.0
        )
        load_rate = (
            tier["loaded_bytes"] / tier["load_busy_seconds"] / 1e9 if tier["load_busy_seconds"] else 0.0
        )
        lines.append(
            f"tier {name:<12} stored {tier['stored_bytes'] / gib:.2f} GiB at {store_rate:.2f} GB/s, "
            f"loaded {tier['loaded_bytes'] / gib:.2f} GiB at {load_rate:.2f} GB/s, "
            f"{tier['load_hits']} hits, {tier['stores_dropped']} dropped"
        )
    lines.append(f"wall time         {report.seconds:.1f} s")
    lines.append(
        "OK: every loaded byte matched"
        if report.mismatches == 0
        else f"FAILED: {report.mismatches} blocks came back wrong"
    )
    return "\n".join(lines)
