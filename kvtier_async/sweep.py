"""The trace sweep: a trace's hit rate at many fs-tier capacities, with no I/O.

Each request goes through the same steps the cache takes for it at concurrency 1 (`lookup`,
`load` of the found prefix chunk by chunk, promoting from the fs tier into the primary tier,
then `store` of the rest, written through to the fs tier unless it holds the block), but
only the bookkeeping runs: the primary tier's own slot state and LRU (`PrimaryTier`, its
memory never touched) and the fs tier's own index and LRU (`SlabIndex`, with slabs claimed
as the fs tier claims them, sized by the same `slab_geometry`). So the sweep's hit rate is
what the real tiers' eviction gives, not a model of it, and a replay at concurrency 1 on
the same capacities measures the same (the replay reports both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .primary import PrimaryTier
from .spec import OffloadingSpec
from .tiers.fs.index import Claim, OwnSlab, SlabIndex
from .tiers.fs.layout import ENTRY, record_bytes_for
from .tiers.fs.slab_files import slab_geometry
from .trace import Request

__all__ = [
    "DEFAULT_FRACTIONS",
    "capacity_for_fraction",
    "format_sweep",
    "save_sweep_plot",
    "simulate",
    "sweep",
    "sweep_figure",
    "sweep_report",
    "unbounded_hits",
]

#: Default sweep points: fs capacities holding these fractions of the trace's distinct blocks.
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0)


def block_key(hash_id: int) -> bytes:
    """The kvtier key of a trace's block (as the replay stores it)."""
    return b"trace:" + hash_id.to_bytes(8, "big")


def capacity_for_fraction(requests: list[Request], block_bytes: int, fraction: float) -> int:
    """fs `capacity_bytes` whose records hold `fraction` of the trace's distinct blocks."""
    distinct = len({h for request in requests for h in request.hash_ids})
    records = max(1, round(fraction * distinct))
    return records * (record_bytes_for(block_bytes) + 4 * ENTRY)


def unbounded_hits(requests: list[Request]) -> tuple[int, int]:
    """(blocks, tokens) an unbounded prefix cache would hit on `requests` in this order: each
    request's leading blocks that an earlier request had."""
    seen: set[int] = set()
    blocks = tokens = 0
    for request in requests:
        for b, hash_id in enumerate(request.hash_ids):
            if hash_id not in seen:
                break
            blocks += 1
            tokens += request.block_tokens(b)
        seen.update(request.hash_ids)
    return blocks, tokens


@dataclass
class _FsModel:
    """The fs tier's index with no files: slabs claimed as `Room` claims them, then LRU eviction."""

    index: SlabIndex
    slab_records: int
    max_slabs: int
    claimed: int = 0
    evictions: int = 0
    writes: int = 0

    def holds(self, key: bytes) -> bool:
        return self.index.find(key) is not None

    def read(self, key: bytes) -> None:
        pinned = self.index.pin(key)  # a read pins the record, and its unpin makes it newest
        if pinned is not None:
            self.index.unpin(*pinned)

    def write(self, key: bytes) -> None:
        if self.index.find(key) is not None:
            return  # the tier holds it: not written again
        if not self.index.free and self.claimed < self.max_slabs:
            state = OwnSlab(records=self.slab_records, data_fd=-1, log_fd=-1, log_entries=0, end=0)
            self.index.take_claim(Claim(self.claimed, state, [], disk_full=False))
            self.claimed += 1
        taken = self.index.take_free()
        if taken is not None:
            where = taken[0]
        else:
            evicted = self.index.evict_oldest()
            if evicted is None:
                return
            self.evictions += 1
            where = evicted[1]
        self.index.publish(key, where, 0)
        self.writes += 1


