"""Hybrid models through `KVTierHiCacheStorage`'s v2 interface, side by side with SGLang's `HiCacheFile`.

Five pool sets SGLang 0.5.23 assembles, from its own host pool classes built on the CPU: Mamba
state + DSA indexer over MLA KV; SWA windows + draft pools registered late; DeepSeek V3.2's
MLA + DSA indexer in every layout; MLA + Mamba at TP 2; DeepSeek V4's logical KV anchor with
its compressed, indexer, SWA and compressor-state pools. Each is driven through SGLang's own
`HybridCacheController` storage methods (`sglang_hybrid_env.Controller`): backups, hit queries
and prefetches, against our backend and `HiCacheFile` on the same calls. The hit answers
must be HiCacheFile's, and each is also pinned to its value here, so agreement is never vacuous.
Every pool set runs through each tier (`tier`: fs, Redis, memory, fs sealed with a secret),
and again through a backend restarted over the same storage where the tier keeps it.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs SGLang and never skips these
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_env import HiCacheFile, StorageBackendFactory, backend_config
from sglang_hybrid_env import (
    Controller,
    Span,
    chain,
    dsa_pools,
    dsv4_logical_pool,
    dsv4_pool,
    dsv4_state_pool,
    flat_bytes,
    mamba_pool,
    mha_pool,
    mla_pool,
    qsa_pools,
)

from kvtier_async.errors import ConfigError, InvalidArgumentError
from kvtier_async.integrations import sglang, sglang_pools
from kvtier_async.integrations.sglang import KVTierHiCacheStorage
from kvtier_async.integrations.sglang_hits import hit_answer
from kvtier_async.integrations.sglang_pools import FlatPages, PoolRuns

KV, MAMBA, INDEXER = PoolName.KV, PoolName.MAMBA, PoolName.INDEXER
SWA, DRAFT, DRAFT_SWA = PoolName.SWA, PoolName.DRAFT, PoolName.DRAFT_SWA
P = 64  # MLA / DSA pages are 64 tokens


def attach(
    kind: str,
    tier: dict[str, Any] | None,
    kv: Any,
    pools: dict[PoolName, Any],
    root: Path,
    **config: Any,
) -> tuple[Any, Controller]:
    """Attach a backend as SGLang does (KV pool first, then the v2 burst) and its controller."""
    if kind == "ours":
        storage_config = backend_config(tier, pool=kv, **config)
        backend = StorageBackendFactory.create_backend("dynamic", storage_config, kv)
        assert isinstance(backend, KVTierHiCacheStorage)
    else:  # SGLang's own file backend, on flat pages (its only path)
        storage_config = backend_config(None, pool=kv, extra={"interface_v1": 0}, **config)
        storage_config.extra_config = {"file_storage_path": str(root / "hicache-file")}
        backend = HiCacheFile(storage_config)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, KV)
    for name, pool in pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend, Controller(backend, kv, {KV: kv, **pools}, storage_config)


@pytest.fixture
def fs(tmp_path: Path) -> dict[str, Any]:
    return {"type": "fs", "root": str(tmp_path / "kv")}


@dataclass(frozen=True)
class Tier:
    """A tier config for our backend, and what the pool sets may expect of it."""

    kind: str
    config: dict[str, Any]
    #: A backend restarted over the same config finds what the first one stored.
    persists: bool = True
    #: Another process (another TP rank) finds what this one stored.
    shared: bool = True
    #: The backend's extra config besides the tier ("limits").
    extra: dict[str, Any] = field(default_factory=dict)

    def attach(self, kind: str, kv: Any, pools: dict[PoolName, Any], root: Path, **config: Any) -> Any:
        """`attach` our backend over this tier (kind "ours"), or HiCacheFile (kind "file")."""
        if kind == "file":
            return attach("file", None, kv, pools, root, **config)
        return attach("ours", self.config, kv, pools, root, extra=self.extra, **config)


TIERS = ["fs", "redis", "memory", "fs-sealed"]


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, fs: dict[str, Any]) -> Tier:
    """Every pool set runs through each: fs, a real Redis server, memory, fs sealed with a secret."""
    kind = request.param
    if kind == "redis":  # one server for the module: every test its own names on it
        url = request.getfixturevalue("redis_server").url
        return Tier(kind, {"type": "redis", "url": url, "prefix": f"hybrid-{uuid.uuid4().hex[:12]}"})
    if kind == "memory":  # process memory, per tier object: gone with the backend, and rank-local
        return Tier(kind, {"type": "memory"}, persists=False, shared=False)
    if kind == "fs-sealed":  # records are sealed in slots for every block in flight, per pool:
        # a few lanes keep those slots (faulted in at open) small, here
        lanes = {"limits": {"max_inflight_loads": 2, "max_inflight_stores": 2}}
        return Tier(kind, {**fs, "secret_env": request.getfixturevalue("tier_secret_env")}, extra=lanes)
    return Tier(kind, fs)


def scrub(pool: Any, slots: list[int]) -> None:
    """Zero the pages at `slots` of `pool`, so a load into them is never vacuous."""
    for slot in slots:
        pool.set_from_flat_data_page(slot, torch.zeros_like(pool.get_dummy_flat_data_page()))


# -- pool set 1: Mamba state + DSA indexer over MLA KV -------------------------------------------------
TOKENS, KEYS = chain(20, P)
OTHER_TOKENS, _ = chain(4, P, seed=7)
STORED = [4 * P, P, P, 2 * P, 4 * P]  # what SGLang counts as stored, per backup below


def store_mamba_indexer_chain(c: Controller) -> list[int]:
    """Pages 0-11 stored: state at the node ends 4 and 8 (none at 12: a missing trailing state),
    the indexer on every page but 5 (a missing middle page)."""
    return [
        c.backup(KEYS, Span(range(0, 4), [INDEXER], {MAMBA: (torch.tensor([0]), 1)})),
        c.backup(KEYS, Span(range(4, 5), [INDEXER])),
        c.backup(KEYS, Span(range(5, 6))),
        c.backup(KEYS, Span(range(6, 8), [INDEXER], {MAMBA: (torch.tensor([1]), 1)})),
        c.backup(KEYS, Span(range(8, 12), [INDEXER])),
    ]


def mamba_indexer_answers(c: Controller) -> list[Any]:
    both, state_only = c.hit_transfers({MAMBA: 1}, [INDEXER]), c.hit_transfers({MAMBA: 1}, [])
    return [
        c.query(TOKENS[: 12 * P], both),  # whole stored chain
        c.query(TOKENS[: 4 * P], both),  # partial: the first node
        c.query(TOKENS[: 3 * P], both),  # partial, ending where no state is
        c.query(TOKENS[: 12 * P], state_only),  # no indexer asked: states at 4 and 8
        c.query(TOKENS[4 * P : 12 * P], state_only, last_hash=KEYS[3], prefix_keys=KEYS[:4]),  # mid-chain
        c.query(TOKENS, both),  # extended past what was stored
        c.query(OTHER_TOKENS, both),  # never stored
        c.query(TOKENS[: 12 * P], [PoolTransfer(name=KV)]),  # KV named as a pool: the KV pages
    ]


MAMBA_INDEXER_EXPECTED = [
    (4 * P, [4], {"kv": 12, "mamba": 8, "indexer": 5}),
    (4 * P, [4], {"kv": 4, "mamba": 4, "indexer": 4}),
    (0, [], {"kv": 3}),
    (8 * P, [4, 8], {"kv": 12, "mamba": 8}),
    (4 * P, [4], {"kv": 8, "mamba": 4}),  # from page 4: state only at the chain's page 8
    (4 * P, [4], {"kv": 12, "mamba": 8, "indexer": 5}),
    (0, [], {"kv": 0}),
    (12 * P, list(range(1, 13)), {"kv": 12}),
]


def check_mamba_indexer_loads(c: Controller, kv: Any, indexer: Any, state: Any) -> None:
    """Prefetch the first node (KV, indexer, its state) into other slots: byte-exact per pool; an
    indexer load over the missing page fails that entry only."""
    dest = [12, 13, 14, 15]
    scrub(kv, [p * P for p in dest])
    scrub(indexer, [p * P for p in dest])
    scrub(state, [9])
    load = [PoolTransfer(name=INDEXER, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)]
    load.append(
        PoolTransfer(
            name=MAMBA, host_indices=torch.tensor([9]), keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES
        )
    )
    assert c.prefetch(KEYS[:4], dest, load) == (4 * P, {"mamba": 1})  # the indexer counts in the KV pages
    for pool in (kv, indexer):
        assert [flat_bytes(pool, p * P) for p in dest] == [flat_bytes(pool, p * P) for p in range(4)]
    assert flat_bytes(state, 9) == flat_bytes(state, 0)
    middle = PoolTransfer(name=INDEXER, host_indices=torch.arange(12 * P, 15 * P), keys=KEYS[4:7])
    assert c.ctl.storage_backend.batch_get_v2([middle]) == {INDEXER: [True, False, True]}


@pytest.mark.parametrize("indexers", ["qsa", "dsa-generic"])
def test_mamba_state_and_indexer_answer_and_load_as_hicache_file(
    indexers: str, fs: dict[str, Any], tmp_path: Path
) -> None:
    """Mamba state beside a QSA indexer over MHA KV, and beside a DSA indexer with the KV pages
    through SGLang's generic (flat page) path, not the v1 one (the DSA indexer over v1 KV runs
    through every tier below)."""
    kv, indexer = qsa_pools(tokens=2048) if indexers == "qsa" else dsa_pools(tokens=2048)
    state = mamba_pool()
    pools = {INDEXER: indexer, MAMBA: state}
    generic = {"extra": {"interface_v1": 0}} if indexers.endswith("generic") else {}
    ours, c = attach("ours", fs, kv, pools, tmp_path, **generic)
    _, f = attach("file", None, kv, pools, tmp_path)
    try:
        assert store_mamba_indexer_chain(c) == store_mamba_indexer_chain(f) == STORED
        answers = mamba_indexer_answers(c)
        assert answers == mamba_indexer_answers(f)
        assert answers == MAMBA_INDEXER_EXPECTED
        check_mamba_indexer_loads(c, kv, indexer, state)
        check_mamba_indexer_loads(f, kv, indexer, state)
    finally:
        ours.close()


def test_mamba_state_and_indexer_from_three_threads_a_restart_and_close_through_every_tier(
    tier: Tier, fs: dict[str, Any], tmp_path: Path
) -> None:
    """Backup, hit query and prefetch threads at once (as SGLang's controller runs them); then the
    answers and loads are HiCacheFile's, a restarted backend over the same storage gives them
    again (the memory tier keeps nothing past its backend: a restart finds nothing), and close
    leaves no thread of ours behind. A sealed tier is sealed, and read without its secret holds
    nothing."""
    before = set(threading.enumerate())
    kv, indexer = dsa_pools(tokens=2048)
    state = mamba_pool()
    pools = {INDEXER: indexer, MAMBA: state}
    ours, c = tier.attach("ours", kv, pools, tmp_path)
    first_node = threading.Event()
    errors: list[BaseException] = []

    def backup() -> None:
        c.backup(KEYS, Span(range(0, 4), [INDEXER], {MAMBA: (torch.tensor([0]), 1)}))
        first_node.set()
        assert store_mamba_indexer_chain(c) == STORED

    def query() -> None:
        first_node.wait(timeout=60)
        for _ in range(20):
            hit, restorable, _ = c.query(TOKENS[: 12 * P], c.hit_transfers({MAMBA: 1}, [INDEXER]))
            assert hit == 4 * P and restorable == [4]

    def prefetch() -> None:
        first_node.wait(timeout=60)
        load = [PoolTransfer(name=INDEXER, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)]
        for _ in range(5):
            assert c.prefetch(KEYS[:4], [16, 17, 18, 19], load) == (4 * P, {})

    def guarded(work: Any) -> Any:
        def run() -> None:
            try:
                work()
            except BaseException as exc:
                errors.append(exc)
                first_node.set()

        return run

    threads = [threading.Thread(target=guarded(w)) for w in (backup, query, prefetch)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        _, f = attach("file", None, kv, pools, tmp_path)
        assert store_mamba_indexer_chain(f) == STORED
        assert mamba_indexer_answers(c) == mamba_indexer_answers(f) == MAMBA_INDEXER_EXPECTED
        for pool in (kv, indexer):
            assert [flat_bytes(pool, p * P) for p in range(16, 20)] == [
                flat_bytes(pool, p * P) for p in range(4)
            ]
        check_mamba_indexer_loads(c, kv, indexer, state)
        assert ours.tier_stats().get("sealed", False) is (tier.kind == "fs-sealed")
    finally:
        ours.close()
    again, c2 = tier.attach("ours", kv, pools, tmp_path)
    try:
        if tier.persists:
            assert mamba_indexer_answers(c2) == MAMBA_INDEXER_EXPECTED
            check_mamba_indexer_loads(c2, kv, indexer, state)
        else:  # process memory: nothing outlives the backend
            assert c2.query(TOKENS[: 12 * P], c2.hit_transfers({MAMBA: 1}, [INDEXER]))[0] == 0
    finally:
        again.close()
        again.close()  # idempotent
    if tier.kind == "fs-sealed":  # without the secret, nothing is found
        plain, c3 = attach("ours", fs, kv, pools, tmp_path)
        try:
            assert c3.query(TOKENS[: 12 * P], c3.hit_transfers({MAMBA: 1}, [INDEXER]))[0] == 0
            # nor any extra pool's page: their tiers are sealed too, not only the KV pages'
            state_page = PoolTransfer(name=MAMBA, host_indices=torch.tensor([9]), keys=[KEYS[3]])
            indexer_page = PoolTransfer(
                name=INDEXER, host_indices=torch.arange(12 * P, 13 * P), keys=KEYS[:1]
            )
            assert plain.batch_get_v2([state_page, indexer_page]) == {MAMBA: [False], INDEXER: [False]}
        finally:
            plain.close()
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:  # worker threads leave once their queue is empty: wait for that
        thread.join(timeout=30)
    assert not [t.name for t in started if t.is_alive()]
    with pytest.raises(Exception, match="closed"):
        again.batch_exists_v2(KEYS[:1], [])


# -- pool set 2: sliding windows, and draft pools registered late ----------------------------------------
def test_swa_windows_and_late_registered_draft_pools_answer_and_load_as_hicache_file(
    tier: Tier, tmp_path: Path
) -> None:
    """gpt-oss / Gemma style: full-attention KV plus a 2-page sliding window (TRAILING_PAGES);
    the draft model's KV and window pools arrive after start-up (`register_mem_host_pool_v2`).
    Ours, HiCacheFile, then ours restarted over the same storage (where the tier keeps it)."""
    page = 16
    kv, swa = mha_pool("page_first", tokens=1024), mha_pool("page_first", layers=2, tokens=512)
    draft, draft_swa = (
        mha_pool("page_first", layers=1, tokens=1024),
        mha_pool("page_first", layers=1, tokens=512),
    )
    tokens, keys = chain(16, page, seed=3)
    answers: dict[str, list[Any]] = {}
    for run, kind in enumerate(["ours", "file"] + (["restarted"] if tier.persists else [])):
        backend, c = tier.attach("file" if kind == "file" else "ours", kv, {SWA: swa}, tmp_path)
        try:

            def window(first: int) -> torch.Tensor:
                return torch.arange(first * page, (first + 2) * page)

            if kind != "restarted":
                c.backup(keys, Span(range(0, 4), [], {SWA: (window(0), 2)}))
                c.backup(keys, Span(range(4, 8), [], {SWA: (window(2), 2)}))
            for name, pool in ((DRAFT, draft), (DRAFT_SWA, draft_swa)):  # the draft model arrives
                backend.register_mem_host_pool_v2(pool, name)
                c.ctl.mem_pool_host.entry_map[name] = type("Entry", (), {"host_pool": pool})
            if kind != "restarted":
                c.backup(keys, Span(range(8, 12), [DRAFT], {SWA: (window(4), 2), DRAFT_SWA: (window(6), 2)}))
            target, drafted = c.hit_transfers({SWA: 2}, []), c.hit_transfers({SWA: 2, DRAFT_SWA: 2}, [DRAFT])
            answers[kind] = [
                c.query(tokens[: 12 * page], target),
                c.query(tokens[: 7 * page], target),  # window pages 5, 6 never stored
                c.query(tokens[: 12 * page], drafted),  # draft pools only on pages 8-11
                c.query(tokens[8 * page : 12 * page], drafted, last_hash=keys[7], prefix_keys=keys[:8]),
                c.query(tokens, target),
                c.query(chain(4, page, seed=31)[0], drafted),  # never stored
            ]
            # A prefetch of pages 8-11: KV and draft KV into host pages 40-43 (48-51, 56-59), the
            # window's last two pages into SWA pages 20-21 (24-25, 28-29), re-aligned by SGLang.
            dest, swa_dest = 40 + 8 * run, 20 + 4 * run
            load = [
                PoolTransfer(name=DRAFT, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES),
                PoolTransfer(
                    name=SWA,
                    host_indices=window(swa_dest),
                    keys=["a", "b"],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                ),
            ]
            assert c.prefetch(keys[8:12], list(range(dest, dest + 4)), load) == (
                4 * page,
                {"swa": 2},  # the draft KV counts in the KV pages
            )
            for pool in (kv, draft):
                assert [flat_bytes(pool, (dest + i) * page) for i in range(4)] == [
                    flat_bytes(pool, p * page) for p in range(8, 12)
                ]
            assert [flat_bytes(swa, (swa_dest + i) * page) for i in range(2)] == [
                flat_bytes(swa, p * page) for p in (4, 5)
            ]
        finally:
            if kind != "file":
                backend.close()
    assert answers["ours"] == answers["file"] == answers.get("restarted", answers["ours"])
    assert answers["ours"] == [
        (12 * page, [4, 8, 12], {"kv": 12, "swa": 12}),
        (4 * page, [4], {"kv": 7, "swa": 4}),
        (0, [], {"kv": 12, "swa": 12, "draft_swa": 12}),  # no draft KV on pages 0-7
        (4 * page, [4], {"kv": 4, "swa": 4, "draft_swa": 4, "draft": 4}),
        (12 * page, [4, 8, 12], {"kv": 12, "swa": 12}),
        (0, [], {"kv": 0}),
    ]


# -- pool set 3: DeepSeek V3.2 (MLA + DSA indexer) in every layout --------------------------------------
@pytest.mark.parametrize(
    "layout, tier",  # every layout and every tier once (a layout's pages are the same bytes on any tier)
    [
        ("layer_first", "fs"),
        ("page_first", "redis"),
        ("page_first_direct", "memory"),
        ("page_first", "fs-sealed"),
    ],
    indirect=["tier"],
)
def test_deepseek_v32_mla_and_dsa_indexer_in_every_layout(layout: str, tier: Tier, tmp_path: Path) -> None:
    kv, indexer = dsa_pools(layout, tokens=1024)
    tokens, keys = chain(8, P, seed=5)
    answers = {}
    for run, kind in enumerate(["ours", "file"] + (["restarted"] if tier.persists else [])):
        backend, c = tier.attach("file" if kind == "file" else "ours", kv, {INDEXER: indexer}, tmp_path)
        try:
            if kind != "restarted":
                c.backup(keys, Span(range(0, 3), [INDEXER]))
                c.backup(keys, Span(range(3, 4)))  # page 3: KV without its indexer page
                c.backup(keys, Span(range(4, 6), [INDEXER]))
            indexed = c.hit_transfers({}, [INDEXER])
            answers[kind] = [
                c.query(tokens[: 6 * P], indexed),
                c.query(tokens[4 * P : 6 * P], indexed, last_hash=keys[3], prefix_keys=keys[:4]),
                c.query(tokens[: 2 * P], indexed),  # partial
                c.query(tokens, indexed),  # extended past what was stored
                c.query(chain(2, P, seed=31)[0], indexed),  # never stored
            ]
            dest = 7 + 3 * run  # host pages 7-9, 10-12, 13-15
            load = [PoolTransfer(name=INDEXER, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)]
            assert c.prefetch(keys[:3], [dest, dest + 1, dest + 2], load) == (3 * P, {})
            for pool in (kv, indexer):
                assert [flat_bytes(pool, (dest + i) * P) for i in range(3)] == [
                    flat_bytes(pool, i * P) for i in range(3)
                ]
        finally:
            if kind != "file":
                backend.close()
    assert answers["ours"] == answers["file"] == answers.get("restarted", answers["ours"])
    assert answers["ours"] == [
        (3 * P, [1, 2, 3], {"kv": 6, "indexer": 3}),
        (2 * P, [1, 2], {"kv": 2, "indexer": 2}),
        (2 * P, [1, 2], {"kv": 2, "indexer": 2}),
        (3 * P, [1, 2, 3], {"kv": 6, "indexer": 3}),
        (0, [], {"kv": 0}),
    ]


# -- pool set 4: MLA + Mamba at TP 2 ----------------------------------------------------------------
def test_mla_kv_shared_and_mamba_state_per_rank_at_tp2(tier: Tier, tmp_path: Path) -> None:
    """Kimi-Linear style: one MLA KV copy for both ranks (rank 0 writes it), Mamba state per rank;
    rank 1 holds a state only at the first node, so the ranks restore different lengths. Ours,
    HiCacheFile, then ours restarted over the same storage (where the tier keeps it)."""
    if tier.config["type"] == "fs":  # rank 1 looks at rank 0's new KV pages on every miss
        tier = replace(tier, config={**tier.config, "refresh_interval_s": 0})
    kv = mla_pool("page_first", tokens=1024)
    states = [mamba_pool(), mamba_pool()]
    tokens, keys = chain(8, P, seed=9)
    answers: dict[str, list[Any]] = {}
    for run, kind in enumerate(["ours", "file"] + (["restarted"] if tier.persists else [])):
        ranks = [
            tier.attach(
                "file" if kind == "file" else "ours",
                kv,
                {MAMBA: states[rank]},
                tmp_path,
                tp_rank=rank,
                tp_size=2,
            )
            for rank in (0, 1)
        ]
        try:
            for rank, (_, c) in enumerate(ranks if kind != "restarted" else []):
                c.backup(keys, Span(range(0, 4), [], {MAMBA: (torch.tensor([0]), 1)}))
                if rank == 0:
                    c.backup(keys, Span(range(4, 8), [], {MAMBA: (torch.tensor([1]), 1)}))
                else:  # rank 1 is no writer: its KV is skipped, its state stored
                    c.backup(keys, Span(range(4, 8)))
            answers[kind] = [
                [
                    c.query(tokens, c.hit_transfers({MAMBA: 1}, [])),
                    c.query(tokens[: 4 * P], c.hit_transfers({MAMBA: 1}, [])),  # partial
                    c.query(  # mid-chain, from page 4
                        tokens[4 * P :],
                        c.hit_transfers({MAMBA: 1}, []),
                        last_hash=keys[3],
                        prefix_keys=keys[:4],
                    ),
                    c.query(chain(9, P, seed=9)[0], c.hit_transfers({MAMBA: 1}, [])),  # extended
                    c.query(chain(2, P, seed=31)[0], c.hit_transfers({MAMBA: 1}, [])),  # never stored
                ]
                for _, c in ranks
            ]
            for rank, (_, c) in enumerate(ranks):
                slot = 5 + 2 * run + rank  # slots 5-6, 7-8, 9-10: each load into slots never loaded
                load = PoolTransfer(name=MAMBA, host_indices=torch.tensor([slot]), keys=[keys[3]])
                assert c.ctl.storage_backend.batch_get_v2([load]) == {MAMBA: [True]}
                assert flat_bytes(states[rank], slot) == flat_bytes(states[rank], 0)  # its own state
        finally:
            for backend, _ in ranks:
                if kind != "file":
                    backend.close()
    never = (0, [], {"kv": 0})
    expected = [
        [
            (8 * P, [4, 8], {"kv": 8, "mamba": 8}),
            (4 * P, [4], {"kv": 4, "mamba": 4}),
            (4 * P, [4], {"kv": 4, "mamba": 4}),
            (8 * P, [4, 8], {"kv": 8, "mamba": 8}),
            never,
        ],
        [  # rank 1 holds a state at page 4 only
            (4 * P, [4], {"kv": 8, "mamba": 4}),
            (4 * P, [4], {"kv": 4, "mamba": 4}),
            (0, [], {"kv": 4}),
            (4 * P, [4], {"kv": 8, "mamba": 4}),
            never,
        ],
    ]
    assert answers["file"] == expected
    if tier.shared:
        assert answers["ours"] == answers.get("restarted", answers["ours"]) == expected
    else:  # rank-local memory: rank 1, never a KV writer in SGLang, never sees rank 0's KV copy
        assert answers["ours"] == [expected[0], [never] * 5]


def test_an_mha_draft_pool_beside_mla_kv_is_stored_once_at_tp2(fs: dict[str, Any], tmp_path: Path) -> None:
    """An MHA draft model beside an MLA target (an EAGLE draft for DeepSeek / Kimi) at TP 2: SGLang
    backs the draft pages up from the writer rank only (rank-specific copies on Mooncake alone)
    and asks every rank for them, so they are stored once, as HiCacheFile stores them: both ranks
    hit as HiCacheFile's do, and rank 1 loads the writer's draft heads (the documented cost: the
    draft's acceptance). Stored per rank, rank 1 would answer 0 and SGLang's minimum across the
    ranks would cut every hit."""
    fs = {**fs, "refresh_interval_s": 0}
    kv = mla_pool("page_first", tokens=1024)
    drafts = [mha_pool("page_first", page_size=P, tokens=1024) for _ in range(2)]  # each rank's heads
    tokens, keys = chain(4, P, seed=11)
    answers = {}
    for kind in ("ours", "file"):
        ranks = [
            attach(kind, fs, kv, {DRAFT: drafts[rank]}, tmp_path / kind, tp_rank=rank, tp_size=2)
            for rank in (0, 1)
        ]
        try:
            # Both ranks back the span up; SGLang's own `should_backup` leaves rank 1's to rank 0.
            stored = [c.backup(keys, Span(range(0, 4), [DRAFT])) for _, c in ranks]
            answers[kind] = (stored, [c.query(tokens, c.hit_transfers({}, [DRAFT])) for _, c in ranks])
            if kind == "ours":
                (_, c1) = ranks[1]
                load = [PoolTransfer(name=DRAFT, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)]
                assert c1.prefetch(keys, [8, 9, 10, 11], load) == (4 * P, {})  # draft counts in the KV pages
                assert [flat_bytes(drafts[1], (8 + i) * P) for i in range(4)] == [
                    flat_bytes(drafts[0], i * P) for i in range(4)
                ]
        finally:
            for backend, _ in ranks:
                if kind == "ours":
                    backend.close()
    assert (
        answers["ours"]
        == answers["file"]
        == (
            [4 * P, 0],
            [(4 * P, [1, 2, 3, 4], {"kv": 4, "draft": 4})] * 2,
        )
    )


# -- pool sets 2 to 4 from three threads at once --------------------------------------------------------
def three_pool_sets(
    name: str,
) -> tuple[Any, dict[PoolName, Any], list[dict[PoolName, Any]], int, list[Span], Any]:
    """Pool set `name`: (KV pool, extra pools per rank, page size, the two spans backed up, the
    hit transfers of a query for a controller)."""
    if name == "swa-draft":
        page = 16
        kv = mha_pool("page_first", tokens=1024)
        pools = {
            SWA: mha_pool("page_first", layers=2, tokens=512),
            DRAFT: mha_pool("page_first", layers=1, tokens=1024),
            DRAFT_SWA: mha_pool("page_first", layers=1, tokens=512),
        }

        def window(first: int) -> torch.Tensor:
            return torch.arange(first * page, (first + 2) * page)

        spans = [
            Span(range(0, 4), [DRAFT], {SWA: (window(0), 2), DRAFT_SWA: (window(2), 2)}),
            Span(range(4, 8), [DRAFT], {SWA: (window(4), 2), DRAFT_SWA: (window(6), 2)}),
        ]
        return kv, [pools], page, spans, lambda c: c.hit_transfers({SWA: 2, DRAFT_SWA: 2}, [DRAFT])
    if name == "mla-dsa":
        kv, indexer = dsa_pools(tokens=1024)
        spans = [Span(range(0, 4), [INDEXER]), Span(range(4, 8), [INDEXER])]
        return kv, [{INDEXER: indexer}], P, spans, lambda c: c.hit_transfers({}, [INDEXER])
    kv = mla_pool("page_first", tokens=1024)  # "mla-mamba-tp2": a state per rank, one KV copy
    spans = [
        Span(range(0, 4), [], {MAMBA: (torch.tensor([0]), 1)}),
        Span(range(4, 8), [], {MAMBA: (torch.tensor([1]), 1)}),
    ]
    return (
        kv,
        [{MAMBA: mamba_pool()}, {MAMBA: mamba_pool()}],
        P,
        spans,
        lambda c: c.hit_transfers({MAMBA: 1}, []),
    )


@pytest.mark.parametrize("pool_set", ["swa-draft", "mla-dsa", "mla-mamba-tp2"])
def test_the_other_pool_sets_from_three_threads_answer_as_hicache_file_and_close_leaves_no_thread(
    pool_set: str, fs: dict[str, Any], tmp_path: Path
) -> None:
    """Each rank's backup, hit query and prefetch threads at once (as SGLang's controller runs
    them), for the SWA + draft, DeepSeek V3.2 and MLA + Mamba at TP 2 pool sets: every thread's
    answers hold while the others run; then the answers are HiCacheFile's after the same backups,
    the prefetched pages byte-exact, and closing leaves no thread of ours behind."""
    before = set(threading.enumerate())
    kv, rank_pools, page, spans, hits = three_pool_sets(pool_set)
    tp = {"tp_rank": 0, "tp_size": 1} if len(rank_pools) == 1 else {"tp_size": 2}
    fs = {**fs, "refresh_interval_s": 0}  # rank 1 looks for rank 0's KV copy on every miss
    tokens, keys = chain(10, page, seed=17)
    ranks = [
        attach("ours", fs, kv, pools, tmp_path, **{**tp, "tp_rank": rank})
        for rank, pools in enumerate(rank_pools)
    ]
    first_spans = threading.Barrier(len(ranks) + 2 * len(ranks))
    errors: list[BaseException] = []
    derived = [
        PoolTransfer(name=name, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)
        for name in (spans[0].derived or [])
    ]

    def backup(c: Controller) -> None:
        c.backup(keys, spans[0])
        first_spans.wait(timeout=120)
        c.backup(keys, spans[1])

    def query(c: Controller) -> None:
        first_spans.wait(timeout=120)
        for _ in range(10):
            assert c.query(tokens[: 4 * page], hits(c))[0] == 4 * page

    def prefetch(c: Controller, rank: int) -> None:
        first_spans.wait(timeout=120)
        dest = [8 + 4 * rank + i for i in range(4)]  # host pages never stored from
        for _ in range(3):
            assert c.prefetch(keys[:4], dest, derived) == (4 * page, {})

    def guarded(work: Any, *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                work(*args)
            except BaseException as exc:
                errors.append(exc)
                first_spans.abort()

        return threading.Thread(target=run)

    threads = [
        thread
        for rank, (_, c) in enumerate(ranks)
        for thread in (guarded(backup, c), guarded(query, c), guarded(prefetch, c, rank))
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        files = [
            attach("file", None, kv, pools, tmp_path, **{**tp, "tp_rank": rank})
            for rank, pools in enumerate(rank_pools)
        ]
        for _, f in files:
            for span in spans:
                f.backup(keys, span)
        for (_, c), (_, f) in zip(ranks, files):
            assert [c.query(t, hits(c)) for t in (tokens[: 8 * page], tokens[: 4 * page], tokens)] == [
                f.query(t, hits(f)) for t in (tokens[: 8 * page], tokens[: 4 * page], tokens)
            ]
        assert ranks[0][1].query(tokens[: 8 * page], hits(ranks[0][1]))[0] == 8 * page
        for rank in range(len(ranks)):
            for pool in [kv, *(rank_pools[rank][t.name] for t in derived)]:
                assert [flat_bytes(pool, (8 + 4 * rank + i) * page) for i in range(4)] == [
                    flat_bytes(pool, i * page) for i in range(4)
                ]
    finally:
        for backend, _ in ranks:
            backend.close()
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:  # worker threads leave once their queue is empty: wait for that
        thread.join(timeout=30)
    assert not [t.name for t in started if t.is_alive()]


# -- layouts and bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks", ["one block", "several blocks"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_every_layout_of_an_extra_pool_round_trips_byte_exact(
    layout: str, blocks: str, fs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's host layouts for a draft pool: each pool page stored and loaded as its own flat
    page, whole or (a page past `EXTRA_BLOCK_BYTES`) cut into blocks of the flat page's bytes."""
    if blocks == "several blocks":
        monkeypatch.setattr(sglang_pools, "EXTRA_BLOCK_BYTES", 4096)
    kv, draft = mha_pool("page_first", tokens=512), mha_pool(layout, tokens=512)
    backend, _ = attach("ours", fs, kv, {DRAFT: draft}, tmp_path)
    try:
        assert (backend._pools._entry(DRAFT).layout.blocks_per_page > 1) is (blocks == "several blocks")
        ks = chain(2, 16)[1]
        slots = torch.arange(0, 2 * draft.page_size)
        assert backend.batch_set_v2([PoolTransfer(name=DRAFT, host_indices=slots, keys=ks)]) == {
            DRAFT: [True, True]
        }
        dest = torch.arange(4 * draft.page_size, 6 * draft.page_size)
        assert backend.batch_get_v2([PoolTransfer(name=DRAFT, host_indices=dest, keys=ks)]) == {
            DRAFT: [True, True]
        }
        assert [flat_bytes(draft, (4 + i) * draft.page_size) for i in range(2)] == [
            flat_bytes(draft, i * draft.page_size) for i in range(2)
        ]
    finally:
        backend.close()


@pytest.mark.parametrize("blocks", ["one block", "several blocks"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mamba_state_round_trips_byte_exact_in_both_layouts_sglang_builds_it_in(
    layout: str, blocks: str, fs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang builds Mamba host pools in the two page-first layouts only (its constructor asserts
    it): each state stored and loaded byte-exact through the v2 calls, whole or as blocks."""
    if blocks == "several blocks":
        monkeypatch.setattr(sglang_pools, "EXTRA_BLOCK_BYTES", 4096)
    kv, state = mha_pool("page_first", tokens=512), mamba_pool(layout)
    backend, _ = attach("ours", fs, kv, {MAMBA: state}, tmp_path)
    try:
        assert (backend._pools._entry(MAMBA).layout.blocks_per_page > 1) is (blocks == "several blocks")
        _, keys = chain(3, 16, seed=29)
        stored = backend.batch_set_v2(
            [PoolTransfer(name=MAMBA, host_indices=torch.tensor([2, 0, 5]), keys=keys)]
        )
        assert stored == {MAMBA: [True] * 3}
        scrub(state, [9, 10, 11])
        loaded = backend.batch_get_v2(
            [PoolTransfer(name=MAMBA, host_indices=torch.tensor([9, 10, 11]), keys=keys)]
        )
        assert loaded == {MAMBA: [True] * 3}
        assert [flat_bytes(state, s) for s in (9, 10, 11)] == [flat_bytes(state, s) for s in (2, 0, 5)]
    finally:
        backend.close()


def test_a_pool_without_flat_pages_fails_at_registration_naming_pool_and_layout(
    fs: dict[str, Any], tmp_path: Path
) -> None:
    """page_first_kv_split (an NPU-only MLA layout SGLang builds nowhere else) has no flat pages in
    an MHA pool: registration fails, naming the pool and the layout; the backend still serves KV."""
    kv, draft = mha_pool("page_first", tokens=512), mha_pool("page_first", tokens=512)
    draft.layout = "page_first_kv_split"
    backend, _ = attach("ours", fs, kv, {}, tmp_path)
    try:
        with pytest.raises(ConfigError, match=r"'draft'.*page_first_kv_split"):
            backend.register_mem_host_pool_v2(draft, DRAFT)
        assert DRAFT not in getattr(backend, "registered_pools", {})
        with pytest.raises(InvalidArgumentError, match="draft"):
            backend.batch_get_v2([PoolTransfer(name=DRAFT, host_indices=torch.arange(16), keys=["k"])])
        assert backend.batch_set_v1(chain(1, 16)[1], torch.arange(16)) == [True]
    finally:
        backend.close()


@pytest.mark.parametrize(
    "kind", ["mamba-page_first", "mamba-page_first_direct", "dsa-page_first", "dsa-layer_first"]
)
def test_pools_copied_run_by_run_store_exactly_their_flat_pages(kind: str) -> None:
    """Mamba and DSA indexer pools in the page-first layouts are copied run by run, skipping
    SGLang's flat page: the runs, in order, must be that flat page byte for byte (so either way
    of copying stores the same bytes); other layouts go through the flat pages."""
    family, layout = kind.split("-", 1)
    pool = mamba_pool(layout) if family == "mamba" else dsa_pools(layout)[1]
    runs = PoolRuns.of(pool, FlatPages.of("pool", pool))
    if layout == "layer_first":
        assert runs is None
        return
    assert runs is not None
    starts = [3 * pool.page_size, 1 * pool.page_size, 6 * pool.page_size]
    for start, page_runs in zip(starts, runs.runs_of(starts)):
        assert b"".join(bytes(a[o : o + n]) for a, o, n in page_runs) == flat_bytes(pool, start)


def test_pools_never_share_pages_and_bad_input_is_refused(fs: dict[str, Any], tmp_path: Path) -> None:
    """A state page is never read as another pool's, nor another model's; a pool never registered
    and a hit policy that does not exist are refused; indices that do not cover the keys fail
    every entry, as HiCacheFile's do (SGLang relies on it)."""
    kv, indexer = dsa_pools(tokens=1024)
    state = mamba_pool()
    backend, c = attach("ours", fs, kv, {INDEXER: indexer, MAMBA: state}, tmp_path)
    other, _ = attach("ours", fs, kv, {INDEXER: indexer, MAMBA: state}, tmp_path, model="org/another")
    try:
        c.backup(KEYS, Span(range(0, 2), [INDEXER], {MAMBA: (torch.tensor([0]), 1)}))
        swapped = PoolTransfer(name=INDEXER, host_indices=torch.arange(8 * P, 9 * P), keys=[KEYS[1]])
        assert backend.batch_get_v2(
            [PoolTransfer(name=MAMBA, host_indices=torch.tensor([3]), keys=[KEYS[0]])]
        ) == {
            MAMBA: [False]  # the state is at the node's last page, 1; page 0 has KV and indexer only
        }
        assert other.batch_get_v2([swapped]) == {INDEXER: [False]}
        assert backend.batch_get_v2([swapped]) == {INDEXER: [True]}
        with pytest.raises(InvalidArgumentError, match="swa"):
            backend.batch_set_v2([PoolTransfer(name=SWA, host_indices=torch.arange(P), keys=[KEYS[0]])])
        short = PoolTransfer(name=INDEXER, host_indices=torch.arange(P), keys=KEYS[:2])
        assert backend.batch_get_v2([short]) == {INDEXER: [False, False]}
        short_kv = PoolTransfer(name=KV, host_indices=torch.arange(P), keys=KEYS[:2])  # KV named as a pool
        assert backend.batch_set_v2([short_kv]) == backend.batch_get_v2([short_kv]) == {KV: [False, False]}
        bad = PoolTransfer(name=INDEXER, hit_policy="every_other_page")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="every_other_page"):
            backend.batch_exists_v2(KEYS[:2], [bad])
        backend.clear()  # SGLang's flush: the extra pools' pages go with the KV pages
        assert backend.batch_get_v2([swapped]) == {INDEXER: [False]}
        assert backend.batch_exists_v2(KEYS[:2], c.hit_transfers({MAMBA: 1}, [INDEXER])).kv_hit_pages == 0
    finally:
        backend.close()
        other.close()


@pytest.mark.parametrize(
    "other",
    ["same", "draft-layer_first", "draft-float16", "mamba-page_first_direct"],
)
def test_an_extra_pools_pages_are_found_only_by_a_pool_of_the_same_dtype_and_layout(
    other: str, fs: dict[str, Any], tmp_path: Path
) -> None:
    """A draft (MHA) pool and a Mamba pool stored by one backend; a second backend over the same
    root whose pool differs only in layout or dtype (same page size in bytes) finds none of their
    pages: the pool's namespace carries both. The same pools (the control) find every page."""
    kv = mha_pool("page_first", tokens=512)
    draft, state = mha_pool("page_first", tokens=512), mamba_pool("page_first")
    _, keys = chain(2, 16, seed=19)
    writer, _ = attach("ours", fs, kv, {DRAFT: draft, MAMBA: state}, tmp_path)
    try:
        stored = writer.batch_set_v2(
            [
                PoolTransfer(name=DRAFT, host_indices=torch.arange(0, 32), keys=keys),
                PoolTransfer(name=MAMBA, host_indices=torch.tensor([0, 1]), keys=keys),
            ]
        )
        assert stored == {DRAFT: [True, True], MAMBA: [True, True]}
    finally:
        writer.close()
    other_draft, other_state = draft, state
    if other == "draft-layer_first":
        other_draft = mha_pool("layer_first", tokens=512)
    elif other == "draft-float16":
        other_draft = mha_pool("page_first", dtype=torch.float16, tokens=512)
    elif other == "mamba-page_first_direct":
        other_state = mamba_pool("page_first_direct")
    assert FlatPages.of("d", other_draft).page_nbytes == FlatPages.of("d", draft).page_nbytes
    assert FlatPages.of("m", other_state).page_nbytes == FlatPages.of("m", state).page_nbytes
    reader, _ = attach("ours", fs, kv, {DRAFT: other_draft, MAMBA: other_state}, tmp_path)
    try:
        loaded = reader.batch_get_v2(
            [
                PoolTransfer(name=DRAFT, host_indices=torch.arange(64, 96), keys=keys),
                PoolTransfer(name=MAMBA, host_indices=torch.tensor([4, 5]), keys=keys),
            ]
        )
        assert loaded == {DRAFT: [other_draft is draft] * 2, MAMBA: [other_state is state] * 2}
        if other == "same":
            assert [flat_bytes(draft, 64 + 16 * i) for i in range(2)] == [
                flat_bytes(draft, 16 * i) for i in range(2)
            ]
            assert [flat_bytes(state, 4 + i) for i in range(2)] == [flat_bytes(state, i) for i in range(2)]
    finally:
        reader.close()


def test_pool_pages_larger_than_a_block_are_stored_as_blocks_through_every_tier(
    tier: Tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page past `EXTRA_BLOCK_BYTES` (a Mamba state is tens of MiB) is stored as several blocks,
    each written as soon as it is copied: the answers and loads are still HiCacheFile's, through
    every tier and a restarted backend, and the tier holds every block of every stored page."""
    monkeypatch.setattr(sglang_pools, "EXTRA_BLOCK_BYTES", 4096)  # 12 KiB states: 4 blocks each
    kv, indexer = dsa_pools(tokens=2048)
    state = mamba_pool()
    pools = {INDEXER: indexer, MAMBA: state}
    ours, c = tier.attach("ours", kv, pools, tmp_path)
    _, f = attach("file", None, kv, pools, tmp_path)
    try:
        assert store_mamba_indexer_chain(c) == store_mamba_indexer_chain(f) == STORED
        assert mamba_indexer_answers(c) == mamba_indexer_answers(f) == MAMBA_INDEXER_EXPECTED
        check_mamba_indexer_loads(c, kv, indexer, state)
        entry = ours._pools._entry(MAMBA)
        assert entry.layout.blocks_per_page == 4
        if tier.kind != "redis":  # a shared server's stats count every test's blocks
            held = ours._bridge.call(sglang._stats(entry.staged.tier))
            assert held.get("blocks", 2 * 4) == 2 * 4  # two states stored (nodes 4 and 8), whole
    finally:
        ours.close()
    again, c2 = tier.attach("ours", kv, pools, tmp_path)
    try:
        if tier.persists:
            assert mamba_indexer_answers(c2) == MAMBA_INDEXER_EXPECTED
            check_mamba_indexer_loads(c2, kv, indexer, state)
    finally:
        again.close()


def test_a_page_evicted_while_its_batch_is_stored_is_not_answered_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch larger than a pool's page slots is stored in parts; a tier with room for four
    state pages evicts the first parts while the last are stored. Those pages must not be
    remembered as present: the hit answer is what the tier holds, and what it answers loads."""
    monkeypatch.setattr(sglang_pools, "EXTRA_POOL_SLOT_BYTES", 4 * 16384)  # parts of two state pages
    kv = mha_pool("page_first", heads=1, head_dim=64, layers=1, tokens=512)  # 4 KiB pages: 16 fit
    state = mamba_pool()  # 16 KiB pages: 4 fit
    backend, _ = attach("ours", {"type": "memory", "capacity_bytes": 65536}, kv, {MAMBA: state}, tmp_path)
    try:
        _, keys = chain(8, 16, seed=13)
        assert backend.batch_set_v1(keys, torch.arange(8 * 16)) == [True] * 8
        stored = backend.batch_set_v2([PoolTransfer(name=MAMBA, host_indices=torch.arange(8), keys=keys)])
        assert stored == {MAMBA: [True] * 8}  # each part was stored whole when it was stored
        answer = backend.batch_exists_v2(keys, [PoolTransfer(name=MAMBA, hit_policy=PoolHitPolicy.ALL_PAGES)])
        loaded = backend.batch_get_v2([PoolTransfer(name=MAMBA, host_indices=torch.arange(8, 16), keys=keys)])
        assert loaded == {MAMBA: [False] * 4 + [True] * 4}  # the first four were evicted
        assert (answer.kv_hit_pages, answer.extra_pool_hit_pages) == (0, {"kv": 8})
    finally:
        backend.close()


def test_a_kv_page_evicted_while_its_batch_is_stored_is_not_answered_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for packed KV pages (copied through page slots in parts): `batch_exists` answers
    what the tier holds, not what each part stored before a later part evicted it."""
    monkeypatch.setattr(sglang, "PAGE_SLOT_BYTES", 4 * 4096)  # parts of two KV pages
    kv = mha_pool("page_first", heads=1, head_dim=64, layers=1, tokens=512)  # 4 KiB pages: 4 fit
    backend, _ = attach("ours", {"type": "memory", "capacity_bytes": 4 * 4096}, kv, {}, tmp_path)
    try:
        _, keys = chain(8, 16, seed=17)
        assert backend.batch_set_v1(keys, torch.arange(8 * 16)) == [True] * 8
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys[:1], torch.arange(8 * 16, 9 * 16)) == [False]  # evicted
    finally:
        backend.close()


# -- BLOCK_GROUPS: HiCacheFile refuses it; ours answers whole groups --------------------------------------
def groups(kv_pages: int, present: list[bool], group_pages: int, then: list[Any] | None = None) -> Any:
    transfers = [
        PoolTransfer(
            name=PoolName.DEEPSEEK_V4_C4, hit_policy=PoolHitPolicy.BLOCK_GROUPS, group_pages=group_pages
        )
    ]
    table = {PoolName.DEEPSEEK_V4_C4: present, **{t.name: present for t in then or []}}
    return hit_answer(kv_pages, transfers + (then or []), lambda name: table[name][:kv_pages])


def test_block_groups_report_whole_groups_and_gate_nothing(tmp_path: Path) -> None:
    full = groups(10, [True] * 10, 4)
    assert (full.kv_hit_pages, full.extra_pool_hit_pages) == (10, {"kv": 10, "deepseek_v4_c4": 8})
    assert full.restorable_prefix_pages == list(range(1, 11))  # the KV hit is not cut
    gap = groups(10, [True] * 5 + [False] + [True] * 4, 4)  # the second group has a gap
    assert gap.extra_pool_hit_pages == {"kv": 10, "deepseek_v4_c4": 4} and gap.kv_hit_pages == 10
    assert groups(3, [True] * 3, 4).extra_pool_hit_pages == {"kv": 3}  # no whole group: no verdict
    with pytest.raises(InvalidArgumentError, match="group_pages"):
        groups(4, [True] * 4, 0)
    kv, _ = dsa_pools(tokens=512)
    file, _ = attach("file", None, kv, {}, tmp_path)
    assert file.batch_set(["k"], [kv.get_data_page(0)])
    compressed = PoolTransfer(
        name=PoolName.DEEPSEEK_V4_C4, hit_policy=PoolHitPolicy.BLOCK_GROUPS, group_pages=4
    )
    with pytest.raises(ValueError, match="BLOCK_GROUPS"):  # SGLang's own backend refuses it
        file.batch_exists_v2(["k"], [compressed])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_deepseek_v4_compressed_pool_answers_as_hicache_file_and_in_whole_block_groups(
    layout: str, fs: dict[str, Any], tmp_path: Path
) -> None:
    """SGLang's DeepSeek V4 paged host pool registered beside KV, in each layout it has: its pages
    stored and loaded byte-exact, an absent page failing its entry only, and an `ALL_PAGES` answer
    as HiCacheFile's; asked as `BLOCK_GROUPS`, the whole groups its pages cover, gating nothing."""
    c4_name = PoolName.DEEPSEEK_V4_C4
    kv, c4 = mha_pool("page_first", tokens=512), dsv4_pool(layout)  # both 16-token pages

    def slots(pages: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in pages])

    _, keys = chain(10, 16, seed=23)
    c4_pages = [0, 1, 2, 3, 4, 6, 7, 8, 9]  # page 5 missing
    ours, _ = attach("ours", fs, kv, {c4_name: c4}, tmp_path)
    file, _ = attach("file", None, kv, {c4_name: c4}, tmp_path)
    try:
        answers = []
        for backend in (ours, file):
            kv_pages = PoolTransfer(name=KV, host_indices=slots(list(range(10))), keys=keys)
            assert backend.batch_set_v2([kv_pages]) == {KV: [True] * 10}
            c4_transfer = PoolTransfer(
                name=c4_name, host_indices=slots(c4_pages), keys=[keys[p] for p in c4_pages]
            )
            assert backend.batch_set_v2([c4_transfer]) == {c4_name: [True] * 9}
            answer = backend.batch_exists_v2(
                keys, [PoolTransfer(name=c4_name, hit_policy=PoolHitPolicy.ALL_PAGES)]
            )
            answers.append((answer.kv_hit_pages, answer.extra_pool_hit_pages, answer.restorable_prefix_pages))
            scrub(c4, [p * 16 for p in (20, 21, 22, 23)])
            load = PoolTransfer(name=c4_name, host_indices=slots([20, 21, 22, 23]), keys=keys[4:8])
            assert backend.batch_get_v2([load]) == {c4_name: [True, False, True, True]}
            assert [flat_bytes(c4, p * 16) for p in (20, 22, 23)] == [
                flat_bytes(c4, p * 16) for p in (4, 6, 7)
            ]
        assert answers[0] == answers[1] == (5, {"kv": 10, "deepseek_v4_c4": 5}, [1, 2, 3, 4, 5])
        groups = PoolTransfer(
            name=c4_name, hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=4, group_pages=4
        )
        answer = ours.batch_exists_v2(keys, [groups])  # pages 0-3 a whole group; 4-7 has the gap
        assert (answer.kv_hit_pages, answer.extra_pool_hit_pages, answer.restorable_prefix_pages) == (
            10,
            {"kv": 10, "deepseek_v4_c4": 4},
            list(range(1, 11)),
        )
    finally:
        ours.close()


# -- pool set 5: DeepSeek V4 (a logical KV anchor + compressed pools) ---------------------------------
C4, C4_INDEXER = PoolName.DEEPSEEK_V4_C4, PoolName.DEEPSEEK_V4_C4_INDEXER
C4_STATE = PoolName.DEEPSEEK_V4_C4_STATE


def dsv4_pools(layout: str) -> tuple[Any, dict[PoolName, Any]]:
    """DeepSeek V4 as SGLang 0.5.23 assembles it: a `LogicalHostPool` KV anchor (no bytes); the C4
    compressed KV and C4 indexer pools, with as many pages of the anchor's 64 tokens; the SWA
    window and the C4 compressor state, in the SWA pool's slots (here also 64-token pages)."""
    kv = dsv4_logical_pool(layout, pages=16, page_size=P)
    c4 = dsv4_pool(layout, pages=16, page_size=P, item_bytes=16 * 584)
    indexer = dsv4_pool(layout, pages=16, page_size=P, item_bytes=16 * 132, name=C4_INDEXER)
    swa = dsv4_pool(layout, pages=16, page_size=P, item_bytes=P * 584, name=SWA)
    state = dsv4_state_pool(layout, pages=16, page_size=P)
    return kv, {C4: c4, C4_INDEXER: indexer, SWA: swa, C4_STATE: state}


def window(page: int) -> dict[PoolName, tuple[torch.Tensor, int]]:
    """The SWA window and the compressor state of one page, at SWA host page `page`."""
    slots = torch.arange(page * P, (page + 1) * P)
    return {SWA: (slots, 1), C4_STATE: (slots, 1)}


@pytest.mark.parametrize(
    "layout, tier",  # each layout SGLang builds the pools in, and every tier
    [
        ("page_first", "fs"),
        ("layer_first", "fs-sealed"),
        ("page_first_direct", "redis"),
        ("page_first", "memory"),
    ],
    indirect=["tier"],
)
def test_deepseek_v4_logical_kv_anchor_and_compressed_pools_answer_and_load_as_hicache_file(
    layout: str, tier: Tier, tmp_path: Path
) -> None:
    """SGLang's DeepSeek V4 pool set (a logical KV pool: anchors only) through SGLang's controller:
    the hit answers HiCacheFile's (whole, mid-chain, partial, extended, never stored, with a
    compressed indexer page missing in the middle and windows at node ends only), every pool
    loaded byte-exact, a page without its indexer page not loaded; ours on the v1 path,
    HiCacheFile, then ours restarted over the same storage on the generic path (where the tier
    keeps it)."""
    kv, pools = dsv4_pools(layout)
    tokens, keys = chain(8, P, seed=41)
    derived = [C4, C4_INDEXER]
    answers = {}
    for run, kind in enumerate(["ours", "file"] + (["restarted"] if tier.persists else [])):
        if kind == "restarted":  # the generic path (flat pages), which finds the v1 path's anchors
            backend, c = attach(
                "ours", tier.config, kv, pools, tmp_path, extra={**tier.extra, "interface_v1": 0}
            )
        else:
            backend, c = tier.attach(kind, kv, pools, tmp_path)
        try:
            if kind != "restarted":
                assert c.backup(keys, Span(range(0, 3), derived, window(2))) == 3 * P
                assert c.backup(keys, Span(range(3, 4), [C4])) == P  # page 3: no indexer page
                assert c.backup(keys, Span(range(4, 6), derived, window(5))) == 2 * P
            asked = c.hit_transfers({SWA: 1, C4_STATE: 1}, derived)
            answers[kind] = [
                c.query(tokens[: 6 * P], asked),
                c.query(tokens[4 * P : 6 * P], asked, last_hash=keys[3], prefix_keys=keys[:4]),
                c.query(tokens[: 2 * P], asked),  # partial
                c.query(tokens, asked),  # extended past what was stored
                c.query(chain(2, P, seed=43)[0], asked),  # never stored
            ]
            dest = 7 + 3 * run  # host pages 7-9, 10-12, 13-15
            for pool in pools.values():
                scrub(pool, [(dest + i) * P for i in range(3)])
            load = [
                PoolTransfer(name=name, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)
                for name in derived
            ]
            last = [
                PoolTransfer(
                    name=name,
                    host_indices=torch.arange(dest * P, (dest + 1) * P),
                    keys=["x"],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
                for name in (SWA, C4_STATE)
            ]
            loaded = c.prefetch(keys[:3], [dest, dest + 1, dest + 2], load + last)
            assert loaded == (3 * P, {"swa": 1, "deepseek_v4_c4_state": 1})
            for name in derived:
                assert [flat_bytes(pools[name], (dest + i) * P) for i in range(3)] == [
                    flat_bytes(pools[name], i * P) for i in range(3)
                ]
            for name in (SWA, C4_STATE):  # page 2's window, into page `dest`
                assert flat_bytes(pools[name], dest * P) == flat_bytes(pools[name], 2 * P)
            assert c.prefetch(keys[3:4], [dest], load) == (0, {})  # its indexer page is missing
            assert c.prefetch(keys[4:6], [dest, dest + 1], load) == (2 * P, {})
        finally:
            if kind != "file":
                backend.close()
    assert answers["ours"] == answers["file"] == answers.get("restarted", answers["ours"])
    # windows at pages 2 and 5 (prefixes 3 and 6), the indexer on pages 0-2: prefix 3 only
    whole = {"kv": 6, "swa": 6, "deepseek_v4_c4_state": 6, "deepseek_v4_c4": 6, "deepseek_v4_c4_indexer": 3}
    names = ["kv", "swa", "deepseek_v4_c4_state", "deepseek_v4_c4", "deepseek_v4_c4_indexer"]
    assert answers["ours"] == [
        (3 * P, [3], whole),
        (2 * P, [2], dict.fromkeys(names, 2)),  # from page 4: the window at the chain's page 5
        (0, [], {"kv": 2}),  # partial: no window ends there
        (3 * P, [3], whole),
        (0, [], {"kv": 0}),
    ]


def test_deepseek_v4_at_tp2_is_one_copy_for_both_ranks_as_hicache_file(
    fs: dict[str, Any], tmp_path: Path
) -> None:
    """DeepSeek V4's KV is rank-replicated in SGLang (as MLA): rank 0 alone stores the anchors and
    every pool; rank 1's backups store nothing, and it finds and loads rank 0's pages, as with
    HiCacheFile."""
    fs = {**fs, "refresh_interval_s": 0}  # rank 1 looks at rank 0's new pages on every miss
    kv, pools = dsv4_pools("page_first")
    tokens, keys = chain(4, P, seed=53)
    derived = [C4, C4_INDEXER]
    answers = {}
    for kind in ("ours", "file"):
        ranks = [attach(kind, fs, kv, pools, tmp_path, tp_rank=rank, tp_size=2) for rank in (0, 1)]
        try:
            (_, c0), (_, c1) = ranks
            assert c0.backup(keys, Span(range(0, 4), derived, window(3))) == 4 * P
            assert c1.backup(keys, Span(range(0, 4), derived, window(3))) == 0  # no writer
            asked = c1.hit_transfers({SWA: 1, C4_STATE: 1}, derived)
            answers[kind] = [c.query(tokens, asked) for c in (c0, c1)]
            for pool in pools.values():
                scrub(pool, [p * P for p in range(8, 12)])
            load = [
                PoolTransfer(name=name, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)
                for name in derived
            ]
            assert c1.prefetch(keys, [8, 9, 10, 11], load) == (4 * P, {})
            for name in derived:
                assert [flat_bytes(pools[name], p * P) for p in range(8, 12)] == [
                    flat_bytes(pools[name], p * P) for p in range(4)
                ]
        finally:
            for backend, _ in ranks if kind == "ours" else []:
                backend.close()
    every = {"kv": 4, "swa": 4, "deepseek_v4_c4_state": 4, "deepseek_v4_c4": 4, "deepseek_v4_c4_indexer": 4}
    assert answers["ours"] == answers["file"] == [(4 * P, [4], every)] * 2


def test_a_logical_kv_pools_anchors_are_checked_and_never_kv_pages(
    fs: dict[str, Any], tmp_path: Path
) -> None:
    """A logical KV pool's pages are anchors in a namespace of their own: an MHA model's KV pages
    under the same keys are not its anchors (nor the reverse); a block under an anchor's name that
    holds other bytes is not loaded; its flat pages must be empty; nothing is written to a pool
    that has no memory."""
    kv, pools = dsv4_pools("page_first")
    _, keys = chain(4, P, seed=47)
    slots = torch.arange(0, 2 * P, dtype=torch.int64)
    ours, _ = attach("ours", fs, kv, pools, tmp_path)
    mha = mha_pool("page_first", page_size=P, tokens=8 * P)
    other, _ = attach("ours", fs, mha, {}, tmp_path)
    try:
        assert ours.batch_set_v1(keys[:2], slots) == [True, True]
        assert ours.batch_exists(keys) == 2 and other.batch_exists(keys) == 0
        assert other.batch_set_v1(keys[2:4], slots) == [True, True]
        assert ours.batch_exists(keys[2:]) == 0
        assert ours.batch_get_v1(keys[:2], slots) == [True, True]
        assert ours.batch_get(keys[:2], [torch.empty(0, dtype=torch.uint8)] * 2)[0] is not None
        # a block under an anchor's name, of other bytes: found, but never loaded as an anchor
        anchor, page = ours._anchor, sglang._page_key(keys[3])
        with anchor.slots.lease(1) as leased:
            anchor.slots.tensor[leased[0]].fill_(7)
            layout = ours._layout
            stored = ours._bridge.call(anchor.tier.store(layout.keys([page]), anchor.slots.block_ids(leased)))
        assert stored == [True]
        assert ours.batch_get_v1(keys[3:4], slots[:P]) == [False]
        with pytest.raises(InvalidArgumentError, match="hold no bytes"):
            ours.batch_set(keys[:1], [torch.zeros(4, dtype=torch.uint8)])
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            ours.batch_set_v1(keys[:2], slots[:P])
    finally:
        ours.close()
        other.close()


def test_the_pool_helpers_build_whatever_the_machine_has_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang refuses a host pool while the machine has less than its serving reserve free; a
    shared test machine often has not. Every helper here books its pools against a budget of its
    own, so the tests do not fail for what other processes on the machine hold."""
    from sglang.srt.mem_cache.pool_host import base

    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 1 << 50)
    mha_pool("page_first"), mla_pool("page_first"), mamba_pool(), dsa_pools(), qsa_pools(), dsv4_pool()
