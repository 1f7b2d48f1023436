"""Render docs/performance.md and its plots from the benchmark records in docs/perf/.

    python bench/render_docs.py                 # writes docs/performance.md, docs/sizing.md, docs/img/*.svg
    python bench/render_docs.py --out /tmp/x    # the same, elsewhere (the test suite compares)

Nothing on the page is typed by hand: every number comes from a record that
`bench/run_all.py` saved, with the command and the machine that produced it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from common import TIER_AGAINST_BASELINE, median_bounds, round_ratios

from kvtier_async.benchmark import format_lag_rounds, format_table
from kvtier_async.sweep import sweep_figure

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "perf"
RUN_ALL = "python bench/run_all.py --lmcache-python /path/to/lmcache-venv/bin/python"


def load(name: str) -> dict[str, Any]:
    return json.loads((RECORDS / f"{name}.json").read_text())


def size(kib: int) -> str:
    return f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"


def provenance(record: dict[str, Any]) -> str:
    m = record["machine"]
    return (
        f"Command: `{record['command']}`, {record['date']} at commit `{record['commit']}`. Machine: "
        f"{m['cpus']} x {m['cpu']}, {m['memory_gib']} GiB, Linux {m['kernel']}, disk {m['disk']}, "
        f"Python {m['python']}, torch {m['torch']}."
    )


def ratio_cell(ratios: list[float], digits: int = 2) -> str:
    """A ratio as the page shows it: the median of the rounds' ratios (to `digits` places),
    and the bounds on it."""
    low, high, _ = median_bounds(ratios)
    return f"{statistics.median(ratios):.{digits}f}x [{low:.2f}, {high:.2f}]"


def bounds_rule(round_counts: set[int]) -> str:
    """Which rounds' ratios bound a median, for each number of rounds the page's records have."""
    rules = []
    for n in sorted(round_counts, reverse=True):
        kth, _, chance = median_bounds(range(1, n + 1))  # the ranks themselves
        suffix = "th" if kth % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(kth % 10, "th")
        nth = f"{kth}{suffix} " if kth > 1 else ""
        rules.append(f"of {n} rounds, the {nth}lowest and the {nth}highest ({chance:.0%})")
    return "; ".join(rules)


def save(figure: Any, out: Path, name: str, records: list[str], legend: Any = None) -> str:
    """Write the figure with a footer naming where its numbers came from (and `legend`'s
    entries in a figure legend above it); its Markdown."""
    footer = []
    for record_name in records:
        record = load(record_name)
        m = record["machine"]
        footer.append(
            f"{record_name}: {record['command'][:150]} | {record['date']} {record['commit']} | "
            f"{m['cpus']} x {m['cpu']}, {m['disk']}"
        )
    bottom = 0.03 * len(footer)
    if legend is not None:
        handles, labels = legend.get_legend_handles_labels()
        rows = -(-len(labels) // 3)
        figure.legend(
            handles, labels, loc="lower center", bbox_to_anchor=(0.5, bottom), ncol=3, fontsize="small"
        )
        bottom += 0.045 * rows + 0.02
    figure.tight_layout(rect=(0, bottom, 1, 1))
    figure.text(0.005, 0.005, "\n".join(footer), fontsize=5.5, color="0.4", va="bottom")
    (out / "img").mkdir(parents=True, exist_ok=True)
    plt.rcParams["svg.hashsalt"] = "kvtier"  # stable ids: the same records give the same file
    figure.savefig(out / "img" / name, format="svg", metadata={"Date": None})
    plt.close(figure)
    return f"![{name}](img/{name})"


# -- sections ---------------------------------------------------------------------------------
def fs_section(out: Path) -> list[str]:
    record = load("fs_tier")
    rows = record["results"]
    lines = [
        "## The fs tier against the raw disk",
        "",
        "Our `FileSystemTier` at default settings (only `io_threads` set) beside plain threads",
        "doing O_DIRECT `pwrite` / `pread` of the same random bytes, from and into the same kind",
        "of memory (one region per round for both: where its pages lie changes the speed of",
        "both), in interleaved rounds; a ratio need not equal the quotient of the two medians",
        "beside it. *same tier*: the tier that stored the blocks loads them back, page cache",
        "dropped; *new tier*: a new tier object on the",
        "same root, as a restarted process, loads them again. The raw baseline runs the same",
        "sequence (store, load, load) and each load is set against the raw load at the same point",
        "of it: this virtual disk reads a region more slowly a few seconds after writing it than",
        "at once, so a second load compared with a first would measure the disk, not the tier.",
        "The tier goes first in even rounds, the baseline in odd ones, and the rounds are even in",
        "number: the first large write after a round's set-up runs slower here, whoever makes it.",
        "*anon* memory is our `PrimaryTier` (huge pages);",
        "*shm* is a `/dev/shm` mapping in 4 KiB pages, as vLLM hands its tiers, faulted in in",
        "order, so that its pages mostly lie in order in RAM as well; *scattered* is the same",
        "mapping with its pages faulted in turn with another's, so that no two neighbours are",
        "neighbours in RAM, as on a host that has been up a while. O_DIRECT straight into such",
        "pages gives the device one scatter-list segment per 4 KiB, and this VM's disk then runs",
        "at about half speed (the raw column); the fs tier sees it when it opens and stages its",
        "I/O through huge-page buffers instead (`staging`, see the fs tier's page). The raw",
        "baseline is the disk's best: its threads take one block at a time as they free up (as",
        "LMCache's disk backend does), and for large blocks it runs twice, with one file per block",
        "(one `write` each, LMCache's way) and with distinct offsets of one preallocated file,",
        "each figure the faster of the two; small blocks use the preallocated file only.",
        "Checksums are always written and verified. A round",
        "moves `--gib` of blocks, and at least 32 blocks (`bench/common.py` says why).",
        "",
        provenance(record),
        "",
        "| block | threads | memory | store GB/s (raw) | ratio "
        "| load, same tier (new tier) | raw load, first (second) | ratio, same tier | ratio, new tier |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, raw = r["tier"], r["raw"]
        tiers, raws = [x["tier"] for x in r["rounds"]], [x["raw"] for x in r["rounds"]]
        ratios = [
            ratio_cell(round_ratios(tiers, raws, ours, theirs)) for ours, theirs in TIER_AGAINST_BASELINE
        ]
        lines.append(
            f"| {size(r['block_kib'])} | {r['threads']} | {r['memory']} | {t['store_gbps']:.2f} "
            f"({raw['store_gbps']:.2f}) | {ratios[0]} | {t['load_gbps']:.2f} "
            f"({t['fresh_load_gbps']:.2f}) | {raw['load_gbps']:.2f} ({raw['again_load_gbps']:.2f}) "
            f"| {ratios[1]} | {ratios[2]} |"
        )
    lines += ["", plot_throughput(rows, out), ""]
    return lines


def steady_section() -> list[str]:
    record = load("fs_steady")
    lines = [
        "## A full tier: stores in steady state",
        "",
        "A cache in service is full, and each new block evicts the oldest. The fs tier writes the",
        "new block over the evicted one's record, in place; a cache of one file per block (LMCache's",
        "disk backend) deletes the evicted block's file and writes a new one. This VM's disk writes",
        "extents that were never written (a new file, or a preallocated one) at about half the",
        "speed of written ones, so the first fill above does not show what a full cache gets. Here",
        "a tier whose `capacity_bytes` holds one store's blocks is filled once, then one store of",
        "as many new blocks is timed, beside plain threads overwriting files of one block each in",
        "place (the disk's best case) and, per block, deleting one such file and writing a new",
        "one; the same random bytes from our `PrimaryTier`, the same threads, O_DIRECT throughout,",
        "the tier first in even rounds.",
        "",
        provenance(record),
        "",
        "| block | threads | full tier store GB/s | raw overwrite GB/s | ratio "
        "| raw new files GB/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        overwrite, new_files = (
            ratio_cell(round_ratios(r["rounds"], r["rounds"], "tier_store_gbps", theirs))
            for theirs in ("overwrite_gbps", "new_files_gbps")
        )
        lines.append(
            f"| {size(r['block_kib'])} | {r['threads']} | {r['tier_store_gbps']:.2f} | "
            f"{r['overwrite_gbps']:.2f} | {overwrite} | {r['new_files_gbps']:.2f} | {new_files} |"
        )
    lines.append("")
    return lines


def index_scale_section() -> list[str]:
    record = load("fs_index_scale")
    lines = [
        "## The fs index at scale",
        "",
        "What each process pays in memory for the blocks on disk, how long a restarted process",
        "takes to serve its first lookup, and the garbage collector's longest pause with the index",
        "full (`bench/fs_index_scale.py`). A writer fills a new root with 4 KiB blocks (the index",
        "does not depend on the block size), then looks every key up; a second process opens the",
        "root while the writer holds it and looks every key up; once the writer has exited, a",
        "restarted process opens the root and looks one key up. RSS is counted from just before",
        "each process opens the tier, its keys already made (at 100,000 blocks the tier's own",
        "fixed memory, its threads and heap, is still a large share of it). Lookups are the",
        "fastest of three passes over every key, in batches of 4096. The start-up heap is frozen",
        "(`gc.freeze()`), so a full collection's pause (the collecting thread's CPU time, once a",
        "first collection has freed what the stores and lookups left) is that of what came after,",
        "the index's for the most part. The index keeps no Python object per block (a hash table",
        "and per-slab columns in flat arrays), so no collection walks it; opening still replays",
        "every slab's log. Each size runs first with the tier as it was before this index",
        "(commit a1432f6: dicts of keys and records, an `OrderedDict` for the LRU), then with",
        "the checkout's, one after the other on the same machine. The price of the flat arrays:",
        "a lookup probes the table in numpy (a batch) or in Python (a few keys), slower than a",
        "dict's probe in C, and a restarted process indexes each log entry somewhat slower.",
        "",
        provenance(record),
        "",
        "| blocks | code | RSS per block, writer | RSS per block, second process | open + first "
        "lookup (restarted) | lookups, blocks/s | stores, blocks/s | longest full collection |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        writer, second, restarted = r["writer"], r["second"], r["restarted"]
        lines.append(
            f"| {writer['blocks']:,} | {r['code']} | {writer['rss_bytes_per_block']:.0f} B | "
            f"{second['rss_bytes_per_block']:.0f} B | {restarted['open_first_lookup_s']:.2f} s | "
            f"{writer['lookup_blocks_per_s']:,.0f} | {writer['store_blocks_per_s']:,.0f} | "
            f"{writer['gc_full_pause_ms']:.1f} ms |"
        )
    lines.append("")
    return lines


def peer_medians() -> dict[tuple[int, str, str], dict[str, Any]]:
    """Per block size in MiB, our kind of memory and harness: the median of each side's rounds,
    the rounds' ratios (each round pairs the two on the same minute of the disk) and their
    medians."""
    rounds = load("peers")["results"]
    out: dict[tuple[int, str, str], dict[str, Any]] = {}

    def case_of(r: dict[str, Any]) -> tuple[int, str, str]:
        return r["block_mib"], r["memory"], r.get("harness", "one-process")

    for case in sorted({case_of(r) for r in rounds}, key=lambda c: (-c[0], c[1], c[2])):
        mine = [r for r in rounds if case_of(r) == case]
        kv_keys, lm_keys = zip(*TIER_AGAINST_BASELINE, strict=True)
        out[case] = {
            "lmcache": {k: statistics.median(r["lmcache"][k] for r in mine) for k in lm_keys},
            "kvtier": {k: statistics.median(r["kvtier"][k] for r in mine) for k in kv_keys},
            "round_ratios": {
                k: round_ratios([r["kvtier"] for r in mine], [r["lmcache"] for r in mine], k, theirs)
                for k, theirs in zip(kv_keys, lm_keys)
            },
            "rounds": len(mine),
        }
        out[case]["ratio"] = {k: statistics.median(v) for k, v in out[case]["round_ratios"].items()}
    return out


def plot_throughput(rows: list[dict[str, Any]], out: Path) -> str:
    threads = min(r["threads"] for r in rows)
    # LMCache's side runs from its own memory: its rounds beside our anon ones stand for it.
    peers = peer_medians() if (RECORDS / "peers.json").exists() else {}
    peers = {
        mib: m for (mib, memory, harness), m in peers.items() if (memory, harness) == ("anon", "one-process")
    }
    figure, axes = plt.subplots(1, 2, figsize=(10, 5), sharey=True)
    for ax, what in zip(axes, ("store", "load")):
        for memory, style in (("anon", "-"), ("shm", ":"), ("scattered", "-.")):
            mine = sorted(
                (r for r in rows if r["threads"] == threads and r["memory"] == memory),
                key=lambda r: r["block_kib"],
            )
            x = [r["block_kib"] for r in mine]
            ax.plot(
                x,
                [r["tier"][f"{what}_gbps"] for r in mine],
                "o" + style,
                color="C0",
                label=f"kvtier fs, {memory}",
            )
            ax.plot(
                x,
                [r["raw"][f"{what}_gbps"] for r in mine],
                "s" + style,
                color="C7",
                label=f"raw O_DIRECT, {memory}",
            )
            if memory == "anon" and what == "load":
                ax.plot(
                    x,
                    [r["tier"]["fresh_load_gbps"] for r in mine],
                    "^--",
                    color="C0",
                    alpha=0.6,
                    label="kvtier fs, new tier, anon",
                )
        if peers:
            x = [mib * 1024 for mib in peers]
            ax.plot(
                x,
                [p["lmcache"][f"{what}_gbps"] for p in peers.values()],
                "D",
                color="C1",
                markersize=8,
                label="LMCache 0.5.6 disk (separate runs)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["block_kib"] for r in rows], [size(r["block_kib"]) for r in rows])
        ax.minorticks_off()
        ax.set_title(f"{what}, {threads} threads")
        ax.set_xlabel("block size")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].set_ylim(bottom=0)
    sources = ["fs_tier", "peers"] if peers else ["fs_tier"]
    return save(figure, out, "perf-throughput.svg", sources, legend=axes[1])


def peers_section() -> list[str]:
    record = load("peers")
    medians = peer_medians()
    lines = [
        "## Against LMCache's disk backend",
        "",
        "LMCache 0.5.6's `LocalDiskBackend` in its best configuration here (O_DIRECT, page-aligned",
        "huge-page memory, as many disk threads as our `io_threads`), against our fs tier at its",
        "defaults, on the same disk, in rounds where each goes first in turn, in two harnesses:",
        "*one process* runs both sides in one process over the same memory every round; *processes*",
        "runs each side of each round in a new process of its own, with memory it makes itself, as a",
        "user runs each product (start-up not timed). A ratio is the median of",
        "the rounds' ratios, each round pairing the two on the same minute of the disk. LMCache keeps",
        "no checksum; ours are on. A new LMCache backend knows nothing of an earlier one's files, so",
        "it has no restart figure; ours (*new tier*) is set against LMCache's second load, made at the",
        "same point of the sequence, as the raw baseline's is above. *our memory*: our tier stores",
        "from and loads into our `PrimaryTier` (*anon*) or a `/dev/shm` mapping as vLLM hands its",
        "tiers (*shm*), in rounds of their own, each beside a run of LMCache from its own memory.",
        "",
        provenance(record),
        "",
        "| block | our memory | harness | LMCache store / load (again) GB/s "
        "| kvtier store / load (new tier) GB/s | store ratio | load ratio | load ratio, new tier | rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (mib, memory, harness), m in medians.items():
        lm, kv = m["lmcache"], m["kvtier"]
        ratio = {k: ratio_cell(v) for k, v in m["round_ratios"].items()}
        lines.append(
            f"| {mib} MiB | {memory} | {harness.replace('-', ' ')} "
            f"| {lm['store_gbps']:.2f} / {lm['load_gbps']:.2f} "
            f"({lm['again_load_gbps']:.2f}) | {kv['store_gbps']:.2f} / {kv['load_gbps']:.2f} "
            f"({kv['fresh_load_gbps']:.2f}) | {ratio['store_gbps']} | {ratio['load_gbps']} | "
            f"{ratio['fresh_load_gbps']} | {m['rounds']} |"
        )
    return [*lines, ""]


def vllm_section() -> list[str]:
    record = load("vllm_tiers")
    cases = record["results"]
    lines = [
        "## Inside vLLM, against vLLM's own fs tier",
        "",
        "Both tiers inside vLLM 0.33's real `TieringOffloadingManager`, chunks of random bytes",
        "(at least 32 a round, and 0.5 GiB), a `/dev/shm` primary region, page cache dropped",
        "before each promotion, in interleaved rounds: each tier at its own defaults (what a",
        "user who sets only the directory gets), and both at the same thread count (our",
        "`io_threads`; vLLM's read pool and its write pool each that many). Only the GPU ↔ CPU",
        "copy is left out. vLLM faults every page of a new engine's region in when it makes it;",
        "where in RAM those pages land varies from engine to engine, and vLLM's fs tier reads",
        "and writes straight into them, which on this VM runs at about half speed when they are",
        "scattered; ours stages its I/O then. Every round, with how scattered each engine's",
        "pages were, is in `docs/perf/vllm_tiers.json`.",
        "",
        provenance(record),
        "",
        "| chunk | I/O threads, kvtier / vLLM | store GB/s, kvtier / vLLM | ratio "
        "| promotion, same engine | ratio | promotion, new engine | ratio | rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        ours, theirs = case["medians"]["kvtier"], case["medians"]["vllm-fs"]
        rounds = case["rounds"]["kvtier"], case["rounds"]["vllm-fs"]
        cells = [
            f"{ours[k]:.2f} / {theirs[k]:.2f} | {ratio_cell(round_ratios(*rounds, k, k))}"
            for k in ("store_gbps", "promote_same_gbps", "promote_new_engine_gbps")
        ]
        threads = case["threads_described"]
        lines.append(
            f"| {case['chunk_bytes'] >> 20} MiB | {threads['kvtier']} / {threads['vllm-fs']} | "
            f"{' | '.join(cells)} | {len(case['rounds']['kvtier'])} |"
        )
    return [*lines, ""]


def lag_section(out: Path) -> list[str]:
    record = load("loop_lag")
    r = record["results"]
    lines = [
        "## Event-loop lag",
        "",
        "How late a 1 ms ticker on the serving loop wakes while a `TieredKVCache` stores a GiB to",
        "an fs tier and loads it back cold (uvloop, `gc.freeze()` after start-up, as a serving",
        "process should run). The idle row is the same ticker with nothing else running: the",
        "machine's own floor.",
        "",
        provenance(record),
        "",
        "| window | seconds | p50 ms | p99 ms | max ms | full GCs | CPU stolen by the hypervisor, ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("idle", "store", "load"):
        w = r[name]
        lines.append(
            f"| {name} | {w['seconds']:.2f} | {w['p50_ms']:.2f} | {w['p99_ms']:.2f} | {w['max_ms']:.2f} | "
            f"{int(w['full_gcs'])} | {w['stolen_ms']:.0f} |"
        )
    figure, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
    for ax, name in zip(axes, ("store", "load")):
        points = r["timeline"][name]
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=0.8, color="C0")
        ax.axhline(r["idle"]["max_ms"], color="C7", ls=":", lw=1, label="idle max")
        ax.set_title(f"loop lag during a {name} (worst per 10 ms)")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms late")
    axes[1].legend(fontsize="small")
    lines += ["", save(figure, out, "perf-loop-lag.svg", ["loop_lag"]), ""]
    return lines


def bench_section() -> list[str]:
    record = load("kvtier_bench")
    return [
        "## `kvtier bench`",
        "",
        "The benchmark anyone can run on their own machine and tiers (`kvtier bench --help`): per",
        "tier and block size, store and cold-load throughput and call latency next to a raw",
        "baseline in the same run (O_DIRECT calls for `fs`, torch copies on the same threads for",
        "`memory`), the loop's lag, and how well a cache overlaps copies with tier I/O.",
        "",
        "The lag is a 1 ms timer's lateness through a store and a cold load of 256 MiB, each",
        "issuing all its requests at once: about 200 ticks, so its p99 is the second-worst",
        "tick, most often the burst of the phase's first requests (16 of them, started in one",
        "turn of the loop: 1 to 2 ms here). The benchmark's own work between the two phases",
        "(zeroing the primary memory, dropping the page cache) is left out of the count: its",
        "ticks, up to 4.5 ms, were among the two worst of every fs round.",
        "",
        *bench_table(record),
    ]


def bench_table(record: dict[str, Any]) -> list[str]:
    """Where a `kvtier bench` record came from, then its table (and each round's loop lag,
    where the record kept it)."""
    table = format_table(record["results"])
    if any("loop_lag_rounds" in case for case in record["results"]["cases"]):
        table += "\n\n" + format_lag_rounds(record["results"])
    return [provenance(record), "", "```", table, "```", ""]


#: What the table of each round's loop lag is, where a record has one.
ROUNDS_LAG_TEXT = [
    "Under the table, each round's lag (p99 / max) during the tier's store and load, beside the",
    "raw client's in the same round, against the goal: the tier's max at most 10 ms or 1.5",
    "times the raw client's, whichever is more.",
]


def remote_section() -> list[str]:
    record = load("remote_tiers")
    return [
        "## Shared tiers: Redis and S3",
        "",
        "The Redis and S3 tiers against their own clients used as well as they can be, in the same",
        "run and at the same concurrency: redis-py's asyncio pipelines with hiredis, sending each",
        "value as a `memoryview` (a `bytes` value is copied once more on the event loop by hiredis'",
        "packer, which halves the raw store's speed), and plain obstore GETs and PUTs, a block in",
        "one PUT on both sides (obstore's default makes a value past 5 MiB a multipart upload, at",
        "less than half the speed here). The servers run on this machine (`redis-server`, and",
        "moto's S3 server, which is written in Python and is the slower side of every S3 number):",
        "the figures measure loopback and these servers, not a network. Each round issues every",
        "request of 8 blocks at once, through a tier made for the round (new connections, as after",
        "a restart); the tier and the raw client take turns at going first, each sending blocks",
        "of random bytes of their own (no block sent twice); the table shows medians of the rounds.",
        "",
        "On two cores the client's event loop and the server share the machine, and the loop is",
        "the busy one. The Redis tier moves blocks through connections of its own to a",
        "standalone server: a load is read by the kernel straight into the primary tier, where",
        "redis-py copies each reply four times on the loop, so loads run faster than the raw",
        "client; a store costs a checksum per block more than the raw client's. The S3 tier",
        "copies each block once (into or out of the value with its header) and checksums it, on",
        "worker threads. The lag lines set the loop's lag during each tier's store and load",
        "(the largest blocks) beside its lag during the raw client's, and split each p99: the",
        "time the loop's thread was ready but waited for a CPU (Linux schedstat; here the CPUs",
        "go to the server, moto taking more than one of the two cores during S3 stores, and to",
        "the VM's host, which took back up to a quarter of the CPU time of some 8 MiB S3 rounds,",
        "the raw client's and the tier's alike: stolen time, in `/proc/stat`), and the rest, the",
        "loop busy with its own work or waiting for the GIL.",
        *(ROUNDS_LAG_TEXT if any("loop_lag_rounds" in c for c in record["results"]["cases"]) else []),
        "",
        "In the run below, Redis met that goal in every round at every size, and S3 at 1 MiB missed",
        "it in 3 of 8 rounds (10.2 to 13.9 ms, against the raw client's 5.6 to 7.0 ms). A second",
        "full run at commit `25b673e` (on a slower host moment: every raw throughput about half of",
        "these) had it the other way round: S3 at 1 MiB met it in all 8 rounds, Redis at 64 KiB",
        "missed it in 2 (10.5 and 11.5 ms, against 3.6 and 6.0 ms). A run of 4 rounds of 64 KiB",
        "and 1 MiB (`--block-kib 64 1024 --repeat 4`) and one of 8 rounds of S3 at 1 MiB met it",
        "in every round. The misses sit just past 10 ms, and they are the loop waiting for a CPU,",
        "not working: over the same calls, 64 blocks of 1 MiB each way, the loop's thread never",
        "computed more than 1.9 ms without coming back to the loop (`LoopHold`, the contract kit's",
        "measure; its test bounds every tier at 10 ms). The benchmark alone keeps both cores busy",
        "(a load average of 2 to 3): moto's S3 server, in Python, takes more than a core during",
        "stores, and the tier's worker threads (copies, checksums) are runnable beside the loop",
        "where the raw client has none.",
        "",
        *bench_table(record),
    ]


def secret_section() -> list[str]:
    record = load("tier_secret")
    return [
        "## With a tier secret",
        "",
        "The goals on this 2-core machine, against the run at the end of this section",
        f"(the median of {secret_rounds(record)} interleaved rounds' ratios, the bounds on that median in",
        "brackets): with a secret, the fs tier stores and loads cold at 0.8x or more of its speed",
        "without one, Redis and S3 at 0.9x or more, and the fs tier's event loop lags at most",
        "2 ms at the 99th percentile (uvloop).",
        "",
        *secret_goals_table(record),
        "",
        "Sealed Redis stores miss their goal in this run (0.84x, the bounds 0.78x to 0.92x),",
        "and sealed fs stores at 2 MiB sit at the line. The run before, at commit `0317ef3` on",
        "another host of this VM (2 AMD EPYC cores, where this run had 2 Intel Xeon ones), had",
        "them at 0.93x and 0.86x: here this process spent more CPU time per GB on Redis stores",
        "with and without a secret (0.58 and 0.78 s, against 0.36 and 0.47), and which of the",
        "host and the commits between (the tier secret's fork-safe writer among them) moved the",
        "ratio is not measured. On loopback the server shares the two cores with the benchmark,",
        "both busy, and sealing's CPU time (0.1 to 0.2 s per GB more in this process: the CPU",
        "seconds under the table) comes out of what they share. A round's ratio swings by 0.2x either",
        "way, so a run of 12 rounds could not place the median on either side of 0.9x (its",
        "bounds were about 0.2x apart); hence 24. In an experiment with the server pinned to",
        "one core and the benchmark to the other (12 rounds), sealed stores ran at 0.95x,",
        "against 0.92x unpinned.",
        "",
        "On a server's cores the sealing threads (up to 4, at about 9 GB/s each: some 36 GB/s",
        "together) run beside the I/O rather than in its place, faster than an NVMe drive or a",
        "100 Gb/s link moves data. There a secret should cost CPU time (about 0.1 s per GB each",
        "way, as here) rather than throughput: an estimate from these figures, not measured.",
        "",
        "What sealing costs ([security](security.md)): each persistent tier measured with and",
        "without a tier secret in the same rounds, taking turns at going first (`kvtier bench`,",
        'whose "secret st/ld" column is the sealed tier\'s store and cold-load throughput as a',
        "ratio to the same tier without a secret: the median of the rounds' ratios, with bounds",
        "on that median below each table). Sealed, a block is encrypted and authenticated with",
        "AES-256-GCM (about 9 GB/s per core here, with the GIL released) on a CPU worker thread.",
        "The fs and Redis tiers move it through a fixed pool of sealed values rather than straight",
        "between the primary memory and the disk or the socket: one pass over the block more in",
        "each direction (the S3 tier copies a block into or out of its value either way).",
        "The Redis tier's pool is small (32 MiB, or 16 values where those are larger), so that",
        "a value is opened while it is still in the CPU's cache. With 256 MiB, as the fs tier",
        "has (the disk wants that many reads at once), every loaded value had left the cache by",
        "the time its batch had landed, and was read back from memory to be opened: the memory",
        "traffic of that pass, not AES, was the cost (in an experiment with 256 MiB, 10 rounds:",
        "0.84x, 0.89x with a plain copy in the opening's place, 1.09x with no pass at all).",
        "Values of several MiB have left the cache by the time they have landed whatever the",
        "size, and a pool of fewer than 16 of them kept the server waiting. Stores are sealed",
        "into the pool and sent from it; what they lose is the sealing itself (16 rounds with the",
        "sealing left out: 1.02x with 32 MiB and with 256), and a run's store ratio at 1 MiB",
        "swings: 0.81-0.99x with 32 MiB (nine runs of 8 to 30 rounds), 0.86-0.99x with 256 MiB",
        "(eight). The table: the Redis tier (1 MiB and 8 MiB blocks, 256 MiB stored and loaded",
        "per round) without a secret and with one at each pool cap, in the same rounds. With",
        "8 MiB blocks the 32 and 64 MiB caps make the same pool, of 16 values: their rows differ",
        "by the noise alone.",
        "",
        *redis_sealed_pool_table(),
        "",
        "On this machine's two cores that pass takes a CPU from the tier's own work (the I/O",
        "threads, the event loop, and on loopback the server itself), and a round's ratio",
        "swings by 0.2x either way with what the VM's host takes back. The cost the noise does",
        "not hide is the CPU time this process spends per GB, shown unsealed -> sealed under each",
        "table: about 0.1 s more per GB each way, a core busy for a tenth of the time the data",
        "moves at 1 GB/s.",
        "",
        "The CPU worker threads that seal and open are one fewer than the cores (`copy_threads`,",
        "up to 4): one here. Sealing then never holds both cores, and the loop keeps one for its",
        "wake-ups; with two threads it waited behind them and the kernel's I/O work. The table",
        "sets one thread against two, the fs tier with a secret against it without one in the",
        "same rounds (256 MiB stored and loaded cold per round; medians of the rounds, and of",
        "each round's ratio to the unsealed tier): with one the loop lags less, and neither",
        "stores nor cold loads run faster with two at every block size. With one thread, a cold",
        "load's blocks would be opened one after another at its end if their reads all finished",
        "together; so a block of 16 MiB or more is read in parts by all the I/O threads at once,",
        "loads finish in turn, and each block is opened while the next is read",
        "([fs tier](tiers/fs.md#speed)). What is left is the last block's opening, 3.6 ms per",
        "32 MiB. On a server's cores the threads (up to 4, at about 9 GB/s each) run beside the",
        "I/O rather than in its place; that has not been measured here.",
        "",
        *secret_threads_table(),
        "",
        *bench_table({**record, "results": record["results"]["fs"]}),
        *bench_table({**record, "results": record["results"]["remote"]}),
    ]


#: What the tier secret section holds each tier to: the sealed/unsealed ratio, both ways.
SECRET_GOALS = {"fs": 0.8, "redis": 0.9, "s3": 0.9}
#: The fs tier's event-loop lag p99 with a secret, at most (ms).
SECRET_LAG_GOAL_MS = 2.0


def secret_rounds(record: dict[str, Any]) -> int:
    """How many rounds each sealed case of the tier_secret record ran (the same for all)."""
    (rounds,) = {
        len(case["secret_store_ratios"]) for group in record["results"].values() for case in group["cases"]
    }
    return rounds


def secret_goals_table(record: dict[str, Any]) -> list[str]:
    """Each sealed case of the tier_secret record against its goal."""
    lines = [
        "| tier | block | store, sealed / unsealed | cold load, sealed / unsealed | goal "
        "| loop lag p99, sealed | at goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for group in record["results"].values():
        for case in group["cases"]:
            goal = SECRET_GOALS[case["type"]]
            lag = case["with_secret"]["loop_lag"]["p99_ms"]
            met = min(case["secret_store_ratio"], case["secret_load_ratio"]) >= goal
            if case["type"] == "fs":
                met = met and lag <= SECRET_LAG_GOAL_MS
            store, load = (ratio_cell(case[f"secret_{op}_ratios"], 3) for op in ("store", "load"))
            lines.append(
                f"| {case['type']} | {size(case['block_kib'])} | {store} | {load} "
                f"| {goal:.1f}x{f', lag {SECRET_LAG_GOAL_MS:.0f} ms' if case['type'] == 'fs' else ''} "
                f"| {lag:.2f} ms | {'yes' if met else 'no'} |"
            )
    return lines


def redis_sealed_pool_table() -> list[str]:
    return variants_table(load("redis_sealed_pool"), "Redis tier")


def secret_threads_table() -> list[str]:
    return variants_table(load("secret_threads"), "fs tier")


def variants_table(record: dict[str, Any], tier: str) -> list[str]:
    """A tier's variants against the unsealed tier in the same rounds, per block size."""
    lines = [
        provenance(record),
        "",
        f"| block | {tier} | store GB/s | vs unsealed | load GB/s | vs unsealed | loop lag p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for blocks, variants in record["results"].items():
        for name, row in variants.items():
            lines.append(
                f"| {blocks} | {name} | {row['store_gbps']:.2f} | {row['store_ratio']:.2f}x "
                f"| {row['load_gbps']:.2f} | {row['load_ratio']:.2f}x | {row['lag_p99_ms']:.2f} |"
            )
    return lines


def sglang_section() -> list[str]:
    record = load("sglang_backend")
    results = record["results"]
    lines = [
        "## SGLang: the HiCache storage backend",
        "",
        "`KVTierHiCacheStorage` (the fs tier at its defaults, checksums on) against SGLang's own",
        "`HiCacheFile` and raw O_DIRECT on the same disk, through the calls SGLang's cache controller",
        "makes, 128 pages a call from one thread, over SGLang's real MHA host pool (bf16). The cases:",
        "8 KV heads of 128 and 64 tokens a page, 8 layers (2 MiB pages) or 32 (8 MiB), through the",
        "v1 calls (`interface_v1`: runs moved in place); SGLang's default page size 1 with",
        "a 7B-class GQA geometry (28 layers, 4 KV heads of 128: runs of 1 KiB, each 56 KiB page",
        "packed into one block through page slots); and 2 MiB layer-first pages through the generic",
        "calls SGLang makes without `interface_v1` (flat pages copied through page slots). kvtier's",
        "get runs in a new backend, as after a restart. `HiCacheFile` serves the generic calls (flat",
        "pages made before the clock starts), and its set lands in the page cache (it does not",
        "sync); raw writes each page's runs to a file of its own with `pwritev` on",
        f"{results['cases'][0]['threads']} threads, as many as the fs tier's I/O threads (not for",
        "1 KiB runs: O_DIRECT refuses them). The page cache is dropped before every get. Medians of",
        f"{results['repeat']} rounds, the sides in rotating order; ratios round by round.",
        "",
        provenance(record),
        "",
        "| case | page, run | path | set GB/s kvtier / file / raw | get GB/s kvtier / file / raw "
        "| kvtier / raw: set, get | kvtier / file: set, get | warm `batch_exists` (128 keys) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hybrid = [case for case in results["cases"] if "nodes" in case]
    for case in results["cases"]:
        if "nodes" in case:
            continue  # the hybrid table below
        k, f, r = case["kvtier"], case["file"], case.get("raw")
        raw_set, raw_get = (f"{r['set_gbps']:.2f}", f"{r['get_gbps']:.2f}") if r else ("-", "-")
        vs_raw = f"{case['set_vs_raw']:.2f}x, {case['get_vs_raw']:.2f}x" if r else "-"
        run = f"{case['run_bytes'] >> 10} KiB" if case["run_bytes"] >= 1024 else f"{case['run_bytes']} B"
        lines.append(
            f"| {case['case']} | {case['page_kib']} KiB, {run} | {case['path']} | {k['set_gbps']:.2f} / "
            f"{f['set_gbps']:.2f} / {raw_set} | {k['get_gbps']:.2f} / {f['get_gbps']:.2f} / {raw_get} | "
            f"{vs_raw} | {case['set_vs_file']:.2f}x, {case['get_vs_file']:.2f}x | {k['exists_ms']:.3f} ms |"
        )
    lines += [
        "",
        "Every byte kvtier loaded was checked against what was stored. A warm `batch_exists` is",
        "answered from what the backend remembers, on the calling thread. `HiCacheFile`'s set",
        "figure is a copy into the page cache, not a write to the disk: it swings between rounds",
        "with how much dirty memory the kernel lets it keep, and the disk pays for it later.",
        "",
    ]
    if hybrid:
        lines += sglang_hybrid_table(hybrid)
    return lines


def sglang_hybrid_table(cases: list[dict[str, Any]]) -> list[str]:
    lines = [
        "Hybrid models (SGLang's v2 interface): one radix node of 16 KV pages per call, as",
        "`HybridCacheController` backs up and prefetches a node, its extra pool pages through",
        "`batch_set_v2` / `batch_get_v2` (kvtier: KV in place, the extra pool run by run through page",
        "slots; `HiCacheFile`: KV as flat pages, the extra pool through its own v2; raw: each page's",
        "runs with O_DIRECT, one file a page, node after node, no checksum and no index).",
        "",
        "| case | nodes | KV page, extra page | set GB/s kvtier / file / raw | get GB/s kvtier / file / raw "
        "| kvtier / file: set, get | kvtier / raw: set, get |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        k, f, r = case["kvtier"], case["file"], case.get("raw")
        raw_set, raw_get = (f" / {r['set_gbps']:.2f}", f" / {r['get_gbps']:.2f}") if r else ("", "")
        vs_raw = f"{case['set_vs_raw']:.2f}x, {case['get_vs_raw']:.2f}x" if r else "-"
        lines.append(
            f"| {case['case']} | {case['nodes']} | {case['page_kib']} KiB, {case['extra_pool']} "
            f"{case['extra_page_kib']} KiB | {k['set_gbps']:.2f} / {f['set_gbps']:.2f}{raw_set} | "
            f"{k['get_gbps']:.2f} / {f['get_gbps']:.2f}{raw_get} | "
            f"{case['set_vs_file']:.2f}x, {case['get_vs_file']:.2f}x | {vs_raw} |"
        )
    return [*lines, ""]


def replay_table(replays: list[dict[str, Any]]) -> list[str]:
    gib = 1 << 30
    lines = [
        "| fs capacity | in flight | hit rate: blocks, tokens | the sweep predicted | unbounded "
        "| from primary / fs | fs written GiB | fs evictions | load p50 / p99 ms | seconds | wrong bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in replays:
        tiers = r["tiers"]
        load = r["load_latency_ms"]
        lines.append(
            f"| {r['fs_capacity_bytes'] / gib:.2f} GiB ({r['fraction']:.0%} of distinct) | "
            f"{r['config']['concurrency']} | {r['hit_rate']:.1%}, {r['token_hit_rate']:.1%} | "
            f"{r['predicted_hit_rate']:.1%} | {r['unbounded_hit_rate']:.1%} | "
            f"{tiers['primary']['hit_rate']:.1%} / {tiers['fs']['hit_rate']:.1%} | "
            f"{tiers['fs']['bytes_written'] / gib:.2f} | {tiers['fs']['evictions']} | "
            f"{load['p50']:.1f} / {load['p99']:.1f} | {r['seconds']:.0f} | {r['wrong_bytes']} |"
        )
    return lines


def sweep_table(sweep: dict[str, Any]) -> list[str]:
    gib = 1 << 30
    lines = [
        "| fs capacity | of distinct blocks | hit rate: blocks, tokens | from primary / fs "
        "| fs written GiB | fs evictions |",
        "|---|---|---|---|---|---|",
    ]
    for p in sweep["points"]:
        lines.append(
            f"| {p['fs_capacity_bytes'] / gib:.2f} GiB | {p['fraction_of_distinct_blocks']:.0%} | "
            f"{p['hit_rate']:.1%}, {p['token_hit_rate']:.1%} | {p['primary_hit_rate']:.1%} / "
            f"{p['fs_hit_rate']:.1%} | {p['fs_bytes_written'] / gib:.2f} | {p['fs_evictions']} |"
        )
    return lines


def replay_section() -> list[str]:
    record = load("replay")
    results = record["results"]
    return [
        "## Replaying a request trace",
        "",
        f"`kvtier replay` on Mooncake's FAST'25 synthetic trace (`{results['trace']}`: "
        f"{results['sweep']['requests']} requests, {results['sweep']['blocks']} blocks of 512 tokens, "
        f"{results['sweep']['distinct_blocks']} distinct) at its defaults: 256 KiB blocks, a 1 GiB",
        "primary tier, an fs tier of the capacity shown, requests as fast as they go with 16 (or 1)",
        "in flight, every loaded block checked byte for byte. Beside each run, what the sweep",
        "(`--sweep`: the same steps through the tiers' own eviction code, no I/O) predicts for the",
        "same capacities at concurrency 1; with 16 in flight the difference is what concurrency",
        "changed (see [sizing with a trace](sizing.md), which also says how to size tiers with this).",
        "",
        provenance(record),
        "",
        *replay_table(results["replays"]),
        "",
    ]


def policies_section() -> list[str]:
    """The eviction policies measured (a model, its LRU checked against the tiers' code)."""
    if not (RECORDS / "eviction_policies.json").exists():
        return []
    record = load("eviction_policies")
    results = record["results"]
    fractions = results["fractions"]
    lines = [
        "## Eviction: LRU, and what else was measured",
        "",
        "Both tiers evict their least recently used block. `bench/eviction_policies.py` measured",
        "three other policies for the fs tier, in a model of the cache whose LRU row is checked",
        "against the sweep (the tiers' own code): ARC, a frequency-aware admission (a new block",
        "enters only if it was asked for at least as often as the block it would evict, as",
        "TinyLFU admits) and a chain-position-aware eviction (of the 8 least recently used blocks,",
        "the deepest in its chain goes). The primary tier holds 1% of each trace's distinct",
        "blocks; the fs tier 1% to 40%. Prefix hit rates:",
        "",
        provenance(record),
        "",
    ]
    for name, trace in results["traces"].items():
        lines += [
            f"**{name}** ({trace['distinct_blocks']} distinct blocks)",
            "",
            "| policy | " + " | ".join(f"{f:.0%}" for f in fractions) + " |",
            "|---|" + "---|" * len(fractions),
        ]
        for policy, rates in trace["hit_rates"].items():
            lines.append(f"| {policy} | " + " | ".join(f"{r:.1%}" for r in rates) + " |")
        lines.append("")
    worst = {
        policy: min(
            rate - lru
            for trace in results["traces"].values()
            for rate, lru in zip(trace["hit_rates"][policy], trace["hit_rates"]["lru"])
        )
        for policy in ("arc", "admit-freq", "chain-pos")
    }
    best = {
        policy: max(
            rate - lru
            for trace in results["traces"].values()
            for rate, lru in zip(trace["hit_rates"][policy], trace["hit_rates"]["lru"])
        )
        for policy in worst
    }
    lines += [
        "Against LRU at the same capacity, at worst and at best: "
        + "; ".join(f"{p} {100 * worst[p]:+.1f} to {100 * best[p]:+.1f} points" for p in worst)
        + ".",
        "",
    ]
    safe = [p for p in worst if worst[p] >= -0.005]
    lines += [
        "Never more than half a point below LRU on every trace and capacity: "
        + (", ".join(safe) if safe else "none of them")
        + ". ARC and the admission win most where a few prefixes are shared widely and the tier",
        "is small, and lose where chains grow turn by turn (the admission keeps out the new turns",
        "that the next request asks for). The chain-position eviction would need each block's",
        "position in its chain, which a tier is not told (keys are opaque digests), for a gain",
        f"of at most {100 * best['chain-pos']:.1f} points here: the tiers keep LRU.",
        "",
    ]
    return lines


def sizing_page(out: Path) -> str:
    """docs/sizing.md: how to size tiers with a trace, with the shared trace's sweep and replays."""
    record = load("replay")
    results = record["results"]
    sweep = results["sweep"]
    gib = 1 << 30
    points = sweep["points"]
    figure = sweep_figure(sweep)
    image = save(figure, out, "sizing-sweep.svg", ["replay"])
    enough = sweep["capacity_for_80_percent_of_unbounded"]
    primary_share = (sweep["primary_bytes"] // sweep["block_bytes"]) / sweep["distinct_blocks"]
    enough_share = next(
        (p["fraction_of_distinct_blocks"] for p in points if p["fs_capacity_bytes"] == enough), 0
    )
    lines = [
        "# Sizing with a trace",
        "",
        "Which tiers, and how big? A request trace answers it for your workload. `kvtier replay`",
        "takes a trace in the format of Mooncake's FAST'25 release (JSON lines: `timestamp` in ms,",
        "`input_length`, `output_length`, `hash_ids`: one id per 512 prompt tokens, equal ids being",
        "the same reusable prefix block) and runs it two ways.",
        "",
        "- `kvtier replay TRACE --sweep` runs every request through the primary tier's and the fs",
        "  tier's own eviction code (their slot and index bookkeeping, no bytes moved) at a list of fs",
        "  capacities, in seconds: the prefix hit rate and the bytes written at each. Give sizes",
        "  (`--sweep 1G,4G,16G`) or take the default: 1% to 100% of the trace's distinct blocks.",
        "- `kvtier replay TRACE --tiers '[...]'` replays it through real tiers: each request looks",
        "  up its block chain, loads the hit prefix (checked byte for byte) and stores the blocks it",
        "  computed, arriving at the trace's times (`--speed X`: X times real time) or as fast as",
        "  `--concurrency N` requests in flight allow (the default, 16). It reports the hit rate per",
        "  tier and for the whole cache in blocks and tokens, the hit rate an unbounded cache would",
        "  get, the sweep's prediction for the same capacities, bytes written and read, evictions,",
        "  load latency, late arrivals and the event loop's lag; `--json` and `--plot` save them.",
        "  Ctrl-C stops it early and it still reports.",
        "",
        "Block bytes: `--block-bytes` (default 256K, small enough to replay a whole trace on a",
        "laptop) or `--model-geometry llama-3.1-8b` (and others: the KV of 512 tokens of that",
        "model). Hit rates do not depend on the block size; bytes written and read scale with it.",
        "",
        "## The shared trace",
        "",
        f"Mooncake's synthetic trace: {sweep['requests']} requests, {sweep['blocks']}",
        f"blocks, {sweep['distinct_blocks']} distinct; an unbounded cache hits",
        f"{sweep['unbounded_hit_rate']:.1%} of the blocks. The sweep, with a 1 GiB primary tier and",
        "256 KiB blocks:",
        "",
        *sweep_table(sweep),
        "",
        image,
        "",
        "Reading it: the primary tier alone (1 GiB, "
        f"{primary_share:.0%} of the distinct blocks) "
        f"gives the first {points[0]['primary_hit_rate']:.0%};",
        "an fs tier smaller than it adds nothing, as it holds only what the primary tier",
        "holds too; from there the hit rate climbs with the fs tier's capacity while the bytes",
        "written fall (fewer blocks are computed and stored again). 80% of the unbounded hit rate",
        "takes "
        + (
            f"{enough / gib:.2f} GiB of fs tier here, {enough_share:.0%} of the trace's distinct blocks."
            if enough is not None
            else "more than the largest size swept here."
        ),
        "",
        "The replay through a real fs tier at two of those capacities, with 16 requests in flight and",
        "with one:",
        "",
        *replay_table(results["replays"]),
        "",
        provenance(record),
        "",
        "At one request in flight the replay measures what the sweep predicted (the order in which",
        "the fs tier's concurrent I/O batches finish moves its LRU a little; `--settle` makes each",
        "request wait for its writes, as an engine's decode time would). With 16 in flight the",
        "report states what concurrency changed as hit blocks against the prediction: fewer where",
        "requests look up blocks an earlier request is still computing, more where a small fs tier",
        "is churned less (blocks that concurrent requests compute at once are written once: see the",
        "fs written column).",
        "",
        *policies_section(),
        "## The same numbers from a running deployment",
        "",
        "`TieredKVCache.stats()` counts `lookup_calls` and `lookup_blocks`, and per tier",
        '("primary", then each secondary tier by name) `found_blocks` (leading blocks lookups found',
        "there) and `loaded_from` (blocks loads took from there); Prometheus exports them as",
        "`kvtier_cache_lookup_blocks_total`, `kvtier_cache_found_blocks_total{tier=...}` and",
        "`kvtier_cache_loaded_from_total{tier=...}`. The hit rate of a tier is its `loaded_from`",
        "over `lookup_blocks`, as in the replay's report.",
        "",
        "## Limits",
        "",
        "- The sweep models the primary tier and one fs tier (both LRU, their own code). Replays",
        "  through Redis, S3 or several tiers run, and report everything but the prediction.",
        "- A trace gives prompts, not the engine: the replay computes no tokens, so at full speed",
        "  requests follow each other faster than an engine's would; `--speed 1` keeps the trace's",
        "  own arrival times.",
        "- Hash ids name prefix blocks of 512 tokens: a trace of another block size is replayed as",
        "  if its blocks were 512 tokens (the token hit rate counts the real length of each",
        "  request's last block).",
        "",
    ]
    return "\n".join(lines)


def lmcache_l2_section() -> list[str]:
    record = load("lmcache_l2")
    results = record["results"]
    lines = [
        "## LMCache: the L2 adapter",
        "",
        "`KVTierL2Adapter` (the fs tier at its defaults, checksums on, each chunk written from and",
        "read into LMCache's L1 memory) against LMCache 0.5.6's own `fs` L2 adapter with",
        "`use_odirect` on, both run",
        "by LMCache's own `lmcache bench l2` (a producer thread submitting store, lookup and load",
        "tasks, two in flight, and waiting on the adapter's event fds), each in a process of its",
        "own on a new directory of the same disk, with the same arguments and round-trip",
        f"verification on; {results['rounds']} rounds, alternating which goes first; ratios round",
        "by round (`bench/lmcache_l2.py`).",
        "",
        provenance(record),
        "",
        "| chunk | store GB/s kvtier / LMCache fs | store ratio "
        "| load GB/s kvtier / LMCache fs | load ratio |",
        "|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        k, b = case["kvtier"], case["lmcache-fs"]
        lines.append(
            f"| {size(case['size_kb'])} | {k['store_gbps']:.2f} / {b['store_gbps']:.2f} | "
            f"{ratio_cell(case['store_ratios'])} | {k['load_gbps']:.2f} / {b['load_gbps']:.2f} | "
            f"{ratio_cell(case['load_ratios'])} |"
        )
    lines += [
        "",
        "Both adapters read and write LMCache's L1 memory itself: LMCache describes its L1 arena to",
        "its adapters, and ours runs a kvtier tier per chunk size over that arena (`store_views` /",
        "`load_views`), each chunk stored with its checksum and verified on every load. The",
        "benchmark's L1 buffer has 4 KiB pages scattered in physical memory; LMCache's adapter does",
        "its direct I/O into them, the fs tier through its huge-page staging buffers (a copy on the",
        "I/O threads; see the fs section). The adapter's tiers run with the library's default",
        "I/O threads (4 on this machine's 2 cores).",
        "",
    ]
    return lines


def aiofiles_section() -> list[str]:
    rows = [r for r in load("fs_tier")["results"] if "aiofiles" in r and r["memory"] == "anon"]
    threads = min(r["threads"] for r in rows)
    lines = [
        "## Why not aiofiles",
        "",
        "`aiofiles` is what many asyncio programs reach for. It runs each call of a buffered file",
        "object on the default thread pool: writes land in the page cache and reach the disk",
        "whenever the kernel flushes them (its store figure is a memory copy, not a write to disk,",
        "and nothing is checksummed or crash-safe), and reads copy through the page cache. The fs",
        "benchmark above runs it with one file per block and the same concurrency:",
        "",
        "| block | aiofiles store / load GB/s | kvtier fs store / load GB/s | load: kvtier / aiofiles |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if r["threads"] != threads:
            continue
        a, t = r["aiofiles"], r["tier"]
        lines.append(
            f"| {size(r['block_kib'])} | {a['store_gbps']:.2f} / {a['load_gbps']:.2f} | "
            f"{t['store_gbps']:.2f} / {t['load_gbps']:.2f} | {t['load_gbps'] / a['load_gbps']:.2f}x |"
        )
    lines += [
        "",
        "So the package does not use it, and it is not a runtime dependency: only this benchmark",
        "needs it (it comes with the `dev` extra). The runtime dependencies are each imported by the",
        "package: torch (tensors, CUDA streams), numpy (host copies off torch's thread pool), xxhash",
        "(checksums), anyio (task groups), tqdm (progress of `kvtier demo` and `kvtier bench`) and,",
        "on Linux, uvloop (the loop of the CLI and of the vLLM adapter).",
        "",
    ]
    return lines


def staging_section() -> list[str]:
    record = load("fs_staging")
    lines = [
        "## Staged or direct I/O, by how scattered the memory is",
        "",
        "The fs tier reads and writes through huge-page staging buffers when more than a fifth",
        "of its primary memory's neighbouring pages lie apart in RAM (`staging.SCATTERED_ABOVE`),",
        "and straight into the memory otherwise (see the fs tier's page). This is what that",
        "threshold comes from: a `/dev/shm` mapping of random bytes, faulted in page by page with",
        "a page of another mapping after every few of its own, so that at least that share of its",
        "neighbours lie apart (the host's free memory adds some: *neighbours apart* is what the",
        "tier measured), stored and loaded (page cache dropped) by a tier with `staging` on and",
        "one with it off, taking turns to go first. A ratio below 1.00 means staging was faster.",
        "",
        provenance(record),
        "",
        "| block | threads | a page between every | neighbours apart | staged store / load GB/s "
        "| direct / staged, store | direct / staged, load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        store, load_ = (
            ratio_cell(round_ratios(r["rounds"], r["rounds"], f"direct_{op}", f"staged_{op}"))
            for op in ("store_gbps", "load_gbps")
        )
        apart = "unknown" if r["apart"] is None else f"{r['apart']:.2f}"
        lines.append(
            f"| {size(r['block_kib'])} | {r['threads']} | {r['between'] or '-'} | {apart} | "
            f"{r['staged_store_gbps']:.2f} / {r['staged_load_gbps']:.2f} | {store} | {load_} |"
        )
    lines.append("")
    return lines


def round_counts() -> set[int]:
    """How many rounds each row of the page's records has."""
    counts = {len(r["rounds"]) for r in load("fs_tier")["results"]}
    counts |= {len(case["rounds"]["kvtier"]) for case in load("vllm_tiers")["results"]}
    if (RECORDS / "fs_steady.json").exists():
        counts |= {len(r["rounds"]) for r in load("fs_steady")["results"]}
    if (RECORDS / "fs_staging.json").exists():
        counts |= {len(r["rounds"]) for r in load("fs_staging")["results"]}
    if (RECORDS / "peers.json").exists():
        counts |= {m["rounds"] for m in peer_medians().values()}
    return counts


def render(out: Path) -> str:
    lines = [
        "# Performance",
        "",
        "<!-- Generated by bench/render_docs.py from docs/perf/*.json: edit the script, not this page. -->",
        "",
        "Every number on this page comes from a record under `docs/perf/`, saved by",
        f"`{RUN_ALL}` (LMCache pins its own dependencies: its record runs from an environment",
        "with LMCache and kvtier_async installed), and rendered by",
        "`python bench/render_docs.py`. Each section says the command and the machine. These",
        "machines are shared and noisy: the disk's speed moves between runs, so the benchmarks run",
        "our code and its baseline in interleaved rounds of one run. A throughput shown is the",
        "median of the rounds; a ratio is the median of the rounds' own ratios, each round setting",
        "the two sides side by side on the same minute of the disk (and, where both use it, the",
        "same memory). Read the ratios; absolute numbers are this machine's. Beside each ratio, in",
        "brackets, are bounds on it: two of the rounds' ratios that hold the median between them",
        "with the chance given, assuming only that the rounds are independent",
        "(`bench/common.median_bounds`):",
        f"{bounds_rule(round_counts())}. Where the bounds take in 1.0, the two sides are level",
        "within this machine's noise. Each benchmark",
        "process freezes its start-up heap (`gc.collect(); gc.freeze()`; `kvtier bench` and",
        "`bench/remote_tiers.py` once each tier has been opened, so that what a tier's backend brings,",
        "~20,000 objects for redis-py, is frozen too), as vLLM's engine core does and as",
        "[running in production](production.md) advises: otherwise a full garbage",
        "collection (60-100 ms here with torch imported) lands on whichever timed step happens to",
        "trigger it.",
        "",
    ]
    lines += fs_section(out)
    if (RECORDS / "fs_steady.json").exists():
        lines += steady_section()
    if (RECORDS / "fs_staging.json").exists():
        lines += staging_section()
    if (RECORDS / "fs_index_scale.json").exists():
        lines += index_scale_section()
    if (RECORDS / "peers.json").exists():
        lines += peers_section()
    lines += vllm_section()
    lines += lag_section(out)
    lines += bench_section()
    if (RECORDS / "remote_tiers.json").exists():
        lines += remote_section()
    if (RECORDS / "tier_secret.json").exists():
        lines += secret_section()
    if (RECORDS / "sglang_backend.json").exists():
        lines += sglang_section()
    if (RECORDS / "lmcache_l2.json").exists():
        lines += lmcache_l2_section()
    if (RECORDS / "replay.json").exists():
        lines += replay_section()
    lines += aiofiles_section()
    lines += [
        "## The CUDA path",
        "",
        "No GPU has run this project's CUDA path yet: it is verified by review and by CPU tests of",
        "the same chunking code and of its stream copies under a stand-in for CUDA",
        "([concepts](concepts.md#device-copies-what-they-wait-for)).",
        "`python bench/gpu_check.py`, run in a clone (it imports the checkout's package), is its",
        "acceptance script (setup and contexts, byte-exact round trips, producer ordering, every",
        "ordering over many chunks, no sync on the loop, measured overlap, throughput of",
        "`cache.store` / `cache.load` against raw pinned copies). A line says PASS only where what it",
        "asserts held; without CUDA the throughput line is INFO, measured and not asserted. Its",
        "output goes here the first time a device runs it.",
        "",
    ]
    return "\n".join(lines).rstrip() + "\n"


def headline() -> str:
    """The README's one performance figure: the fs tier at 2 MiB against the peers."""
    fs = next(
        r
        for r in load("fs_tier")["results"]
        if r["block_kib"] == 2048 and r["memory"] == "anon" and r["threads"] == 4
    )
    vllm = next(
        case["ratios"]
        for case in load("vllm_tiers")["results"]
        if case["chunk_bytes"] == 2 << 20 and case["threads"] is None
    )
    text = (
        "**Performance** ([details](docs/performance.md)): with 2 MiB blocks, 4 I/O threads and checksums "
        f"on, the fs tier stores at {fs['store_ratio']:.2f}x and loads cold at {fs['load_ratio']:.2f}x "
        f"({fs['fresh_load_ratio']:.2f}x in a restarted process) the speed of raw O_DIRECT calls on the "
        "same disk"
    )
    if (RECORDS / "peers.json").exists():
        medians = peer_medians()  # as a user runs each product, where the record has it
        ratio = (medians.get((2, "anon", "processes")) or medians[(2, "anon", "one-process")])["ratio"]
        text += f", {ratio['store_gbps']:.2f}x / {ratio['load_gbps']:.2f}x LMCache 0.5.6's disk backend"
    text += (
        ", and inside vLLM, each tier at its own defaults, stores at "
        f"{vllm['store_gbps']:.2f}x and promotes at {vllm['promote_same_gbps']:.2f}x (same engine) "
        f"and {vllm['promote_new_engine_gbps']:.2f}x (a new engine) the speed of vLLM 0.33's own fs "
        "tier (medians of interleaved rounds on a "
        "2-core VM)."
    )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write here instead of docs/ and the README")
    args = parser.parse_args()
    out = args.out or REPO / "docs"
    out.mkdir(parents=True, exist_ok=True)
    (out / "performance.md").write_text(render(out))
    if (RECORDS / "replay.json").exists():
        (out / "sizing.md").write_text(sizing_page(out))
    if args.out is not None:
        (out / "headline.md").write_text(headline() + "\n")
        return
    readme = REPO / "README.md"
    start, end = "<!-- headline: generated by bench/render_docs.py -->\n", "<!-- /headline -->"
    text = readme.read_text()
    before, rest = text.split(start)
    _, after = rest.split(end)
    readme.write_text(before + start + headline() + "\n" + end + after)


if __name__ == "__main__":
    main()
