"""`KVTierL2Adapter` as LMCache 0.5.6's multiprocess server loads and drives it.

The adapter is built from the `--l2-adapter` JSON a user passes, through LMCache's own
argument parser, config registry and adapter factory (`plugin` type), and driven with LMCache's
real `ObjectKey`, `TensorMemoryObj`, `Bitmap` and event fds, as its store and prefetch
controllers drive it: submit, wait on the task's event fd, collect the result.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import threading
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs LMCache and never skips these
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.base")

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from kvtier_async.errors import ConfigError
from kvtier_async.integrations.lmcache import KVTierL2Adapter

CHUNK = 64 << 10  # bytes of one chunk object in these tests


def adapter_json(tier: dict[str, Any], **params: Any) -> str:
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvtier_async.integrations.lmcache",
            "class_name": "KVTierL2Adapter",
            "adapter_params": {"tier": tier, **params},
        }
    )


def build(tier: dict[str, Any], **params: Any) -> KVTierL2Adapter:
    """What `lmcache server --l2-adapter '<json>'` does with our JSON."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    config = parse_args_to_l2_adapters_config(
        parser.parse_args(["--l2-adapter", adapter_json(tier, **params)])
    )
    adapter = create_l2_adapter_from_registry(config.adapters[0])
    assert isinstance(adapter, KVTierL2Adapter)
    return adapter


def key(i: int, model: str = "org/model", salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name=model, kv_rank=0, cache_salt=salt)


def chunk(nbytes: int = CHUNK, seed: int | None = None, raw: torch.Tensor | None = None) -> TensorMemoryObj:
    """A memory object as LMCache's allocators make them, filled with random bytes (or zeros);
    in `raw` (a slice of an L1 arena) if given."""
    raw = torch.zeros(nbytes, dtype=torch.uint8) if raw is None else raw.zero_()
    if seed is not None:
        raw.copy_(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        )
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes]),
        dtype=torch.uint8,
        address=0,
        phy_size=nbytes,
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


LAYOUT = {0: MemoryLayoutDesc(shapes=[torch.Size([CHUNK])], dtypes=[torch.uint8])}