def simulate(
    requests: list[Request], block_bytes: int, primary_bytes: int, fs_capacity_bytes: int | None
) -> dict[str, Any]:
    """Hit rates, per tier, of `requests` through a primary tier of `primary_bytes` and (unless
    None) an fs tier of `fs_capacity_bytes`, at concurrency 1."""
    spec = OffloadingSpec(block_nbytes=block_bytes, num_cpu_blocks=max(1, primary_bytes // block_bytes))
    chunk = spec.limits.chunk_blocks
    # The slot bookkeeping of a primary tier that size; 4 KiB slots of address space, never touched.
    primary = PrimaryTier(
        OffloadingSpec(block_nbytes=4096, num_cpu_blocks=spec.num_cpu_blocks),
        pin_memory=False,
        resident=False,
    )
    fs = None
    if fs_capacity_bytes is not None:
        record_bytes = record_bytes_for(block_bytes)
        slab_records, max_slabs = slab_geometry(record_bytes, fs_capacity_bytes)
        fs = _FsModel(SlabIndex(record_bytes), slab_records, max_slabs)
    blocks = tokens = hit_blocks = hit_tokens = from_primary = from_fs = 0
    for request in requests:
        keys = [block_key(h) for h in request.hash_ids]
        found = 0
        while found < len(keys) and (
            primary.lookup(keys[found]) is not None or (fs is not None and fs.holds(keys[found]))
        ):
            found += 1
        loaded = 0
        for start in range(0, found, chunk):  # load, as `LoadPipeline` stages a chunk
            part = keys[start : start + chunk]
            slots = [primary.acquire(key) for key in part]  # the primary's hits, pinned first
            hits = [slot is not None for slot in slots]
            cut = len(part)
            for j, key in enumerate(part):  # then the misses, promoted from the fs tier
                if hits[j]:
                    continue
                slot = primary.allocate(key) if fs is not None and fs.holds(key) else None
                if slot is None:
                    cut = j
                    break
                fs.read(key)  # type: ignore[union-attr]  # holds() said it is there
                primary.publish(slot)
                slots[j] = slot
            from_primary += sum(hits[:cut])
            from_fs += cut - sum(hits[:cut])
            for slot in slots:
                if slot is not None:
                    primary.unpin(slot)
            loaded += cut
            if cut < len(part):
                break
        for start in range(loaded, len(keys), chunk):  # store: into the primary, written through
            pinned = []
            for key in keys[start : start + chunk]:
                if primary.lookup(key) is not None:
                    continue  # held: not copied again
                slot = primary.allocate(key)
                if slot is None:
                    break
                primary.publish(slot)
                pinned.append(slot)
                if fs is not None:
                    fs.write(key)
            for slot in pinned:
                primary.unpin(slot)
        blocks += len(keys)
        tokens += request.input_length
        hit_blocks += loaded
        hit_tokens += sum(request.block_tokens(b) for b in range(loaded))
    blocks = max(1, blocks)
    return {
        "fs_capacity_bytes": fs_capacity_bytes,
        "primary_bytes": primary_bytes,
        "hit_rate": hit_blocks / blocks,
        "token_hit_rate": hit_tokens / max(1, tokens),
        "primary_hit_rate": from_primary / blocks,
        "fs_hit_rate": from_fs / blocks,
        "fs_bytes_written": (fs.writes if fs else 0) * block_bytes,
        "fs_evictions": fs.evictions if fs else 0,
        "primary_evictions": primary.evictions,
    }


def sweep(
    requests: list[Request], block_bytes: int, primary_bytes: int, capacities: list[int]
) -> list[dict[str, Any]]:
    """`simulate` at each fs capacity."""
    return [simulate(requests, block_bytes, primary_bytes, capacity) for capacity in capacities]


def sweep_report(
    requests: list[Request], block_bytes: int, primary_bytes: int, capacities: list[int] | None = None
) -> dict[str, Any]:
    """The sweep at `capacities` (default: `DEFAULT_FRACTIONS` of the trace's distinct blocks),
    with the unbounded cache's hit rate and the smallest capacity reaching 80% of it."""
    if capacities is None:
        capacities = [capacity_for_fraction(requests, block_bytes, f) for f in DEFAULT_FRACTIONS]
    points = sweep(requests, block_bytes, primary_bytes, sorted(capacities))
    blocks = sum(len(r.hash_ids) for r in requests)
    distinct = len({h for r in requests for h in r.hash_ids})
    attainable = unbounded_hits(requests)[0] / max(1, blocks)
    enough = next((p["fs_capacity_bytes"] for p in points if p["hit_rate"] >= 0.8 * attainable), None)
    for point in points:
        records = point["fs_capacity_bytes"] // (record_bytes_for(block_bytes) + 4 * ENTRY)
        point["fraction_of_distinct_blocks"] = records / max(1, distinct)
    return {
        "requests": len(requests),
        "blocks": blocks,
        "distinct_blocks": distinct,
        "block_bytes": block_bytes,
        "primary_bytes": primary_bytes,
        "unbounded_hit_rate": attainable,
        "capacity_for_80_percent_of_unbounded": enough,
        "points": points,
    }


def format_sweep(report: dict[str, Any]) -> str:
    gib = 1 << 30
    lines = [
        f"{report['requests']} requests, {report['blocks']} blocks ({report['distinct_blocks']} distinct) of "
        f"{report['block_bytes'] >> 10} KiB; primary tier {report['primary_bytes'] / gib:.2f} GiB; "
        f"an unbounded cache hits {report['unbounded_hit_rate']:.1%}",
        "",
        f"{'fs capacity GiB':>16} {'of distinct':>12} {'hit rate':>9} {'tokens':>7} {'primary':>8} {'fs':>7} "
        f"{'fs written GiB':>15} {'fs evictions':>13}",
    ]
    for p in report["points"]:
        lines.append(
            f"{p['fs_capacity_bytes'] / gib:>16.2f} {p['fraction_of_distinct_blocks']:>12.1%} "
            f"{p['hit_rate']:>9.1%} "
            f"{p['token_hit_rate']:>7.1%} {p['primary_hit_rate']:>8.1%} {p['fs_hit_rate']:>7.1%} "
            f"{p['fs_bytes_written'] / gib:>15.2f} {p['fs_evictions']:>13}"
        )
    enough = report["capacity_for_80_percent_of_unbounded"]
    lines += [
        "",
        "80% of the unbounded hit rate: "
        + (
            f"from {enough / gib:.2f} GiB of fs tier"
            if enough is not None
            else "not reached at these capacities"
        ),
    ]
    return "\n".join(lines)


def sweep_figure(report: dict[str, Any]) -> Any:
    """Hit rate and bytes written against the fs tier's capacity, as a matplotlib figure (needs
    matplotlib; the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 1 << 30
    points = report["points"]
    x = [p["fs_capacity_bytes"] / gib for p in points]
    figure, rate_axis = plt.subplots(figsize=(7, 3.6))
    rate_axis.plot(x, [100 * p["hit_rate"] for p in points], marker="o", label="prefix hit rate")
    rate_axis.axhline(
        100 * report["unbounded_hit_rate"], linestyle="--", color="gray", label="unbounded cache"
    )
    rate_axis.set_xscale("log")
    rate_axis.set_xlabel(f"fs tier capacity (GiB), primary tier {report['primary_bytes'] / gib:.2f} GiB")
    rate_axis.set_ylabel("% of blocks")
    rate_axis.set_ylim(0, 100)
    written_axis = rate_axis.twinx()
    written_axis.plot(
        x, [p["fs_bytes_written"] / gib for p in points], marker="s", color="tab:orange", label="fs written"
    )
    written_axis.set_ylabel("GiB written to the fs tier")
    lines = rate_axis.get_legend_handles_labels()
    more = written_axis.get_legend_handles_labels()
    rate_axis.legend(lines[0] + more[0], lines[1] + more[1], loc="center right", fontsize="small")
    return figure


def save_sweep_plot(report: dict[str, Any], path: Any) -> None:
    """`sweep_figure` as a PNG at `path`."""
    import matplotlib.pyplot as plt

    figure = sweep_figure(report)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
