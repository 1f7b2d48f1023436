"""Random request streams over shared prefixes through vLLM 0.33's real TieringOffloadingManager.

Several requests at once, each looking its prefix up step after step (until no answer is RETRY
or HIT_PENDING), loading the hits, storing the rest and finishing; between steps the cache is
sometimes reset with every request finished first, as vLLM's reset_prefix_cache requires. Row
contents are a function of the key, so every loaded row is checked. Faults are injected where
the tier has them: the Redis server killed and restarted mid-run, the fs root removed by hand.
Every run must load no wrong byte, raise nothing, and shut down with vLLM unmapping its region.

vLLM's own fs tier runs the same streams as a control: a harness bug cannot pass as ours. More
seeds: KVTIER_VLLM_SEEDS=30 (each run takes about a second).
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs vLLM and never skips these
    pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import servers
from vllm.v1.kv_offload.base import LookupResult, OffloadKey
from vllm_engine import ADAPTER, Engine, chunk_keys, make_manager, row_bytes

SEEDS = range(int(os.environ.get("KVTIER_VLLM_SEEDS", "3")))
STEPS = 600
FINAL = (LookupResult.HIT, LookupResult.MISS)


def row_for(key: OffloadKey, nbytes: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(nbytes)


def run_requests(
    engines: list[Engine], seed: int, fault: Callable[[int], None] = lambda step: None
) -> dict[str, int]:
    """STEPS steps of random requests over 60 documents that share 4 prefixes; counts."""
    rng = random.Random(seed)
    nbytes = engines[0].row_bytes
    heads = [chunk_keys(10_000 * seed + h, 4) for h in range(4)]
    docs = [heads[d % 4] + chunk_keys(10_000 * seed + 100 + d, rng.randint(0, 6)) for d in range(60)]
    active: list[list[list[Any]]] = [[] for _ in engines]  # per engine: [ctx, keys, hits or None]
    counts = {"loaded": 0, "stored": 0, "wrong": 0}
    for step in range(STEPS):
        fault(step)
        e = rng.randrange(len(engines))
        engine, requests = engines[e], active[e]
        new = []
        for _ in range(rng.randint(0, 3)):
            if len(requests) < 8:
                ctx = engine.new_request()
                new.append(ctx.req_id)
                requests.append([ctx, rng.choice(docs)[: rng.randint(1, 10)], None])
        for request in list(requests):
            if rng.random() < 0.3:
                continue  # not scheduled this step
            ctx, keys, hits = request
            if hits is None:  # looking up, and loading the hits once every answer is final
                found = engine.lookup(ctx, keys)
                if any(r not in FINAL for r in found):
                    continue
                hits = next((i for i, r in enumerate(found) if r is not LookupResult.HIT), len(found))
                if hits:
                    got = engine.load(ctx, keys[:hits])
                    counts["loaded"] += hits
                    counts["wrong"] += sum(got[k] != row_for(k, nbytes) for k in keys[:hits])
                request[2] = hits
            elif keys[hits:]:  # computing the rest, then storing it
                rows = {key: row_for(key, nbytes) for key in keys[hits:]}
                counts["stored"] += engine.store_what_fits(ctx, rows)
                request[1] = keys[:hits]
            else:
                engine.finish(ctx)
                requests.remove(request)
        engine.step_end(new)
        roll = rng.random()
        if roll < 0.1:
            engine.settle()
        elif roll < 0.12:
            for ctx, _, _ in requests:
                engine.finish(ctx)
            requests.clear()
            engine.step_end()
            engine.reset_cache()
    for engine, requests in zip(engines, active):
        for ctx, _, _ in requests:
            engine.finish(ctx)
        engine.settle()
    return counts


def check_streams(
    configs: list[dict[str, Any]],
    seed: int,
    *,
    engines: int = 1,
    fault: Callable[[int], None] = lambda step: None,
) -> None:
    """The streams on `engines` engines of `configs`, each shut down whatever happens (an engine
    left running leaves its /dev/shm region behind); then no wrong byte, and a clean shutdown."""
    started: list[Engine] = []
    warnings: list[str] = []
    try:
        started += [Engine(make_manager(configs)) for _ in range(engines)]
        counts = run_requests(started, seed, fault)
    finally:
        for engine in started:
            warnings += engine.shutdown()
    assert counts["wrong"] == 0, counts
    assert counts["loaded"] > 0 and counts["stored"] > 0, counts
    assert warnings == []  # e.g. "Keeping ... mapped: buffers are still exported"


def fs_tier(root: Path, **extra: Any) -> list[dict[str, Any]]:
    return [
        {**ADAPTER, "tier": {"type": "fs", "root": str(root), "capacity_bytes": 48 * row_bytes(), **extra}}
    ]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tiers", ["fs", "memory+fs", "vllm-fs"])
def test_random_requests(tiers: str, seed: int, tmp_path: Path) -> None:
    if tiers == "fs":  # small: constant eviction
        configs = fs_tier(tmp_path)
    elif tiers == "memory+fs":
        memory = {**ADAPTER, "tier": {"type": "memory", "capacity_bytes": 8 * row_bytes()}}
        configs = [memory, *fs_tier(tmp_path)]
    else:  # the control: vLLM's own
        configs = [{"type": "fs", "root_dir": str(tmp_path)}]
    check_streams(configs, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_three_engines_sharing_one_root(seed: int, tmp_path: Path) -> None:
    check_streams(fs_tier(tmp_path, refresh_interval_s=0), seed, engines=3)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_fs_root_removed_by_hand_twice(seed: int, tmp_path: Path) -> None:
    def fault(step: int) -> None:
        if step in (STEPS // 3, 2 * STEPS // 3):
            shutil.rmtree(tmp_path, ignore_errors=True)  # the tier may make files meanwhile, as with rm -rf

    check_streams(fs_tier(tmp_path, refresh_interval_s=0), seed, fault=fault)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_redis_server_killed_and_restarted(seed: int, tmp_path: Path) -> None:
    server = servers.RedisServer(tmp_path / "redis")
    server.start()
    try:
        tier = {"type": "redis", "url": server.url, "prefix": uuid.uuid4().hex, "timeout_s": 0.3}

        def fault(step: int) -> None:
            if step == STEPS // 3:
                server.stop()
            elif step == 2 * STEPS // 3:
                server.start()

        check_streams([{**ADAPTER, "tier": tier}], seed, fault=fault)
    finally:
        server.stop()