def wait(fd: int) -> None:
    """Block until the event fd is signalled (as LMCache's controllers poll it), then drain it."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(30_000), "no completion signalled within 30 s"
    consume_fd(fd)


def store(adapter: KVTierL2Adapter, keys: list[ObjectKey], objects: list[TensorMemoryObj]) -> Any:
    task = adapter.submit_store_task(keys, objects)
    while True:
        done = adapter.pop_completed_store_tasks()
        if task in done:
            return done[task]
        wait(adapter.get_store_event_fd())


def lookup(adapter: KVTierL2Adapter, keys: list[ObjectKey], layout: Any = LAYOUT) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, layout)
    while (bitmap := adapter.query_lookup_and_lock_result(task)) is None:
        wait(adapter.get_lookup_and_lock_event_fd())
    assert adapter.query_lookup_and_lock_result(task) is None  # answered once
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter: KVTierL2Adapter, keys: list[ObjectKey], objects: list[TensorMemoryObj]) -> list[bool]:
    task = adapter.submit_load_task(keys, objects)
    while (bitmap := adapter.query_load_result(task)) is None:
        wait(adapter.get_load_event_fd())
    return [bitmap.test(i) for i in range(len(keys))]


def same(a: TensorMemoryObj, b: TensorMemoryObj) -> bool:
    return bool(torch.equal(a.raw_tensor, b.raw_tensor))


@pytest.fixture
def fs(tmp_path: Path) -> dict[str, Any]:
    return {"type": "fs", "root": str(tmp_path / "kv")}


def test_store_lookup_load_through_lmcaches_plugin_path_byte_exact(fs: dict[str, Any]) -> None:
    adapter = build(fs)
    try:
        fds = {
            adapter.get_store_event_fd(),
            adapter.get_lookup_and_lock_event_fd(),
            adapter.get_load_event_fd(),
        }
        assert len(fds) == 3
        keys, objects = [key(i) for i in range(6)], [chunk(seed=i) for i in range(6)]
        result = store(adapter, keys, objects)
        assert result.is_successful() and result.bytes_transferred() == 6 * CHUNK
        assert lookup(adapter, [*keys, key(99)]) == [True] * 6 + [False]
        targets = [chunk() for _ in range(7)]
        assert load(adapter, [*keys, key(99)], targets) == [True] * 6 + [False]
        assert all(same(a, b) for a, b in zip(objects, targets[:6]))
        assert not targets[6].raw_tensor.any()  # the miss left its buffer alone
        adapter.submit_unlock(keys)
        assert adapter.report_status()["locked_key_count"] == 0
    finally:
        adapter.close()


def test_a_restarted_adapter_on_the_same_root_finds_what_the_last_one_stored(fs: dict[str, Any]) -> None:
    keys, objects = [key(i) for i in range(4)], [chunk(seed=10 + i) for i in range(4)]
    first = build(fs)
    assert store(first, keys, objects).is_successful()
    first.close()
    second = build(fs)
    try:
        assert lookup(second, keys) == [True] * 4  # the layout names the size to look in
        targets = [chunk() for _ in keys]
        assert load(second, keys, targets) == [True] * 4
        assert all(same(a, b) for a, b in zip(objects, targets))
    finally:
        second.close()


def test_models_and_salts_never_share_a_chunk(fs: dict[str, Any]) -> None:
    adapter = build(fs)
    try:
        assert store(adapter, [key(1, model="a")], [chunk(seed=1)]).is_successful()
        assert lookup(adapter, [key(1, model="b"), key(1, model="a", salt="user2"), key(1, model="a")]) == [
            False,
            False,
            True,
        ]
    finally:
        adapter.close()


def test_a_model_updated_in_place_never_loads_the_old_weights_kv(fs: dict[str, Any], tmp_path: Path) -> None:
    """LMCache's keys carry the model's name, not its weights: the weights there decide."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"old")
    keys = [key(i, model=str(model)) for i in range(3)]
    first = build(fs)
    assert store(first, keys, [chunk(seed=i) for i in range(3)]).is_successful()
    first.close()
    same_weights = build(fs)
    try:
        assert lookup(same_weights, keys) == [True] * 3  # a restart alone keeps the cache
    finally:
        same_weights.close()
    weights.write_bytes(b"new weights, same name")  # updated in place, then the server restarts
    updated = build(fs)
    try:
        assert lookup(updated, keys) == [False] * 3
        targets = [chunk() for _ in keys]
        assert load(updated, keys, targets) == [False] * 3
        assert not any(t.raw_tensor.any() for t in targets)
    finally:
        updated.close()


def test_objects_of_several_sizes_in_one_task(fs: dict[str, Any]) -> None:
    adapter = build(fs, staging_mib=1)  # 16 slots of 64 KiB: a 40-chunk task goes through in turns
    try:
        keys = [key(i) for i in range(42)]
        objects = [chunk(seed=i) for i in range(40)] + [chunk(4096, seed=40), chunk(12288, seed=41)]
        assert store(adapter, keys, objects).is_successful()
        targets = [chunk(o.get_size()) for o in objects]
        assert load(adapter, keys, targets) == [True] * 42
        assert all(same(a, b) for a, b in zip(objects, targets))
    finally:
        adapter.close()


