"""Prometheus metrics show the right values after a known sequence of operations."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

import kvtier_async as kt
from kvtier_async.metrics import watch
from kvtier_async.testing import make_key


@pytest.mark.asyncio
async def test_cache_and_tier_metrics_after_known_operations() -> None:
    registry = CollectorRegistry()
    device = torch.arange(64 * 1024, dtype=torch.int32).reshape(64, 1024)
    spec = kt.OffloadingSpec(
        block_nbytes=4096,
        num_cpu_blocks=8,
        namespace="metrics",
        secondary_tiers=[{"type": "memory", "capacity_bytes": 6 * 4096}],
    )
    keys = kt.block_hashes(range(16 * 8), 16, namespace="metrics")
    async with kt.TieredKVCache(spec, device) as cache:
        watch(cache, registry)
        assert await cache.store(keys, list(range(8))) == 8
        await cache.flush()
        assert await cache.load(keys[:4], list(range(10, 14))) == 4
        assert await cache.load(kt.block_hashes(range(10**6, 10**6 + 16), 16), [20]) == 0

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        tier = {"tier": "memory", "type": "memory", "namespace": "metrics"}
        assert value("kvtier_tier_stored_blocks_total", **tier) == 8
        assert value("kvtier_tier_stored_bytes_total", **tier) == 8 * 4096
        assert value("kvtier_tier_evictions_total", **tier) == 2  # room for 6 of the 8
        assert value("kvtier_tier_stores_dropped_total", **tier) == 0
        assert spec.limits.chunk_blocks == 2  # so the cache wrote to the tier in 4 calls
        assert value("kvtier_tier_operation_seconds_count", op="store", **tier) == 4
        assert value("kvtier_tier_operation_seconds_count", op="load", **tier) == 0
        assert value("kvtier_cache_stored_blocks_total", namespace="metrics") == 8
        assert value("kvtier_cache_loaded_blocks_total", namespace="metrics") == 4
        assert value("kvtier_cache_primary_hit_blocks_total", namespace="metrics") == 4
        assert value("kvtier_cache_load_calls_total", namespace="metrics") == 2
        assert value("kvtier_cache_loaded_from_total", namespace="metrics", tier="primary") == 4
        assert value("kvtier_cache_loaded_from_total", namespace="metrics", tier="memory") == 0
        assert await cache.lookup(keys) == 8
        assert value("kvtier_cache_lookup_calls_total", namespace="metrics") == 1
        assert value("kvtier_cache_found_blocks_total", namespace="metrics", tier="primary") == 8
        assert value("kvtier_cache_primary_pinned_blocks", namespace="metrics") == 0
        assert value("kvtier_cache_primary_capacity_blocks", namespace="metrics") == 8
        assert value("kvtier_lane_inflight", lane="memory/store") == 0
        assert value("kvtier_lane_queued", lane="bytes_in_flight") == 0
        assert b"kvtier_tier_operation_seconds_bucket" in generate_latest(registry)


@pytest.mark.asyncio
async def test_a_tier_on_its_own_drops_and_hits() -> None:
    registry = CollectorRegistry()
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8, max_pending_stores=4, namespace="solo")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier({"type": "memory"}, primary.view, spec)
    async with tier:
        watch(tier, registry)
        assert await tier.store([make_key(i) for i in range(6)], list(range(6))) == [True] * 4 + [False] * 2
        assert await tier.load([make_key(0), make_key(5)], [6, 7]) == [True, False]
        labels = {"tier": "memory", "type": "memory", "namespace": "solo"}
        assert registry.get_sample_value("kvtier_tier_stores_dropped_total", labels) == 2
        assert registry.get_sample_value("kvtier_tier_load_hits_total", labels) == 1
        assert registry.get_sample_value("kvtier_tier_load_misses_total", labels) == 1
        count = registry.get_sample_value("kvtier_tier_operation_seconds_count", {**labels, "op": "load"})
        assert count == 1


def test_watching_something_else_is_an_error() -> None:
    with pytest.raises(TypeError, match="TieredKVCache or a SecondaryTierManager"):
        watch(object(), CollectorRegistry())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_with_a_secret_labels_carry_the_namespace_tag_not_its_name(
    tmp_path: object, tier_secret_env: str
) -> None:
    # Leak: metrics are scraped and kept elsewhere; with a secret, which model a tenant serves
    # (the namespace's name) is theirs to tell, so labels carry the tag that stored names carry.
    registry = CollectorRegistry()
    namespace = "tenant-a/llama3-8b"
    tier_config = {"type": "fs", "root": str(tmp_path), "secret_env": tier_secret_env}
    spec = kt.OffloadingSpec(
        block_nbytes=4096, num_cpu_blocks=8, namespace=namespace, secondary_tiers=[tier_config]
    )
    async with kt.TieredKVCache(spec, torch.zeros(8, 4096, dtype=torch.uint8)) as cache:
        watch(cache, registry)
        assert await cache.store([make_key(1)], [0]) == 1
        await cache.flush()
        text = generate_latest(registry).decode()
        tag = cache.tiers[0].codec.namespace_tag.hex()
    assert "tenant-a" not in text and "llama3" not in text
    assert f'namespace="{tag}"' in text
    assert (
        registry.get_sample_value(
            "kvtier_tier_stored_blocks_total", {"tier": "fs", "type": "fs", "namespace": tag}
        )
        == 1
    )
