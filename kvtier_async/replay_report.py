"""The report of a trace replay: what it counted, as a plain dict, a table and a plot.

`replay.run_replay` fills a `Tally` as requests finish and hands it here with the cache's own
counters (per tier: where loaded blocks came from, bytes, evictions, latency histograms).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .latency import BUCKETS_S
from .measure import LoopLag, percentile
from .trace import Request

if TYPE_CHECKING:
    from .replay import ReplayConfig

__all__ = ["LATE_S", "Tally", "build_report", "format_replay", "save_replay_plot"]

#: A request that starts later than this after its arrival slot is counted late.
LATE_S = 0.1


@dataclass
class Tally:
    requests: int = 0
    blocks: int = 0
    tokens: int = 0
    found_blocks: int = 0  # leading blocks the lookups found
    hit_blocks: int = 0  # leading blocks loaded byte-exact
    hit_tokens: int = 0
    #: Hit tokens per tier, each loaded block counted for the tier that held it at the lookup.
    tier_tokens: Counter[str] = field(default_factory=Counter)
    wrong_bytes: int = 0  # loads that were not byte-exact
    load_seconds: list[float] = field(default_factory=list)
    late_seconds: list[float] = field(default_factory=list)
    #: Per request, in completion order: (seconds into the run, blocks, hit blocks).
    timeline: list[tuple[float, int, int]] = field(default_factory=list)


def _histogram_percentile(histogram: Any, q: float) -> float | None:
    """The upper bound (ms) of the bucket holding quantile `q` of a tier's latency histogram."""
    if histogram is None or not histogram.count:
        return None
    rank, total = q * histogram.count, 0
    for bound, n in zip([*BUCKETS_S, float("inf")], histogram.counts):
        total += n
        if total >= rank:
            return bound * 1e3
    return float("inf")


def build_report(
    config: ReplayConfig,
    requests: list[Request],
    tally: Tally,
    stats: dict[str, Any],
    tier_latency: dict[str, Any],
    lag: LoopLag,
    seconds: float,
    unbounded: tuple[int, int],
    predicted: dict[str, Any] | None,
    window: int,
    interrupted: bool,
) -> dict[str, Any]:
    blocks = max(1, tally.blocks)
    tiers: dict[str, Any] = {
        "primary": {
            "hit_rate": stats["loaded_from"]["primary"] / blocks,
            "token_hit_rate": tally.tier_tokens["primary"] / max(1, tally.tokens),
            "found_rate": stats["found_blocks"]["primary"] / blocks,
            "bytes_written": stats["bytes_to_host"],
            "bytes_read": stats["bytes_to_device"],
            "evictions": stats.get("primary_evictions", 0),
            "capacity_bytes": config.primary_bytes,
            "stores_refused": stats["store_rejected_blocks"],  # no slot free without waiting
        }
    }
    for name, tier in stats["tiers"].items():
        histogram = tier_latency.get(name)
        tiers[name] = {
            "hit_rate": stats["loaded_from"][name] / blocks,
            "token_hit_rate": tally.tier_tokens[name] / max(1, tally.tokens),
            "found_rate": stats["found_blocks"][name] / blocks,
            "bytes_written": tier.get("stored_bytes", 0),
            "bytes_read": tier.get("loaded_bytes", 0),
            "evictions": tier.get("evictions", 0),
            "load_latency_ms": {
                "p50": _histogram_percentile(histogram, 0.5),
                "p99": _histogram_percentile(histogram, 0.99),
                "mean": (histogram.sum_s / histogram.count * 1e3) if histogram and histogram.count else None,
            },
            "errors": tier.get("errors", 0),
            "stores_refused": tier.get("stores_dropped", 0) + tier.get("store_failed_blocks", 0),
        }
    late = tally.late_seconds
    return {
        "trace": str(config.trace),
        "requests": tally.requests,
        "requests_in_trace": len(requests),
        "interrupted": interrupted,
        "blocks": tally.blocks,
        "tokens": tally.tokens,
        "block_bytes": config.block_bytes,
        "hit_rate": tally.hit_blocks / blocks,
        "token_hit_rate": tally.hit_tokens / max(1, tally.tokens),
        "found_rate": tally.found_blocks / blocks,
        "unbounded_hit_rate": unbounded[0] / blocks,
        "unbounded_token_hit_rate": unbounded[1] / max(1, tally.tokens),
        # The sweep's prediction for the same requests and capacities at concurrency 1: what
        # the tiers' eviction alone gives. Hit blocks measured minus predicted is what
        # concurrency (or refused stores) changed: fewer where requests look up blocks another
        # is still computing, more where blocks computed at once are written once, which
        # churns a small tier less.
        "predicted_hit_rate": None if predicted is None else predicted["hit_rate"],
        "hit_blocks_vs_prediction": None
        if predicted is None
        else tally.hit_blocks - round(predicted["hit_rate"] * tally.blocks),
        "wrong_bytes": tally.wrong_bytes,
        "tiers": tiers,
        "load_latency_ms": {
            "p50": percentile(tally.load_seconds, 0.5) * 1e3,
            "p99": percentile(tally.load_seconds, 0.99) * 1e3,
            "max": max(tally.load_seconds, default=0.0) * 1e3,
        },
        "arrivals": None
        if config.speed is None
        else {
            "speed": config.speed,
            "late_requests": sum(s > LATE_S for s in late),
            "late_p99_ms": percentile(late, 0.99) * 1e3,
            "late_max_ms": max(late, default=0.0) * 1e3,
        },
        "loop_lag": lag.summary(),
        "seconds": seconds,
        "config": {
            "tiers": [dict(t) for t in (config.secondary_tiers or [{"type": "fs"}])],
            "primary_bytes": config.primary_bytes,
            "concurrency": config.concurrency,
            "speed": config.speed,
            "settle": config.settle,
            "device_window_blocks": window,
        },
        "timeline": tally.timeline,
    }