class Arena:
    """An L1 arena as LMCache's server describes it to its adapters (`L1MemoryDesc`), and objects
    allocated in it, 4096-aligned."""

    def __init__(self, nbytes: int) -> None:
        backing = torch.empty(nbytes + 4096, dtype=torch.uint8)
        start = -backing.data_ptr() % 4096
        self.memory = backing[start : start + nbytes]
        self.desc = L1MemoryDesc(ptr=self.memory.data_ptr(), size=nbytes, align_bytes=4096)
        self.used = 0

    def chunk(self, nbytes: int = CHUNK, seed: int | None = None) -> TensorMemoryObj:
        raw = self.memory[self.used : self.used + nbytes]
        self.used += -(-nbytes // 4096) * 4096
        return chunk(nbytes, seed, raw)


def in_place_sizes(adapter: KVTierL2Adapter) -> dict[int, bool]:
    return {size: t["in_place"] for size, t in adapter.report_status()["tiers_by_object_size"].items()}


def test_objects_in_lmcaches_arena_move_in_place(fs: dict[str, Any]) -> None:
    """Given LMCache's L1 arena, objects are stored from and loaded into their own bytes, byte-exact,
    and a load writes nothing beside its objects; sizes off the 4096 grid still go through staging."""
    arena = Arena(64 * CHUNK)
    adapter = KVTierL2Adapter({"tier": fs}, l1_memory_desc=arena.desc)
    try:
        keys = [key(i) for i in range(9)]
        objects = [arena.chunk(seed=i) for i in range(8)] + [arena.chunk(5000, seed=8)]
        assert store(adapter, keys, objects).is_successful()
        assert in_place_sizes(adapter) == {CHUNK: True, 5000: False}
        targets = [arena.chunk() for _ in range(8)] + [arena.chunk(5000)]
        marked = arena.memory[arena.used :]
        marked.fill_(0xA5)  # what follows the targets must stay as it is
        assert load(adapter, keys, targets) == [True] * 9
        assert all(same(a, b) for a, b in zip(objects, targets))
        assert bool((marked == 0xA5).all())
        status = adapter.report_status()["tiers_by_object_size"][CHUNK]
        assert status["stored_blocks"] == 8 and status["load_hits"] == 8
    finally:
        adapter.close()


def test_an_object_outside_the_arena_fails_and_nothing_wrong_is_loaded(
    fs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena(8 * CHUNK)
    adapter = KVTierL2Adapter({"tier": fs}, l1_memory_desc=arena.desc)
    try:
        inside, outside = arena.chunk(seed=1), chunk(seed=2)
        result = store(adapter, [key(1), key(2)], [inside, outside])
        assert not result.is_successful()
        assert "outside LMCache's L1 arena" in caplog.text
        assert lookup(adapter, [key(1), key(2)]) == [True, False]
        adapter.submit_unlock([key(1)])
        stray = chunk()
        assert load(adapter, [key(1)], [stray]) == [False]
        assert not stray.raw_tensor.any()
        target = arena.chunk()
        assert load(adapter, [key(1)], [target]) == [True] and same(inside, target)
    finally:
        adapter.close()


def test_more_objects_in_flight_than_the_tier_takes_wait_instead_of_failing(fs: dict[str, Any]) -> None:
    """Four tasks of 16 chunks at once against a tier that takes 4 blocks at a time (one I/O
    thread, a pending budget of 4): every chunk is stored, none dropped."""
    arena = Arena(128 * CHUNK)
    adapter = KVTierL2Adapter(
        {"tier": fs, "limits": {"io_threads": 1, "max_pending_stores": 4}}, l1_memory_desc=arena.desc
    )
    try:
        keys = [key(i) for i in range(64)]
        objects = [arena.chunk(seed=i) for i in range(64)]
        tasks = [adapter.submit_store_task(keys[i : i + 16], objects[i : i + 16]) for i in range(0, 64, 16)]
        results: dict[int, Any] = {}
        while len(results) < len(tasks):
            results.update(adapter.pop_completed_store_tasks())
            if len(results) < len(tasks):
                wait(adapter.get_store_event_fd())
        assert all(results[t].is_successful() for t in tasks)
        status = adapter.report_status()["tiers_by_object_size"][CHUNK]
        assert status["stores_dropped"] == 0 and status["stored_blocks"] == 64
        targets = [arena.chunk() for _ in range(64)]
        assert load(adapter, keys, targets) == [True] * 64
        assert all(same(a, b) for a, b in zip(objects, targets))
    finally:
        adapter.close()


def test_store_and_prefetch_controllers_call_at_once(fs: dict[str, Any]) -> None:
    """LMCache's store controller (stores) and prefetch controller (lookups, loads) run at once,
    each the only reader of its own event fds."""
    adapter = build(fs)
    ready = [key(i) for i in range(8)]
    ready_objects = [chunk(seed=i) for i in range(8)]
    assert store(adapter, ready, ready_objects).is_successful()
    errors: list[BaseException] = []

    def store_controller() -> None:
        try:
            for batch in range(1, 5):
                keys = [key(100 * batch + i) for i in range(8)]
                assert store(adapter, keys, [chunk(seed=100 * batch + i) for i in range(8)]).is_successful()
        except BaseException as exc:
            errors.append(exc)

    def prefetch_controller() -> None:
        try:
            for _ in range(4):
                assert lookup(adapter, ready) == [True] * 8
                targets = [chunk() for _ in ready]
                assert load(adapter, ready, targets) == [True] * 8
                assert all(same(a, b) for a, b in zip(ready_objects, targets))
                adapter.submit_unlock(ready)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=store_controller), threading.Thread(target=prefetch_controller)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert lookup(adapter, [key(100 * b + i) for b in range(1, 5) for i in range(8)]) == [True] * 32
    finally:
        adapter.close()


def test_delete_and_usage_reach_lmcaches_accounting(fs: dict[str, Any]) -> None:
    adapter = build(fs)
    try:
        keys = [key(i) for i in range(3)]
        assert store(adapter, keys, [chunk(seed=i) for i in range(3)]).is_successful()
        assert adapter.get_usage().total_bytes_used == 3 * CHUNK
        adapter.delete(keys[:2])
        assert adapter.get_usage().total_bytes_used == CHUNK
        assert lookup(adapter, keys) == [False, False, True]
        status = adapter.report_status()
        assert status["is_healthy"] and status["tier"] == "fs"
        assert status["tiers_by_object_size"][CHUNK]["stored_blocks"] == 3
    finally:
        adapter.close()


def test_close_leaves_no_thread_and_closes_the_event_fds(fs: dict[str, Any]) -> None:
    before = set(threading.enumerate())
    adapter = build(fs)
    assert store(adapter, [key(1)], [chunk(seed=1)]).is_successful()
    fd = adapter.get_store_event_fd()
    adapter.close()
    adapter.close()  # idempotent
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:  # worker threads leave once their queue is empty: wait for that
        thread.join(timeout=30)
    assert not [t.name for t in started if t.is_alive()]
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(Exception, match="closed"):
        adapter.submit_store_task([key(2)], [chunk()])


def test_a_root_others_may_write_fails_each_store_with_the_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Misconfiguration: an fs root of mode 0777. The adapter opens a tier per object size, on the
    # first store of that size (LMCache names no size when it builds the adapter): that store
    # fails, logging the tier's ConfigError, and so does each later one; nothing is stored there.
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    adapter = build({"type": "fs", "root": str(root)})
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier_async.integrations.lmcache"):
            for seed in range(2):
                assert not store(adapter, [key(seed)], [chunk(seed=seed)]).is_successful()
        assert caplog.text.count("written by group or others") == 2
        assert os.listdir(root) == []
    finally:
        adapter.close()


def test_bad_configuration_is_refused_when_lmcache_builds_the_adapter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='"tier"'):
        KVTierL2Adapter({})
    with pytest.raises(Exception, match="nvme"):
        build({"type": "nvme"})
    with pytest.raises(ConfigError, match="staging_mib"):
        build({"type": "fs", "root": str(tmp_path)}, staging_mib=0)


