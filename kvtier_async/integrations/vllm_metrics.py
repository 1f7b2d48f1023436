"""The Prometheus metrics a kvtier tier reports through vLLM 0.33: their definitions, and the
counters' increments and the gauges of one tier, labelled as vLLM labels its tiers.

vLLM's offloading connector gathers each tier's `OffloadingConnectorStats` (counter
increments since the last call, gauge values) and publishes them under the names that
`build_metric_definitions` declared. This module imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL

from ..tier import SecondaryTierManager as KVTier

__all__ = ["METRICS", "TierMetrics", "metric_definitions", "tier_label"]

COUNTERS = {
    "stored_bytes": "Bytes a kvtier tier stored for vLLM.",
    "stored_blocks": "Chunks a kvtier tier stored for vLLM.",
    "store_failed_blocks": "Chunks a kvtier tier failed to store (I/O errors, no room).",
    "stores_dropped": "Chunks a kvtier tier dropped because its pending-store budget was full.",
    "stores_deduplicated": "Chunks a kvtier tier was asked to store but already held.",
    "loaded_bytes": "Bytes a kvtier tier loaded into vLLM's primary tier.",
    "load_hits": "Chunks a kvtier tier loaded byte-exact.",
    "load_misses": "Chunks a kvtier tier was asked to load but did not have, or failed its checks.",
    "errors": "Backend faults of a kvtier tier (counted, turned into misses and failed stores).",
    "evictions": "Chunks a kvtier tier evicted to make room.",
    "corrupt_blocks": "Chunks a kvtier tier found corrupt on read (a miss, never wrong bytes).",
    "unauthenticated_blocks": (
        "Chunks a kvtier tier with a secret found not to authenticate (another tenant's, forged, "
        "damaged): a miss, never loaded."
    ),
}
GAUGES = {
    "blocks": "Chunks a kvtier tier holds.",
    "used_bytes": "Bytes a kvtier tier uses.",
    "capacity_bytes": "Bytes a kvtier tier may use.",
}
#: The Prometheus metrics `KVTierSecondaryTier` reports through vLLM, by our counter name.
METRICS = {name: f"kvtier:{name}" for name in (*COUNTERS, *GAUGES)}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    labels = (TIER_LABEL,)
    definitions: dict[str, OffloadingMetricMetadata] = {}
    for name, documentation in COUNTERS.items():
        definitions[METRICS[name]] = OffloadingCounterMetadata(documentation=documentation, labelnames=labels)
    for name, documentation in GAUGES.items():
        definitions[METRICS[name]] = OffloadingGaugeMetadata(documentation=documentation, labelnames=labels)
    return definitions


def tier_label(offloading_spec: Any, tier_type: str, tier: Mapping[str, Any]) -> str:
    """vLLM's label for this tier ("<index + 1>:<type>"), found by matching our config among the
    spec's; "?:kvtier-<type>" where it cannot be told apart from another."""
    configs = getattr(offloading_spec, "secondary_tier_configs", None) or []
    matches = [
        i
        for i, config in enumerate(configs)
        if isinstance(config, Mapping) and config.get("type") == tier_type and config.get("tier") == tier
    ]
    return f"{matches[0] + 1}:{tier_type}" if len(matches) == 1 else f"?:kvtier-{tier['type']}"


class TierMetrics:
    """One tier's figures for vLLM, under its label."""

    def __init__(self, label: str) -> None:
        self.labels = (label,)
        self._reported: dict[str, int] = {}  # counters already reported by `stats`
        self._gauges: dict[str, int] = {}  # refreshed on the loop thread as jobs finish

    def refresh_gauges(self, tier: KVTier) -> None:
        """On the loop thread, which owns the tier's index."""
        backend = tier.backend_stats()
        self._gauges = {name: backend[name] for name in GAUGES if isinstance(backend.get(name), int)}

    def stats(self, tier_counters: Mapping[str, int]) -> OffloadingConnectorStats | None:
        """Counter increments since the last call, and the gauges; None when there is nothing."""
        counters = dict(tier_counters)  # one C-level copy: safe against the loop thread
        stats = OffloadingConnectorStats()
        for name in COUNTERS:
            delta = counters.get(name, 0) - self._reported.get(name, 0)
            if delta:
                stats.increase_counter(METRICS[name], delta, self.labels)
                self._reported[name] = counters.get(name, 0)
        for name, value in dict(self._gauges).items():
            stats.set_gauge(METRICS[name], value, self.labels)
        return None if stats.is_empty() else stats