def format_replay(report: dict[str, Any]) -> str:
    """The report as a table."""
    gib = 1 << 30
    unbounded = report["unbounded_hit_rate"], report["unbounded_token_hit_rate"]
    lines = [
        f"{report['requests']} of {report['requests_in_trace']} requests"
        + (" (stopped early)" if report["interrupted"] else "")
        + f", {report['blocks']} blocks of {report['block_bytes'] >> 10} KiB, {report['seconds']:.1f} s",
        f"prefix hit rate: {report['hit_rate']:.1%} of blocks, {report['token_hit_rate']:.1%} of tokens "
        f"(an unbounded cache: {unbounded[0]:.1%}, {unbounded[1]:.1%}); "
        f"lookups found {report['found_rate']:.1%}",
        (
            f"predicted at concurrency 1 on these capacities: {report['predicted_hit_rate']:.1%}; "
            f"hit blocks against it: {report['hit_blocks_vs_prediction']:+d}"
            if report["predicted_hit_rate"] is not None
            else "no prediction: the sweep models the primary tier and one fs tier"
        ),
        "stores refused: "
        + ", ".join(f"{name} {tier['stores_refused']}" for name, tier in report["tiers"].items()),
        "",
        f"{'tier':<12} {'hit rate':>9} {'tokens':>7} {'found':>7} {'written GiB':>12} {'read GiB':>9} "
        f"{'evictions':>10} {'load p50/p99 ms (bucket)':>25}",
    ]
    for name, tier in report["tiers"].items():
        latency = tier.get("load_latency_ms")
        shown = (
            f"{latency['p50']:.1f} / {latency['p99']:.1f}" if latency and latency["p50"] is not None else "-"
        )
        lines.append(
            f"{name:<12} {tier['hit_rate']:>9.1%} {tier['token_hit_rate']:>7.1%} {tier['found_rate']:>7.1%} "
            f"{tier['bytes_written'] / gib:>12.2f} {tier['bytes_read'] / gib:>9.2f} {tier['evictions']:>10} "
            f"{shown:>25}"
        )
    load = report["load_latency_ms"]
    lag = report["loop_lag"]
    lines += [
        "",
        f"load calls: p50 {load['p50']:.2f} ms, p99 {load['p99']:.2f} ms, max {load['max']:.2f} ms; "
        f"event-loop lag p99 {lag['p99_ms']:.2f} ms, max {lag['max_ms']:.2f} ms",
    ]
    if report["arrivals"] is not None:
        arrivals = report["arrivals"]
        lines.append(
            f"arrivals at {arrivals['speed']}x: {arrivals['late_requests']} requests started more than "
            f"{LATE_S * 1e3:.0f} ms late (p99 {arrivals['late_p99_ms']:.1f} ms, "
            f"max {arrivals['late_max_ms']:.1f} ms)"
        )
    lines.append(
        f"wrong bytes: {report['wrong_bytes']} loads"
        + ("" if report["wrong_bytes"] == 0 else "  <-- FAILURE")
    )
    return "\n".join(lines)


def save_replay_plot(report: dict[str, Any], path: Path) -> None:
    """The run over time: the cumulative prefix hit rate against the unbounded cache's final one
    (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, rates = [], []
    blocks = hits = 0
    for seconds, request_blocks, request_hits in report["timeline"]:
        blocks += request_blocks
        hits += request_hits
        times.append(seconds)
        rates.append(100 * hits / max(1, blocks))
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.plot(times, rates, label="prefix hit rate so far")
    axis.axhline(
        100 * report["unbounded_hit_rate"], linestyle="--", color="gray", label="unbounded cache (whole run)"
    )
    axis.set_xlabel("seconds into the replay")
    axis.set_ylabel("% of blocks")
    axis.set_ylim(0, 100)
    axis.set_title(f"{Path(report['trace']).name}: {report['requests']} requests")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
