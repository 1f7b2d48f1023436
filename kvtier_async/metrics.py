"""Prometheus export (extra `metrics`): counters, gauges and latency histograms of caches and tiers.

Off by default. `watch(cache)` registers one collector with a registry (the
default one unless given) and adds the cache, or a tier used on its own, to
what it reports. Nothing is recorded for Prometheus on the hot path: the
collector reads the counters and latency histograms the caches and tiers keep
anyway, when the registry is scraped.

    from prometheus_client import start_http_server
    from kvtier_async.metrics import watch

    watch(cache)
    start_http_server(9400)

Label `namespace` is the namespace's name, or with a tier secret the hex of its tag (as in
stored names), so that scraped metrics do not tell which model a tenant serves.

Per tier (labels `tier`, `type`, `namespace`): `kvtier_tier_<counter>_total` for
stored / failed / dropped / deduplicated blocks, stored and loaded bytes, load
hits and misses, errors, calls skipped while the fault breaker was open, and where the tier
has them corrupt blocks and evictions; `kvtier_tier_operation_seconds` (label `op`: store / load);
`kvtier_lane_inflight` and `kvtier_lane_queued` (label `lane`). Per cache
(label `namespace`): `kvtier_cache_<counter>_total` (lookups and blocks looked up among
them), the primary tier's used / pinned / capacity blocks as gauges, and per tier (label
`tier`: "primary" or a secondary tier's name) `kvtier_cache_found_blocks_total` (leading
blocks lookups found there) and `kvtier_cache_loaded_from_total` (blocks loads took from
there): the hit rate of each tier.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .cache import TieredKVCache
from .tier import SecondaryTierManager

__all__ = ["KVTierCollector", "watch"]

TIER_COUNTERS = (
    "stored_blocks",
    "stored_bytes",
    "store_failed_blocks",
    "stores_dropped",
    "stores_deduplicated",
    "load_hits",
    "load_misses",
    "loaded_bytes",
    "errors",
    "calls_skipped_while_down",
    "queue_timeouts",
    "corrupt_blocks",
    "unauthenticated_blocks",
    "evictions",
    "writes_refused",
    # the Mooncake tier's: transfers that failed, names not held, bad values it removed
    "read_failures",
    "absent_blocks",
    "bad_values_removed",
)
CACHE_COUNTERS = (
    "lookup_calls",
    "lookup_blocks",
    "store_calls",
    "stored_blocks",
    "store_rejected_blocks",
    "load_calls",
    "prefetch_calls",
    "loaded_blocks",
    "primary_hit_blocks",
    "promoted_blocks",
    "bytes_to_host",
    "bytes_to_device",
    "deadline_misses",
    "cascade_errors",
)
CACHE_GAUGES = (
    "primary_used_blocks",
    "primary_pinned_blocks",
    "primary_capacity_blocks",
    "background_stores",
)


class KVTierCollector(Collector):
    """Reports the caches and tiers it watches; holds them weakly, so watching keeps nothing alive."""

    def __init__(self) -> None:
        self._caches: weakref.WeakSet[TieredKVCache] = weakref.WeakSet()
        self._tiers: weakref.WeakSet[SecondaryTierManager] = weakref.WeakSet()

    def watch(self, target: TieredKVCache | SecondaryTierManager) -> None:
        if isinstance(target, TieredKVCache):
            self._caches.add(target)
        elif isinstance(target, SecondaryTierManager):
            self._tiers.add(target)
        else:
            raise TypeError(
                f"can watch a TieredKVCache or a SecondaryTierManager, not {type(target).__name__}"
            )

    def unwatch(self, target: TieredKVCache | SecondaryTierManager) -> None:
        self._caches.discard(target)  # type: ignore[arg-type]
        self._tiers.discard(target)  # type: ignore[arg-type]

    def collect(self) -> Iterator[Any]:
        tier_labels = ["tier", "type", "namespace"]
        counters = {
            name: CounterMetricFamily(f"kvtier_tier_{name}", f"Tier counter {name}", labels=tier_labels)
            for name in TIER_COUNTERS
        }
        latency = HistogramMetricFamily(
            "kvtier_tier_operation_seconds", "Latency of tier store / load calls", labels=[*tier_labels, "op"]
        )
        inflight = GaugeMetricFamily(
            "kvtier_lane_inflight", "Held places (or bytes) of a lane", labels=["lane"]
        )
        queued = GaugeMetricFamily("kvtier_lane_queued", "Calls waiting for a lane", labels=["lane"])
        cache_counters = {
            name: CounterMetricFamily(f"kvtier_cache_{name}", f"Cache counter {name}", labels=["namespace"])
            for name in CACHE_COUNTERS
        }
        # Per tier of a cache ("primary" and each secondary tier): where hits come from.
        per_tier = {
            name: CounterMetricFamily(f"kvtier_cache_{name}", help_text, labels=["namespace", "tier"])
            for name, help_text in (
                ("found_blocks", "Leading blocks lookups found in each tier"),
                ("loaded_from", "Blocks loads and prefetches took from each tier"),
            )
        }
        cache_gauges = {
            name: GaugeMetricFamily(f"kvtier_cache_{name}", f"Cache gauge {name}", labels=["namespace"])
            for name in CACHE_GAUGES
        }
        tiers = list(self._tiers)
        lanes: dict[str, dict[str, int]] = {}
        for cache in list(self._caches):
            stats = cache.stats()
            namespace = namespace_label(cache.tiers, cache.spec.namespace)
            for name in CACHE_COUNTERS:
                cache_counters[name].add_metric([namespace], stats[name])
            for name in CACHE_GAUGES:
                cache_gauges[name].add_metric([namespace], stats[name])
            for name, family in per_tier.items():
                for tier_name, value in stats[name].items():
                    family.add_metric([namespace, tier_name], value)
            lanes.update(stats["scheduler"])
            tiers.extend(cache.tiers)
        for tier in tiers:
            stats = tier.stats()
            labels = [tier.name, tier.tier_type, namespace_label([tier], tier.offloading_spec.namespace)]
            for name in TIER_COUNTERS:
                if name in stats:
                    counters[name].add_metric(labels, stats[name])
            for op, histogram in tier.latency.items():
                latency.add_metric([*labels, op], histogram.cumulative(), histogram.sum_s)
            for direction, lane in stats.get("lanes", {}).items():
                lanes.setdefault(f"{tier.name}/{direction}", lane)
        for name, lane in lanes.items():
            inflight.add_metric([name], lane["inflight"])
            queued.add_metric([name], lane["queued"])
        yield from counters.values()
        yield latency
        yield inflight
        yield queued
        yield from cache_counters.values()
        yield from per_tier.values()
        yield from cache_gauges.values()


def namespace_label(tiers: Iterable[SecondaryTierManager], namespace: str) -> str:
    """The namespace as a label shows it: with a tier secret, the hex of the tag that stands for
    it in stored names (which model a tenant serves is theirs to tell: metrics are scraped
    and kept elsewhere), else its name."""
    for tier in tiers:
        codec = getattr(tier, "codec", None)
        if codec is not None and codec.sealed:
            return str(codec.namespace_tag.hex())
    return namespace


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, KVTierCollector] = weakref.WeakKeyDictionary()


def watch(
    target: TieredKVCache | SecondaryTierManager, registry: CollectorRegistry | None = None
) -> KVTierCollector:
    """Report `target` to `registry` (default: prometheus_client's); one collector per registry."""
    registry = REGISTRY if registry is None else registry
    collector = _collectors.get(registry)
    if collector is None:
        collector = KVTierCollector()
        registry.register(collector)
        _collectors[registry] = collector
    collector.watch(target)
    return collector
