"""`KVTierHiCacheStorage` as SGLang 0.5.23 loads and drives it, over SGLang's real host pools.

The backend is built through SGLang's own `StorageBackendFactory` (`dynamic` path, the JSON a
user passes), handed SGLang's real MHA / MLA host pools built on the CPU, and called as the
cache controller calls it: from several threads at once, in batches, with host slots. SGLang's
own `HiCacheFile` runs through the format checks as the control: it reads pages stored with
another dtype or layout, which ours must not.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs SGLang and never skips these
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import servers
import torch
from sglang_env import (
    HiCacheFile,
    StorageBackendFactory,
    backend_config,
    mha_pool,
    mla_pool,
    page_bytes,
    slots,
)

from kvtier_async.errors import ConfigError, InvalidArgumentError, UnknownTierError
from kvtier_async.integrations.sglang import KVTierHiCacheStorage

LAYOUTS = ["page_first", "layer_first"]


def keys(n: int, tag: str = "a") -> list[str]:
    """SGLang-style page keys: 64 hex characters each."""
    return [f"{tag}{i:063x}"[:64] for i in range(n)]


def build(tier: dict[str, Any] | None, pool: Any, **config: Any) -> KVTierHiCacheStorage:
    """What SGLang does at attach: the factory's dynamic path, then the host pool."""
    storage_config = backend_config(tier, pool=pool, **config)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config, pool)
    assert isinstance(backend, KVTierHiCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


@pytest.fixture
def fs(tmp_path: Path) -> dict[str, Any]:
    return {"type": "fs", "root": str(tmp_path / "kv")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_from_three_controller_threads_byte_exact(layout: str, fs: dict[str, Any]) -> None:
    pool = mha_pool(layout)
    backend = build(fs, pool)
    try:
        names = keys(24)
        # The backup thread's batches from three threads at once: pages 0-7, 8-15, 16-23.
        results: dict[int, list[bool]] = {}

        def backup(part: int) -> None:
            pages = list(range(part * 8, part * 8 + 8))
            results[part] = backend.batch_set_v1(names[part * 8 : part * 8 + 8], slots(pool, pages))

        threads = [threading.Thread(target=backup, args=(part,)) for part in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == {0: [True] * 8, 1: [True] * 8, 2: [True] * 8}
        assert backend.batch_exists(names) == 24

        # Prefetch into other host slots (pages 24-31 get the bytes of pages 4-11).
        expected = [page_bytes(pool, p) for p in range(4, 12)]
        assert backend.batch_get_v1(names[4:12], slots(pool, list(range(24, 32)))) == [True] * 8
        assert [page_bytes(pool, p) for p in range(24, 32)] == expected
    finally:
        backend.close()


def test_batch_exists_counts_the_leading_run_and_stops_at_a_gap(fs: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    backend = build(fs, pool)
    try:
        names = keys(10)
        stored = [0, 1, 2, 4, 5]  # page 3 is the gap
        assert backend.batch_set_v1([names[i] for i in stored], slots(pool, stored)) == [True] * 5
        assert backend.batch_exists(names) == 3
        assert backend.batch_exists(names[4:6]) == 2
        assert backend.batch_exists(names[6:]) == 0
        assert backend.exists(names[0]) and not backend.exists(names[3])
        # A load of a batch with the gap: the pages around it arrive, the gap does not.
        assert backend.batch_get_v1(names[2:5], slots(pool, [20, 21, 22])) == [True, False, True]
    finally:
        backend.close()


def test_a_restarted_backend_on_the_same_root_finds_and_loads_the_pages(fs: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    names = keys(8)
    first = build(fs, pool)
    assert first.batch_set_v1(names, slots(pool, list(range(8)))) == [True] * 8
    expected = [page_bytes(pool, p) for p in range(8)]
    first.close()

    again = mha_pool("page_first")  # a new process: its own pool, other bytes in it
    second = build(fs, again)
    try:
        assert second.batch_exists(names) == 8
        assert second.batch_get_v1(names, slots(again, list(range(10, 18)))) == [True] * 8
        assert [page_bytes(again, p) for p in range(10, 18)] == expected
    finally:
        second.close()


def test_new_weights_under_the_same_model_path_never_load_the_old_pages(
    fs: dict[str, Any], tmp_path: Path
) -> None:
    """SGLang hands the backend the model's path, not its revision: the weights there decide."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"old weights")
    pool = mha_pool("page_first")
    names = keys(4)
    first = build(fs, pool, model=str(model))
    assert first.batch_set_v1(names, slots(pool, list(range(4)))) == [True] * 4
    first.close()
    (model / "model.safetensors").write_bytes(b"new weights, same name")  # updated in place
    second = build(fs, mha_pool("page_first"), model=str(model))
    try:
        assert second.batch_exists(names) == 0
    finally:
        second.close()


def test_tensor_parallel_ranks_do_not_see_each_others_pages(fs: dict[str, Any]) -> None:
    pool0, pool1 = mha_pool("page_first"), mha_pool("page_first")
    rank0 = build(fs, pool0, tp_rank=0, tp_size=2)
    rank1 = build(fs, pool1, tp_rank=1, tp_size=2)
    try:
        names = keys(4)
        assert rank0.batch_set_v1(names, slots(pool0, [0, 1, 2, 3])) == [True] * 4
        assert rank0.batch_exists(names) == 4
        assert rank1.batch_exists(names) == 0
        assert rank1.batch_get_v1(names, slots(pool1, [0, 1, 2, 3])) == [False] * 4
    finally:
        rank0.close()
        rank1.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_ranks_share_one_copy_written_by_the_writer_rank_only(layout: str, fs: dict[str, Any]) -> None:
    fs = {**fs, "refresh_interval_s": 0}  # the reader looks at the writer's new pages on every miss
    writer_pool, reader_pool = mla_pool(layout), mla_pool(layout)
    writer = build(fs, writer_pool, tp_rank=0, tp_size=2)
    reader = build(fs, reader_pool, tp_rank=1, tp_size=2)
    try:
        names = keys(4)
        # The non-writer rank acknowledges (SGLang's contract) and writes nothing.
        assert reader.batch_set_v1(names, slots(reader_pool, [0, 1, 2, 3])) == [True] * 4
        assert writer.batch_exists(names) == 0
        assert writer.batch_set_v1(names, slots(writer_pool, [0, 1, 2, 3])) == [True] * 4
        assert reader.batch_exists(names) == 4
        assert reader.batch_get_v1(names, slots(reader_pool, [4, 5, 6, 7])) == [True] * 4
        assert [page_bytes(reader_pool, p) for p in range(4, 8)] == [
            page_bytes(writer_pool, p) for p in range(4)
        ]
    finally:
        writer.close()
        reader.close()


def generic_round_trip(make: Any, tmp_path: Path) -> tuple[bool, bool]:
    """Store flat pages of a float16 page-first pool, then read them through a bfloat16 pool and a
    layer-first pool of the same geometry; whether each read succeeded."""
    writer_pool = mha_pool("page_first", dtype=torch.float16)
    names = keys(2, "f")
    writer = make(writer_pool, tmp_path)
    pages = [writer_pool.get_data_page(p * writer_pool.page_size) for p in range(2)]
    assert writer.batch_set(names, pages)
    readouts = []
    for other in (mha_pool("page_first", dtype=torch.bfloat16), mha_pool("layer_first", dtype=torch.float16)):
        reader = make(other, tmp_path)
        got = reader.batch_get(names, [other.get_dummy_flat_data_page() for _ in names])
        readouts.append(all(page is not None for page in got))
        if isinstance(reader, KVTierHiCacheStorage):
            reader.close()
    if isinstance(writer, KVTierHiCacheStorage):
        writer.close()
    return readouts[0], readouts[1]


def test_control_sglangs_file_backend_reads_pages_of_another_dtype_and_layout(tmp_path: Path) -> None:
    def make(pool: Any, root: Path) -> HiCacheFile:
        config = backend_config(None, pool=pool, extra={"file_storage_path": str(root / "hicache")})
        backend = HiCacheFile(config)
        backend.register_mem_pool_host(pool)
        return backend

    assert generic_round_trip(make, tmp_path) == (True, True)  # foreign bytes, read as if ours


def test_ours_never_reads_pages_of_another_dtype_or_layout(tmp_path: Path) -> None:
    def make(pool: Any, root: Path) -> KVTierHiCacheStorage:
        return build({"type": "fs", "root": str(root / "kv")}, pool)

    assert generic_round_trip(make, tmp_path) == (False, False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_generic_path_round_trips_flat_pages(layout: str, fs: dict[str, Any]) -> None:
    pool = mha_pool(layout)
    backend = build(fs, pool)
    try:
        names = keys(3, "g")
        pages = [pool.get_data_page(p * pool.page_size) for p in range(3)]
        assert backend.batch_set(names, pages)
        got = backend.batch_get(names + keys(1, "m"), [pool.get_dummy_flat_data_page() for _ in range(4)])
        assert got[3] is None
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:3], pages))
        assert backend.set("c" * 64, pages[0])
        assert torch.equal(backend.get("c" * 64).view(torch.uint8), pages[0].view(torch.uint8))  # bytes: NaNs
    finally:
        backend.close()


#: Pool geometries users launch: the documented one (runs in place), SGLang's default page size 1
#: and page size 16 with 2 KV heads x 32 dims (runs of 128 B and 2 KiB: packed), and MLA with
#: page size 1 (runs of 1152 B: packed).
GEOMETRIES = {
    "mha-16x2x128": lambda layout: mha_pool(layout),
    "mha-1x2x32": lambda layout: mha_pool(layout, page_size=1, heads=2, head_dim=32, tokens=64),
    "mha-16x2x32": lambda layout: mha_pool(layout, page_size=16, heads=2, head_dim=32),
    "mla-1": lambda layout: mla_pool(layout, page_size=1, tokens=64),
}


def flat_pages(pool: Any, pages: list[int]) -> list[torch.Tensor]:
    """Host pages as the generic controller path hands them over (`get_data_page`)."""
    return [pool.get_data_page(p * pool.page_size).clone() for p in pages]


def stored_through(
    backend: KVTierHiCacheStorage, pool: Any, path: str, names: list[str], pages: list[int]
) -> None:
    if path == "v1":
        assert backend.batch_set_v1(names, slots(pool, pages)) == [True] * len(names)
    else:
        assert backend.batch_set(names, flat_pages(pool, pages))


def loaded_through(
    backend: KVTierHiCacheStorage, pool: Any, path: str, names: list[str], into: list[int]
) -> None:
    """Load `names` into host pages `into` by `path` (the generic one as the controller does:
    dummy flat pages, then `set_from_flat_data_page`)."""
    if path == "v1":
        assert backend.batch_get_v1(names, slots(pool, into)) == [True] * len(names)
        return
    got = backend.batch_get(names, [pool.get_dummy_flat_data_page() for _ in names])
    assert all(page is not None for page in got)
    for page, host in zip(got, into):
        pool.set_from_flat_data_page(host * pool.page_size, page)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", ["v1", "generic"])
def test_every_geometry_and_path_stores_one_layout_found_and_loaded_by_either_path(
    path: str, layout: str, geometry: str, fs: dict[str, Any]
) -> None:
    """Set, exists, get by the path the controller uses, get by the other, and a restart: every
    page byte-exact, every stored page found by `batch_exists`."""
    pool = GEOMETRIES[geometry](layout)
    other = "generic" if path == "v1" else "v1"
    names, count = keys(12, path[0]), 12
    expected = [page_bytes(pool, p) for p in range(count)]
    backend = build(fs, pool, extra={"interface_v1": int(path == "v1")})
    try:
        stored_through(backend, pool, path, names, list(range(count)))
        assert backend.batch_exists(names + keys(1, "z")) == count
        loaded_through(backend, pool, path, names, list(range(count, 2 * count)))
        assert [page_bytes(pool, p) for p in range(count, 2 * count)] == expected
        loaded_through(backend, pool, other, names[3:9], list(range(2 * count, 2 * count + 6)))
        assert [page_bytes(pool, p) for p in range(2 * count, 2 * count + 6)] == expected[3:9]
    finally:
        backend.close()

    again = GEOMETRIES[geometry](layout)  # a new process: its own pool, other bytes in it
    for reader_path in (path, other):
        restarted = build(fs, again, extra={"interface_v1": int(reader_path == "v1")})
        try:
            assert restarted.batch_exists(names) == count
            loaded_through(restarted, again, reader_path, names, list(range(count)))
            assert [page_bytes(again, p) for p in range(count)] == expected
        finally:
            restarted.close()


def test_sglangs_generic_controller_path_hits_without_interface_v1(
    fs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The backend built by SGLang's factory from a config without `interface_v1`, driven by
    SGLang's own controller code for that path: its hit query (real page hashes of token ids,
    `batch_exists`), its generic page set (`get_data_page`, `batch_set`) and get (dummy pages,
    `batch_get`, `set_from_flat_data_page`)."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController

    pool = mha_pool("layer_first", page_size=1, heads=2, head_dim=32, tokens=128)  # small runs too
    storage_config = backend_config(fs, pool=pool)
    del storage_config.extra_config["interface_v1"]
    with caplog.at_level("WARNING", logger="kvtier_async.integrations.sglang"):
        backend = StorageBackendFactory.create_backend("dynamic", storage_config, pool)
        backend.register_mem_pool_host(pool)
    assert isinstance(backend, KVTierHiCacheStorage) and not backend.interface_v1
    warnings = [r.getMessage() for r in caplog.records]
    assert any("interface_v1" in w for w in warnings) and any("--page-size" in w for w in warnings)
    try:
        controller = SimpleNamespace(
            storage_host_pool=pool, storage_backend=backend, page_size=pool.page_size
        )
        tokens = list(range(1000, 1040))  # 40 pages of one token
        operation = SimpleNamespace(
            last_hash=None, token_ids=tokens, prefix_keys=None, request_id="r1", is_terminated=lambda: False
        )
        hits, tokens_hit = HiCacheController._storage_hit_query(controller, operation)
        assert (hits, tokens_hit) == ([], 0)
        hashes = operation.all_hash_values
        host = torch.arange(0, 40, dtype=torch.int64)
        expected = [page_bytes(pool, p) for p in range(40)]
        assert HiCacheController._generic_page_set(controller, hashes, host)

        hits, tokens_hit = HiCacheController._storage_hit_query(controller, operation)
        assert hits == hashes and tokens_hit == 40
        into = torch.arange(64, 104, dtype=torch.int64)
        assert HiCacheController._generic_page_get(controller, operation, hashes, into) == 40
        assert [page_bytes(pool, p) for p in range(64, 104)] == expected
    finally:
        backend.close()


def test_clear_forgets_this_backends_pages(fs: dict[str, Any]) -> None:
    pool = mha_pool("page_first")
    backend = build(fs, pool)
    try:
        names = keys(4)
        assert backend.batch_set_v1(names, slots(pool, [0, 1, 2, 3])) == [True] * 4
        backend.clear()
        assert backend.batch_exists(names) == 0
        assert backend.batch_get_v1(names, slots(pool, [4, 5, 6, 7])) == [False] * 4
    finally:
        backend.close()


def test_close_leaves_no_thread_behind_and_later_calls_fail_clearly(fs: dict[str, Any]) -> None:
    before = set(threading.enumerate())
    pool = mha_pool("page_first")
    backend = build(fs, pool)
    assert backend.batch_set_v1(keys(2), slots(pool, [0, 1])) == [True, True]
    backend.close()
    backend.close()  # idempotent
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:  # worker threads leave once their queue is empty: wait for that
        thread.join(timeout=30)
    assert not [t.name for t in started if t.is_alive()]
    with pytest.raises(Exception, match="closed"):
        backend.batch_exists(keys(1))


def test_get_stats_reports_through_sglangs_storage_metrics(fs: dict[str, Any]) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = mha_pool("page_first")
    backend = build(fs, pool)
    try:
        assert backend.get_stats() is None  # nothing moved yet
        names = keys(4)
        backend.batch_set_v1(names, slots(pool, [0, 1, 2, 3]))
        backend.batch_get_v1(names, slots(pool, [4, 5, 6, 7]))
        stats = backend.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [4] and stats.prefetch_pgs == [4]
        assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
        assert backend.get_stats() is None  # each figure reported once
    finally:
        backend.close()


def test_a_root_others_may_write_fails_sglangs_start_up_with_the_message(tmp_path: Path) -> None:
    # Misconfiguration: an fs root of mode 0777; SGLang must not start with a tier that never
    # stores a byte.
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match="written by group or others"):
        build({"type": "fs", "root": str(root)}, mha_pool("page_first"))


def test_a_redis_server_down_at_start_up_starts_sglang_with_the_tier_degraded(tmp_path: Path) -> None:
    # A fault that may pass: the server is down while SGLang starts. The backend starts; the
    # tier's opening is counted, and its calls retry it.
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = servers.RedisServer(tmp_path / "redis")  # not started
    backend = build({"type": "redis", "url": server.url, "timeout_s": 0.5}, mha_pool("page_first"))
    try:
        assert backend._main is not None
        assert backend._main.stats()["errors"] == 1
    finally:
        backend.close()


def test_bad_configuration_fails_at_start_up_naming_the_key(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    with pytest.raises(ConfigError, match='"tier"'):
        StorageBackendFactory.create_backend("dynamic", backend_config(None, pool=pool), pool)
    with pytest.raises(UnknownTierError, match="nvme"):
        StorageBackendFactory.create_backend("dynamic", backend_config({"type": "nvme"}, pool=pool), pool)
    with pytest.raises(ConfigError, match="limits"):
        build({"type": "fs", "root": str(tmp_path)}, pool, extra={"limits": {"threads": 4}})
    with pytest.raises(ConfigError, match="root"):
        build({"type": "fs"}, pool)
    backend = build({"type": "fs", "root": str(tmp_path / "ok")}, pool)
    try:
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            backend.batch_set_v1(keys(2), slots(pool, [0]))  # one page of slots for two keys
    finally:
        backend.close()


@pytest.mark.parametrize("shared", ["redis", "s3", "mooncake"])
def test_a_fleet_shares_pages_through_a_shared_tier(shared: str, request: pytest.FixtureRequest) -> None:
    if shared == "redis":
        tier = {"type": "redis", "url": request.getfixturevalue("redis_server").url, "prefix": "sglang-test"}
    elif shared == "mooncake":  # two backends of one process share one Mooncake client
        master = request.getfixturevalue("mooncake_master")
        tier = {
            "type": "mooncake",
            "master": master.address,
            "segment_bytes": 64 << 20,
            "prefix": "sglang-test",
        }
    else:
        endpoint = request.getfixturevalue("s3_server").endpoint
        tier = {"type": "s3", "bucket": servers.S3_BUCKET, "endpoint": endpoint, "allow_http": True}
        tier |= servers.S3_CREDENTIALS
    pool_a, pool_b = mha_pool("page_first"), mha_pool("page_first")
    a, b = build(tier, pool_a), build(tier, pool_b)  # two servers of a fleet
    try:
        names = keys(6, "s")
        assert a.batch_set_v1(names, slots(pool_a, list(range(6)))) == [True] * 6
        assert b.batch_exists(names) == 6
        assert b.batch_get_v1(names, slots(pool_b, list(range(10, 16)))) == [True] * 6
        assert [page_bytes(pool_b, p) for p in range(10, 16)] == [page_bytes(pool_a, p) for p in range(6)]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["fs", "redis", "fs-packed"])
def test_the_three_controller_threads_at_once_with_full_batches(
    kind: str, fs: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Backup (batch_set_v1), prefetch (batch_exists over the whole chain) and prefetch I/O
    (batch_get_v1) threads at once, 128 pages a call, as SGLang's controller runs them; pages in
    place, and packed pages copied through page slots."""
    tier = fs
    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        tier = {"type": "redis", "url": url, "prefix": "sglang-threads"}
    if kind == "fs-packed":  # page size 1, small runs: pages through page slots, leased per call
        pool = mha_pool("layer_first", page_size=1, heads=2, head_dim=32, tokens=512)
    else:
        pool = mha_pool("page_first", tokens=16 * 512)
    backend = build(tier, pool)
    chain = keys(256, "t")
    first_half_stored = threading.Event()
    seen: list[int] = []
    loaded: list[list[bool]] = []
    errors: list[BaseException] = []

    def backup() -> None:
        assert backend.batch_set_v1(chain[:128], slots(pool, list(range(128)))) == [True] * 128
        first_half_stored.set()
        assert backend.batch_set_v1(chain[128:], slots(pool, list(range(128, 256)))) == [True] * 128

    def prefetch() -> None:
        first_half_stored.wait(timeout=60)
        for _ in range(50):
            seen.append(backend.batch_exists(chain))

    def prefetch_io() -> None:
        first_half_stored.wait(timeout=60)
        loaded.append(backend.batch_get_v1(chain[:128], slots(pool, list(range(256, 384)))))

    def guarded(work: Any) -> Any:
        def run() -> None:
            try:
                work()
            except BaseException as exc:
                errors.append(exc)
                first_half_stored.set()

        return run

    threads = [threading.Thread(target=guarded(w)) for w in (backup, prefetch, prefetch_io)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert loaded == [[True] * 128]
        assert [page_bytes(pool, p) for p in range(256, 384)] == [page_bytes(pool, p) for p in range(128)]
        assert all(128 <= n <= 256 for n in seen) and backend.batch_exists(chain) == 256
        assert backend.tier_stats()["errors"] == 0
    finally:
        backend.close()


def test_a_tier_secret_reaches_the_tier_through_sglangs_config(
    fs: dict[str, Any], tier_secret_env: str
) -> None:
    """The secret keys sit in the tier config as SGLang passes it: pages sealed, byte-exact."""
    sealed = {**fs, "secret_env": tier_secret_env}
    pool = mha_pool("page_first")
    names = keys(4)
    backend = build(sealed, pool)
    try:
        assert backend.batch_set_v1(names, slots(pool, list(range(4)))) == [True] * 4
        expected = [page_bytes(pool, p) for p in range(4)]
        assert backend.tier_stats()["sealed"] is True
    finally:
        backend.close()
    again = mha_pool("page_first")
    second = build(sealed, again)
    plain = build(fs, mha_pool("page_first"))
    try:
        assert second.batch_exists(names) == 4
        assert second.batch_get_v1(names, slots(again, list(range(10, 14)))) == [True] * 4
        assert [page_bytes(again, p) for p in range(10, 14)] == expected
        assert plain.batch_exists(names) == 0  # without the secret: nothing there
    finally:
        second.close()
        plain.close()
