"""How much of a prefix a hybrid model can restore from storage: `hit_answer`, SGLang's
`batch_exists_v2` answer, decided from which pages each pool holds (no I/O here).

SGLang's controller asks once for the KV pages and a hybrid model's other pools together, each
pool with its hit policy (`PoolHitPolicy`); the answer is SGLang's own `HiCacheFile`'s for the
same stored pages:

- the KV pages' leading run is the most that can be restored (`kv_hit_pages`);
- `ALL_PAGES` (DSA / draft indexers): every page of the prefix must be in the pool, so the
  pool's first gap cuts the prefix there;
- `TRAILING_PAGES` (Mamba / linear-attention state, sliding windows): a prefix of n pages
  can be restored when the pool holds its last `len(keys)` pages (1 for Mamba state, the
  window for SWA); state exists only at some node boundaries, so the restorable lengths are a
  set, not a run (`restorable_prefix_pages`: SGLang intersects the ranks' sets);
- each pool reports its own boundary in `extra_pool_hit_pages` (omitted when 0, as the pools
  after an empty intersection are); `kv_hit_pages` is the longest length every pool restores.

`BLOCK_GROUPS` (DeepSeek V4's compressed pools; no 0.5.23 code path sends it, and `HiCacheFile`
raises `ValueError` for it): SGLang's definition is whole key groups of `group_pages` pages
from the span start, a verdict of the pool's own that never gates the KV hit. So the pool
reports the pages its leading whole groups cover within the KV hit, and the KV prefix and the
restorable lengths stay as they are. A group cut by a gap or by the KV hit's end counts for
nothing: a half group is never offered to load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

from ..errors import InvalidArgumentError

__all__ = ["hit_answer"]


def hit_answer(
    kv_pages: int, transfers: Sequence[Any], present_of: Callable[[Any], list[bool]]
) -> PoolTransferResult:
    """The answer for a KV hit of `kv_pages` and the extra pools `transfers`; `present_of(name)`
    says, per page of the KV hit, whether pool `name` holds it (asked only while some length is
    still restorable)."""
    policies = [_policy(transfer) for transfer in transfers]  # bad input refused before any answer
    hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer, policy in zip(transfers, policies):
        if not restorable:
            break
        present = present_of(transfer.name)
        if policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i, ok in enumerate(present) if not ok), kv_pages)
            pool_restorable = set(range(1, boundary + 1))
        elif policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(transfer.keys or ()))
            pool_restorable = {
                length for length in range(1, kv_pages + 1) if all(present[max(0, length - window) : length])
            }
            boundary = max(pool_restorable, default=0)
        else:  # BLOCK_GROUPS: the pool's own verdict, gating nothing
            group = int(transfer.group_pages)
            whole = 0
            while whole + group <= kv_pages and all(present[whole : whole + group]):
                whole += group
            boundary, pool_restorable = whole, set(restorable)
        if boundary:
            hits[transfer.name] = boundary
        restorable = [length for length in restorable if length in pool_restorable]
    return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)


def _policy(transfer: Any) -> PoolHitPolicy:
    try:
        policy = PoolHitPolicy(transfer.hit_policy)
    except ValueError:
        raise InvalidArgumentError(f"{transfer.name}: unknown hit policy {transfer.hit_policy!r}") from None
    if policy == PoolHitPolicy.BLOCK_GROUPS and int(transfer.group_pages or 0) <= 0:
        raise InvalidArgumentError(f"{transfer.name}: a BLOCK_GROUPS transfer needs group_pages > 0")
    return policy
