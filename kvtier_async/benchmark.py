"""`kvtier bench`: what users ask about each configured tier, next to a raw baseline from the same run.

Per tier and block size: store and cold-load GB/s and blocks/s, and call latency
p50 / p99, for requests of `request_blocks` blocks all issued at once (the
scheduler decides what runs). The baseline moves the same bytes in the same
requests at the concurrency the tier's lanes allow, with the plainest code for
that backend:

- fs: O_DIRECT `pwritev` / `preadv` of each request's blocks at its own offset
  of one preallocated file, on as many threads as the tier has;
- memory: a torch copy of each block, on the same threads;
- redis: one redis-py pipeline of SET / GET per request;
- s3: concurrent obstore PUT / GET of each request's blocks;
- other tiers: none (shown as such).

Per tier, for the large blocks: the pipeline overlap of `TieredKVCache` (store +
flush and cold load, against copy-only and I/O-only of the same blocks) and the
event loop's lag during the tier's store and load (a 1 ms ticker).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .cache import TieredKVCache
from .errors import ConfigError
from .factory import SecondaryTierFactory
from .keys import block_hashes
from .measure import (
    GB,
    LoopLag,
    drop_page_cache,
    freeze_startup_heap,
    median_bounds,
    median_tree,
    rates,
    taking_turns,
    timed_requests,
)
from .primary import PrimaryTier
from .raw_baselines import baseline as raw_baseline
from .redact import redacted_config
from .spec import OffloadingSpec
from .tier import SecondaryTierManager
from .tiers.fs import FileSystemTier

__all__ = [
    "BenchConfig",
    "format_lag_rounds",
    "format_table",
    "measure_tier",
    "run_bench",
    "save_plot",
    "secret_ratios",
]

LAYERS = 8  # the stand-in device memory of the pipeline measurement


@dataclass
class BenchConfig:
    #: Tier configs; None: a file-system tier in a temporary directory.
    secondary_tiers: list[dict[str, Any]] | None = None
    block_kib: list[int] = field(default_factory=lambda: [2048, 64])
    mib_per_case: int = 256
    request_blocks: int = 8
    #: Rounds per case (tier and baseline interleaved); numbers are their medians.
    repeat: int = 1
    directory: Path | None = None
    progress: bool = True
    #: Also measure each persistent tier (fs, redis, s3) with a tier secret, in the same rounds:
    #: the cost of sealing (AES-256-GCM) and keyed names, as ratios to the same tier without one.
    with_secret: bool = True


#: Tier types that take a secret; the environment variable the benchmark's fresh secret is in.
SEALABLE = ("fs", "redis", "s3", "mooncake")
BENCH_SECRET_ENV = "KVTIER_BENCH_SECRET"


# -- the tier ------------------------------------------------------------------------------------
async def measure_tier(
    config: dict[str, Any],
    block_nbytes: int,
    blocks: int,
    request_blocks: int,
    tag: str,
    **spec_fields: Any,
) -> dict[str, Any]:
    """One round of one tier: `blocks` random blocks stored, then loaded cold, in requests of
    `request_blocks` all issued at once; `spec_fields` go to the `OffloadingSpec` as they are."""
    spec = OffloadingSpec(
        block_nbytes=block_nbytes, num_cpu_blocks=blocks, namespace=f"kvtier-bench-{tag}", **spec_fields
    )
    primary = PrimaryTier(spec)
    primary.buffer.view(-1)[:] = torch.randint(0, 256, (primary.buffer.numel(),), dtype=torch.uint8)
    expected = primary.buffer.clone()
    keys = block_hashes(range(blocks * 16), 16, namespace=spec.namespace)
    groups = [list(range(i, min(i + request_blocks, blocks))) for i in range(0, blocks, request_blocks)]
    tier = SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)
    async with tier:
        await tier.lookup(keys[:1])  # opened outside the timing
        with LoopLag() as lag:
            cpu = time.process_time()
            store_s, store_lat = await timed_requests(
                [partial(tier.store, [keys[i] for i in g], g) for g in groups]
            )
            store_cpu = time.process_time() - cpu
            # Between the phases, the harness's work (not the tier's) is left out of the lag: on
            # 2 cores its ticks (up to 4.5 ms) were among a window's two worst in every fs round,
            # so they set its p99. And off the loop: zeroing here was a 10 to 40 ms stall.
            with lag.paused():
                await _forget_cached_pages(tier)
                await asyncio.to_thread(primary.buffer.zero_)
            cpu = time.process_time()
            load_s, load_lat = await timed_requests(
                [partial(tier.load, [keys[i] for i in g], g) for g in groups]
            )
            load_cpu = time.process_time() - cpu
        stats = tier.stats()
        exact = bool(torch.equal(primary.buffer, expected))
        await tier.delete(keys)  # a shared tier keeps nothing of the benchmark
    await _remove_namespace_directory(tier)
    nbytes = blocks * block_nbytes
    # The CPU time of this process's threads (not a server's) per GB moved: what sealing costs
    # where throughput alone would hide it behind another bottleneck, or in the noise.
    return {
        "store": {**rates(nbytes, blocks, store_s, store_lat), "cpu_s_per_gb": store_cpu * GB / nbytes},
        "load": {**rates(nbytes, blocks, load_s, load_lat), "cpu_s_per_gb": load_cpu * GB / nbytes},
        "stored_blocks": stats["stored_blocks"],
        "load_hits": stats["load_hits"],
        "exact": exact and stats["load_hits"] == blocks,
        "loop_lag": lag.summary(),
    }


async def _opened_once(config: dict[str, Any]) -> None:
    """Make a tier, open it and close it, before the start-up heap is frozen: what opening
    brings in for good (its backend's modules: ~20,000 objects with redis-py) is then frozen
    with the rest, as in a serving process, which opens its tiers before it freezes
    (docs/production.md). Frozen first, each full collection in a timed step walked them:
    17-37 ms of the loop's CPU in the Redis tier's 64 KiB stores."""
    spec = OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1, namespace="kvtier-bench-start-up")
    primary = PrimaryTier(spec)
    async with SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        await tier.open()
    await _remove_namespace_directory(tier)


async def _forget_cached_pages(tier: SecondaryTierManager) -> None:
    root = getattr(tier, "directory", None)
    if isinstance(root, Path):
        await asyncio.to_thread(drop_page_cache, root)


async def _remove_namespace_directory(tier: SecondaryTierManager) -> None:
    """Once a round's fs tier is closed, its namespace directory: the benchmark's own namespace
    (`kvtier-bench-<tag>`), whose blocks the round has just deleted. Deleted blocks leave their
    slab files for the namespace to reuse, and `run_bench` gives every round a fresh namespace:
    each round of 256 MiB left 512 MiB (its slab and the next, made ahead), and 24 rounds of
    bench/tier_secret.py filled the 46 GB the disk had free. So every round starts from no
    files, whatever its tag. Only our own fs tier's: another tier's `directory` may be all it
    holds."""
    if isinstance(tier, FileSystemTier):
        await asyncio.to_thread(shutil.rmtree, tier.directory)


async def _measure_pipeline(
    config: dict[str, Any], block_nbytes: int, blocks: int, tag: str
) -> dict[str, float]:
    """Store + flush and cold load through a cache, against copy-only and I/O-only of the same blocks."""
    width = block_nbytes // LAYERS
    layers = [torch.randint(0, 256, (blocks, width), dtype=torch.uint8) for _ in range(LAYERS)]
    spec_bytes = width * LAYERS
    ids = list(range(blocks))
    keys = block_hashes(range(blocks * 16), 16, namespace=f"kvtier-bench-pipe-{tag}")

    def spec(tiers: list[dict[str, Any]], num_cpu_blocks: int) -> OffloadingSpec:
        return OffloadingSpec(
            block_nbytes=spec_bytes,
            num_cpu_blocks=num_cpu_blocks,
            secondary_tiers=tiers,
            namespace=f"pipe-{tag}",
        )

    out: dict[str, float] = {}
    async with TieredKVCache(spec([], blocks), layers) as cache:
        out["store_copy_s"], _ = await timed_requests([lambda: cache.store(keys, ids)])
        out["load_copy_s"], _ = await timed_requests([lambda: cache.load(keys, ids)])
        slots = [cache.primary.lookup(key) for key in keys]
        tier = SecondaryTierFactory.create_secondary_tier(config, cache.primary.view, cache.spec)
        async with tier:
            await tier.lookup(keys[:1])
            out["store_io_s"], _ = await timed_requests([lambda: tier.store(keys, slots)])  # type: ignore[arg-type]
            await _forget_cached_pages(tier)
            out["load_io_s"], _ = await timed_requests([lambda: tier.load(keys, slots)])  # type: ignore[arg-type]
            await tier.delete(keys)
    primary_blocks = max(8, blocks // 2)  # the work proceeds in chunks through a smaller primary
    async with TieredKVCache(spec([config], primary_blocks), layers) as cache:
        await cache.lookup(keys[:1])

        async def store() -> None:
            await cache.store(keys, ids)
            await cache.flush()

        out["store_pipeline_s"], _ = await timed_requests([store])
        # Other blocks push every one of ours out of the primary tier: the load is cold.
        others = block_hashes(range(10**9, 10**9 + 16 * primary_blocks), 16, namespace=f"filler-{tag}")
        await cache.store(others, ids[:primary_blocks])
        await cache.flush()
        await _forget_cached_pages(cache.tiers[0])
        loaded: list[int] = []

        async def load() -> None:
            loaded.append(await cache.load(keys, ids))

        out["load_pipeline_s"], _ = await timed_requests([load])
        out["loaded_blocks"] = float(loaded[0])
        await cache.tiers[0].delete(keys + others)  # a shared tier keeps nothing of the benchmark
    await _remove_namespace_directory(cache.tiers[0])
    out["store_ratio"] = out["store_pipeline_s"] / max(out["store_copy_s"], out["store_io_s"])
    out["load_ratio"] = out["load_pipeline_s"] / max(out["load_copy_s"], out["load_io_s"])
    return out


# -- the whole run --------------------------------------------------------------------------------
async def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Every case, as plain data: {"config", "idle_loop_lag", "cases", "pipelines"}."""
    if min(config.request_blocks, config.mib_per_case, config.repeat, *config.block_kib, 1) < 1:
        raise ConfigError("kvtier bench: sizes must be positive")
    async with AsyncExitStack() as stack:
        work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="kvtier-bench-", dir=config.directory))
        stack.push_async_callback(asyncio.to_thread, shutil.rmtree, work, True)
        tiers = config.secondary_tiers or [{"type": "fs"}]
        tiers = [_with_root(tier, work / f"tier{n}") for n, tier in enumerate(tiers)]
        sealed = {n: _sealed(tier) if config.with_secret else None for n, tier in enumerate(tiers)}
        if any(sealed.values()) and BENCH_SECRET_ENV not in os.environ:
            from .secret import new_secret

            os.environ[BENCH_SECRET_ENV] = new_secret()  # this process's: never shown
        for tier_config in [*tiers, *filter(None, sealed.values())]:
            await _opened_once(tier_config)
        freeze_startup_heap()
        sides_per_case = {n: 3 if sealed[n] else 2 for n in sealed}
        steps = sum(sides_per_case[n] * len(config.block_kib) + 1 for n in sealed) * config.repeat
        bar = tqdm(total=steps, desc="kvtier bench", unit="step", disable=not config.progress)
        stack.callback(bar.close)
        with LoopLag() as idle:  # the lag of this loop with nothing to do: the baseline for the rest
            await asyncio.sleep(0.5)
        cases, pipelines = [], []
        run_id = uuid.uuid4().hex[:8]  # fresh names: a shared tier may hold an earlier run's blocks
        for n, tier_config in enumerate(tiers):
            name = tier_config["type"] if len(tiers) == 1 else f"{tier_config['type']}#{n}"
            for kib in config.block_kib:
                block = kib * 1024
                blocks = max(config.request_blocks, config.mib_per_case * (1 << 20) // block)
                bar.set_postfix_str(f"{name} {kib} KiB")
                measured_runs: list[dict[str, Any]] = []
                baseline_runs: list[Any] = []
                sealed_runs: list[dict[str, Any]] = []
                # Interleaved, so drifts hit both alike, and taking turns at going first: a server
                # (moto) can slow down as it holds more, and a VM's host can take CPU time back for
                # a while; neither must land on one side only.
                for r in range(config.repeat):
                    tag = f"{run_id}-{n}-{kib}-{r}"
                    tier_run = partial(measure_tier, tier_config, block, blocks, config.request_blocks, tag)
                    raw_run = partial(
                        raw_baseline, tier_config, block, blocks, config.request_blocks, work / f"raw-{tag}"
                    )
                    sides = [(tier_run, measured_runs), (raw_run, baseline_runs)]
                    sealed_config = sealed[n]
                    if sealed_config is not None:
                        sealed_run = partial(
                            measure_tier, sealed_config, block, blocks, config.request_blocks, f"{tag}-s"
                        )
                        sides.append((sealed_run, sealed_runs))
                    for run, runs in taking_turns(sides, r):
                        runs.append(await run())
                        bar.update()
                measured = median_tree(measured_runs)
                baseline = None if baseline_runs[0] is None else median_tree(baseline_runs)
                case = {"tier": name, "type": tier_config["type"], "block_kib": kib, "blocks": blocks}
                case.update(measured)
                case["baseline"] = baseline
                if baseline is not None:
                    case["store_ratio"] = measured["store"]["gbps"] / baseline["store"]["gbps"]
                    case["load_ratio"] = measured["load"]["gbps"] / baseline["load"]["gbps"]
                if sealed_runs:
                    case["with_secret"] = median_tree(sealed_runs)
                    case.update(secret_ratios(sealed_runs, measured_runs))
                # Each round's lag, tier and raw client side by side: a stall that comes once a
                # round is a round's max, which the medians above can hide.
                case["loop_lag_rounds"] = [
                    {"tier": m["loop_lag"], "raw": b["loop_lag"] if b is not None else None}
                    for m, b in zip(measured_runs, baseline_runs, strict=True)
                ]
                cases.append(case)
            block = max(config.block_kib) * 1024
            blocks = max(16, config.mib_per_case * (1 << 20) // block)
            bar.set_postfix_str(f"{name} pipeline")
            pipeline_runs = []
            for r in range(config.repeat):
                pipeline_runs.append(await _measure_pipeline(tier_config, block, blocks, f"{run_id}-{n}-{r}"))
                bar.update()
            pipeline = median_tree(pipeline_runs)
            pipelines.append({"tier": name, "block_kib": max(config.block_kib), "blocks": blocks, **pipeline})
    return {
        "config": {
            "tiers": [redacted_config(t) for t in tiers],
            "block_kib": config.block_kib,
            "mib_per_case": config.mib_per_case,
            "request_blocks": config.request_blocks,
            "repeat": config.repeat,
            "cpus": os.cpu_count(),
        },
        "idle_loop_lag": idle.summary(),
        "cases": cases,
        "pipelines": pipelines,
    }


def secret_ratios(sealed_runs: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The sealed tier's throughput against the unsealed one's, round by round: the median of
    the rounds' ratios, and the rounds' ratios themselves. Both sides of a round run close
    together, so what drifts between rounds (a VM's host taking CPU time back for a while)
    cancels within a round's ratio, where a ratio of the two sides' medians could set one
    round's machine against another's."""
    out: dict[str, Any] = {}
    for op in ("store", "load"):
        ratios = [s[op]["gbps"] / u[op]["gbps"] for s, u in zip(sealed_runs, runs, strict=True)]
        out[f"secret_{op}_ratio"] = statistics.median(ratios)
        out[f"secret_{op}_ratios"] = ratios
    return out


def _sealed(tier: dict[str, Any]) -> dict[str, Any] | None:
    """The tier's config with the benchmark's secret, where it takes one and has none yet."""
    if tier.get("type") not in SEALABLE or "secret_env" in tier or "secret_file" in tier:
        return None
    return {**tier, "secret_env": BENCH_SECRET_ENV}


def _with_root(tier: dict[str, Any], root: Path) -> dict[str, Any]:
    if tier.get("type") == "fs" and "root" not in tier:
        return {**tier, "root": str(root)}
    return dict(tier)


def _lag_parts(lag: dict[str, float]) -> str:
    """The p99s of the loop thread's wait for a CPU and of its own work, where recorded."""
    if "busy_p99_ms" not in lag:  # records made before they were measured
        return ""
    return f"; p99 waiting for a CPU {lag['cpu_wait_p99_ms']:.2f} ms, busy {lag['busy_p99_ms']:.2f} ms"


def format_table(result: dict[str, Any]) -> str:
    """The cases as a text table, then the pipeline overlap and loop lag per tier."""
    head = (
        f"{'tier':<10} {'block':>8} | {'store GB/s':>10} {'raw':>6} {'ratio':>6} | "
        f"{'load GB/s':>9} {'raw':>6} {'ratio':>6} | {'blocks/s st/ld':>15} | "
        f"{'p50/p99 ms store':>17} | {'p50/p99 ms load':>16} | {'secret st/ld':>12} | exact"
    )
    lines = [head, "-" * len(head)]
    for case in result["cases"]:
        base = case["baseline"]
        raw_store = f"{base['store']['gbps']:6.2f}" if base else "   n/a"
        raw_load = f"{base['load']['gbps']:6.2f}" if base else "   n/a"
        ratio_store = f"{case['store_ratio']:5.2f}x" if base else "   n/a"
        ratio_load = f"{case['load_ratio']:5.2f}x" if base else "   n/a"
        st, ld = case["store"], case["load"]
        block = f"{case['block_kib']} KiB"
        secret = (
            f"{case['secret_store_ratio']:5.2f}/{case['secret_load_ratio']:<5.2f}x"
            if "with_secret" in case
            else "n/a"
        )
        exact = case["exact"] and case.get("with_secret", {}).get("exact", True)
        lines.append(
            f"{case['tier']:<10} {block:>8} | {st['gbps']:10.2f} {raw_store} {ratio_store} | "
            f"{ld['gbps']:9.2f} {raw_load} {ratio_load} | "
            f"{st['blocks_per_s']:7.0f}/{ld['blocks_per_s']:<7.0f} | "
            f"{st['p50_ms']:8.1f}/{st['p99_ms']:<8.1f} | "
            f"{ld['p50_ms']:7.1f}/{ld['p99_ms']:<8.1f} | {secret:>12} | {exact}"
        )
    lines.append("")
    idle = result["idle_loop_lag"]
    lines.append(
        f"idle event loop (baseline): lag p50 {idle['p50_ms']:.2f} ms, p99 {idle['p99_ms']:.2f} ms, "
        f"max {idle['max_ms']:.2f} ms"
    )
    for case in result["cases"]:
        if case["block_kib"] == max(result["config"]["block_kib"]):
            lag = case["loop_lag"]
            line = (
                f"{case['tier']}: event-loop lag during its store and load: p50 {lag['p50_ms']:.2f} ms, "
                f"p99 {lag['p99_ms']:.2f} ms, max {lag['max_ms']:.2f} ms{_lag_parts(lag)}"
            )
            raw = (case["baseline"] or {}).get("loop_lag")  # records made before it was measured
            if raw is not None:
                parts = _lag_parts(raw)
                line += f" (raw baseline: p99 {raw['p99_ms']:.2f} ms, max {raw['max_ms']:.2f} ms{parts})"
            if "with_secret" in case:
                sealed_lag = case["with_secret"]["loop_lag"]
                line += (
                    f"; with a secret: p99 {sealed_lag['p99_ms']:.2f} ms, "
                    f"max {sealed_lag['max_ms']:.2f} ms{_lag_parts(sealed_lag)}"
                )
            lines.append(line)
    for pipe in result["pipelines"]:
        lines.append(
            f"{pipe['tier']}: pipeline ({pipe['blocks']} x {pipe['block_kib']} KiB through a cache): "
            f"store {pipe['store_ratio']:.2f}x, load {pipe['load_ratio']:.2f}x the slower of copy-only "
            f"and I/O-only (1.00 = full overlap)"
        )
    described = set()
    for case in result["cases"]:
        if case["tier"] not in described:
            described.add(case["tier"])
            what = case["baseline"]["what"] if case["baseline"] else "none for this type"
            lines.append(f"baseline for {case['tier']}: {what}")
    if any("with_secret" in case for case in result["cases"]):
        paired = any("secret_store_ratios" in case for case in result["cases"])  # not in older records
        how = "the median of the rounds' ratios" if paired else "the ratio of the two sides' medians"
        lines.append(
            "secret st/ld: the same tier with a tier secret (AES-256-GCM, keyed names), as a ratio "
            f"to it without one: {how}"
        )
        lines += [f"  {line}" for line in _secret_bounds(result)]
    return "\n".join(lines)


#: The event loop's lag a tier may add over its raw client's, in every round: its max at most
#: max(LAG_FLOOR_MS, LAG_FACTOR x the raw client's max in that round).
LAG_FLOOR_MS, LAG_FACTOR = 10.0, 1.5


def format_lag_rounds(result: dict[str, Any]) -> str:
    """Per case and round: the loop's lag p99 / max during the tier's store and load, beside the
    raw client's, and whether the tier's max is within the goal."""
    lines = [
        f"event-loop lag per round, ms (goal: tier max <= max({LAG_FLOOR_MS:g}, {LAG_FACTOR:g}x raw max))",
        f"{'tier':<10} {'block':>9} {'round':>5} | {'tier p99':>8} {'max':>7} | "
        f"{'raw p99':>8} {'max':>7} | goal",
    ]
    for case in result["cases"]:
        for n, lags in enumerate(case.get("loop_lag_rounds", [])):
            tier, raw = lags["tier"], lags["raw"]
            if raw is None:
                raw_cells, met = f"{'n/a':>8} {'n/a':>7}", "n/a"
            else:
                raw_cells = f"{raw['p99_ms']:8.2f} {raw['max_ms']:7.2f}"
                met = "yes" if tier["max_ms"] <= max(LAG_FLOOR_MS, LAG_FACTOR * raw["max_ms"]) else "NO"
            lines.append(
                f"{case['tier']:<10} {case['block_kib']:>5} KiB {n:>5} | "
                f"{tier['p99_ms']:8.2f} {tier['max_ms']:7.2f} | {raw_cells} | {met}"
            )
    return "\n".join(lines)


def _secret_bounds(result: dict[str, Any], confidence: float = 0.9) -> list[str]:
    """Per sealed case, where the median of its rounds' sealed/unsealed ratios lies."""
    lines = []
    for case in result["cases"]:
        if "secret_store_ratios" not in case:  # unsealed, or a record made before they were kept
            continue
        parts, cpu = [], []
        for op in ("store", "load"):
            low, high, chance = median_bounds(case[f"secret_{op}_ratios"], confidence)
            parts.append(f"{op} {case[f'secret_{op}_ratio']:.2f}x ({low:.2f}-{high:.2f})")
            cpu.append(f"{case[op]['cpu_s_per_gb']:.2f} -> {case['with_secret'][op]['cpu_s_per_gb']:.2f}")
        lines.append(
            f"{case['tier']} {case['block_kib']} KiB sealed/unsealed: {', '.join(parts)}, the median "
            f"within the bounds with {chance:.0%} confidence ({len(case['secret_store_ratios'])} rounds); "
            f"this process's CPU seconds per GB, unsealed -> sealed: store {cpu[0]}, load {cpu[1]}"
        )
    return lines


def save_plot(result: dict[str, Any], path: Path) -> None:
    """Throughput by tier and block size, ours next to the baseline (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [f"{c['tier']}\n{c['block_kib']} KiB" for c in cases]
    series = {
        "store (kvtier)": [c["store"]["gbps"] for c in cases],
        "store (raw)": [c["baseline"]["store"]["gbps"] if c["baseline"] else 0.0 for c in cases],
        "load (kvtier)": [c["load"]["gbps"] for c in cases],
        "load (raw)": [c["baseline"]["load"]["gbps"] if c["baseline"] else 0.0 for c in cases],
    }
    figure, axes = plt.subplots(figsize=(2.5 + 2.2 * len(cases), 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        axes.bar([i + k * width for i in range(len(cases))], values, width, label=name)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], labels)
    axes.set_ylabel("GB/s")
    axes.set_title("kvtier bench: throughput by tier and block size")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