def _shared_tier(kind: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """A tier config that two adapters in one process reach as two servers of a fleet would."""
    if kind == "redis":
        return {"type": "redis", "url": request.getfixturevalue("redis_server").url, "prefix": "lmcache-test"}
    master = request.getfixturevalue("mooncake_master")
    return {"type": "mooncake", "master": master.address, "segment_bytes": 64 << 20, "prefix": "lmcache-test"}


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_fleet_shares_chunks_through_a_shared_tier(kind: str, request: pytest.FixtureRequest) -> None:
    tier = _shared_tier(kind, request)
    a, b = build(tier), build(tier)
    try:
        keys, objects = (
            [key(i, model=f"fleet-{kind}") for i in range(5)],
            [chunk(seed=50 + i) for i in range(5)],
        )
        assert store(a, keys, objects).is_successful()
        assert lookup(b, keys) == [True] * 5
        targets = [chunk() for _ in keys]
        assert load(b, keys, targets) == [True] * 5
        assert all(same(x, y) for x, y in zip(objects, targets))
    finally:
        a.close()
        b.close()


def test_two_servers_on_one_host_share_a_root(fs: dict[str, Any]) -> None:
    shared = {**fs, "refresh_interval_s": 0}  # the reader looks at the writer's new chunks on every miss
    writer, reader = build(shared), build(shared)
    try:
        keys, objects = [key(i, model="shared") for i in range(4)], [chunk(seed=70 + i) for i in range(4)]
        assert lookup(reader, keys) == [False] * 4
        assert store(writer, keys, objects).is_successful()
        assert lookup(reader, keys) == [True] * 4
        targets = [chunk() for _ in keys]
        assert load(reader, keys, targets) == [True] * 4
        assert all(same(a, b) for a, b in zip(objects, targets))
    finally:
        writer.close()
        reader.close()


def test_a_locked_chunk_is_not_evicted_until_unlocked(tmp_path: Path) -> None:
    from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

    capacity = 8 * (record_bytes_for(CHUNK) + 4 * ENTRY)  # 8 chunks, all processes together
    adapter = build({"type": "fs", "root": str(tmp_path / "kv"), "capacity_bytes": capacity})
    try:
        locked = chunk(seed=7)
        assert store(adapter, [key(0)], [locked]).is_successful()
        assert lookup(adapter, [key(0)]) == [True]  # locked now
        for start in range(1, 41, 4):  # the tier filled five times over meanwhile
            keys = [key(i) for i in range(start, start + 4)]
            assert store(adapter, keys, [chunk(seed=i) for i in range(4)]).is_successful()
        assert lookup(adapter, [key(1)]) == [False]  # others were evicted
        target = chunk()
        assert load(adapter, [key(0)], [target]) == [True] and same(locked, target)
        adapter.submit_unlock([key(0), key(0)])  # the lookups' two locks
        for start in range(41, 81, 4):
            store(adapter, [key(i) for i in range(start, start + 4)], [chunk(seed=i) for i in range(4)])
        assert lookup(adapter, [key(0)]) == [False]  # unlocked: evicted like any other
    finally:
        adapter.close()


def test_a_declared_capacity_reaches_lmcache_and_the_tiers_evictions_leave_its_usage(tmp_path: Path) -> None:
    """With `capacity_bytes` the adapter reports it (LMCache's usage fraction and its eviction
    controllers then act on us), and what the tier evicts by itself leaves LMCache's usage."""
    from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

    capacity = 8 * (record_bytes_for(CHUNK) + 4 * ENTRY)
    adapter = build({"type": "fs", "root": str(tmp_path / "kv"), "capacity_bytes": capacity})
    try:
        assert adapter.get_usage().total_capacity_bytes == capacity
        assert adapter.get_usage().usage_fraction == 0.0
        for start in range(0, 40, 4):  # five times what the tier holds
            keys = [key(i) for i in range(start, start + 4)]
            assert store(adapter, keys, [chunk(seed=i) for i in range(4)]).is_successful()
        held = [key(i) for i in range(40) if lookup(adapter, [key(i)]) == [True]]
        adapter.submit_unlock(held)  # the lookups' locks
        usage = adapter.get_usage()
        assert usage.total_bytes_used == len(held) * CHUNK  # evicted chunks no longer counted
        assert 0 < len(held) < 40 and 0.0 < usage.usage_fraction <= 1.0
    finally:
        adapter.close()
    undeclared = build({"type": "fs", "root": str(tmp_path / "other")})
    try:
        assert undeclared.get_usage().total_capacity_bytes == 0  # as LMCache's fs adapter: none
    finally:
        undeclared.close()


def test_a_tier_secret_reaches_the_tier_through_lmcaches_config(
    fs: dict[str, Any], tier_secret_env: str
) -> None:
    """The secret keys sit in the tier config of LMCache's adapter params: chunks sealed,
    byte-exact; an adapter without the secret finds none of them."""
    sealed = {**fs, "secret_env": tier_secret_env}
    adapter = build(sealed)
    keys = [key(i) for i in range(3)]
    objects = [chunk(seed=i) for i in range(3)]
    try:
        assert store(adapter, keys, objects).is_successful()
    finally:
        adapter.close()
    again, plain = build(sealed), build(fs)
    try:
        targets = [chunk() for _ in keys]
        assert load(again, keys, targets) == [True] * 3
        assert all(same(a, b) for a, b in zip(objects, targets))
        assert lookup(plain, keys) == [False] * 3
    finally:
        again.close()
        plain.close()
