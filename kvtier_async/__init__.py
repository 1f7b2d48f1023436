"""kvtier_async: asyncio-native KV-cache offloading across GPU, pinned host memory and shared tiers.

import kvtier_async as kt
spec = kt.OffloadingSpec(block_nbytes=2 << 20, num_cpu_blocks=512,
                         secondary_tiers=[{"type": "memory"}])
async with kt.TieredKVCache(spec, kv_caches) as cache:
    await cache.store(keys, device_block_ids)
    n = await cache.load(keys, device_block_ids)
"""

from .cache import TieredKVCache
from .copy_engine import CopyEngine
from .errors import (
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    KVTierError,
    NamespaceInUseError,
    UnknownTierError,
)
from .factory import SecondaryTierFactory
from .keys import MAX_KEY_BYTES, block_hashes
from .primary import PrimaryTier
from .scheduler import Priority, Scheduler
from .spec import OffloadingSpec, SchedulerLimits
from .tier import SecondaryTierManager

__version__ = "0.1.0"

__all__ = [
    "MAX_KEY_BYTES",
    "ClosedError",
    "ConfigError",
    "CopyEngine",
    "InvalidArgumentError",
    "KVTierError",
    "NamespaceInUseError",
    "OffloadingSpec",
    "PrimaryTier",
    "Priority",
    "Scheduler",
    "SchedulerLimits",
    "SecondaryTierFactory",
    "SecondaryTierManager",
    "TieredKVCache",
    "UnknownTierError",
    "block_hashes",
]
