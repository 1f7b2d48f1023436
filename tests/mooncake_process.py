"""A process that stores blocks into a Mooncake pool through a `MooncakeTier` and stays, so that
its segment (where the master placed them) stays too; tests/test_mooncake_tier.py reads them
from another process.

python mooncake_process.py MASTER PREFIX COUNT [SECRET_ENV]
    stores COUNT blocks of `block(i)` under `make_key(i)`, prints "stored N" (N acknowledged),
    and keeps the tier open until stdin closes
"""

from __future__ import annotations

import asyncio
import hashlib
import sys

import kvtier_async as kt
from kvtier_async.testing import make_key

BLOCK_NBYTES = 64 << 10
SPEC = kt.OffloadingSpec(block_nbytes=BLOCK_NBYTES, num_cpu_blocks=8, namespace="mooncake-processes")


def block(i: int) -> bytes:
    """The bytes of block i: the same in every process."""
    seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (seed * (BLOCK_NBYTES // len(seed) + 1))[:BLOCK_NBYTES]


async def main(master: str, prefix: str, count: int, secret_env: str | None) -> None:
    primary = kt.PrimaryTier(SPEC, pin_memory=False)
    config: dict[str, object] = {
        "type": "mooncake",
        "master": master,
        "prefix": prefix,
        "segment_bytes": 32 << 20,
    }
    if secret_env:
        config["secret_env"] = secret_env
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, SPEC) as tier:
        for i in range(count):
            primary.slot_view(i)[:] = block(i)
        stored = await tier.store([make_key(i) for i in range(count)], list(range(count)))
        print(f"stored {sum(stored)}", flush=True)
        await asyncio.to_thread(sys.stdin.read)


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0], args[1], int(args[2]), args[3] if len(args) > 3 else None))
