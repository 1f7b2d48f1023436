"""`KVTierSecondaryTier` inside vLLM 0.33's real tiering manager, over real fs, Redis and S3 tiers.

Each scenario also runs with vLLM's own tiers in the same place (its example tier, and its fs
tier where persistence is the point), as a control: a harness bug cannot pass as ours.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs vLLM and never skips these
    pytest.importorskip("vllm.v1.kv_offload.tiering.base")

import servers
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_engine import ADAPTER, Engine, chunk_keys, make_manager, offloading_config, random_rows, row_bytes

import kvtier_async as kt
from kvtier_async.integrations import vllm as vllm_adapter
from kvtier_async.integrations.vllm import METRICS, KVTierSecondaryTier

HIT, HIT_PENDING, RETRY, MISS = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
    LookupResult.MISS,
)
S3_BUCKET, S3_CREDENTIALS = servers.S3_BUCKET, servers.S3_CREDENTIALS


def ours(tier: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**ADAPTER, "tier": tier}]


def tier_configs(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> list[dict[str, Any]]:
    """An engine's secondary tiers, the same for every engine of a test (one root, one prefix)."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    if name == "fs":
        return ours({"type": "fs", "root": str(tmp_path / "kv")})
    if name == "fs-sealed":  # a tier secret reaches the tier through vLLM's config as it is
        secret = request.getfixturevalue("tier_secret_env")
        return ours({"type": "fs", "root": str(tmp_path / "kv"), "secret_env": secret})
    if name == "redis":
        url = request.getfixturevalue("redis_server").url
        return ours({"type": "redis", "url": url, "prefix": prefix})
    if name == "redis-sealed":
        url, secret = request.getfixturevalue("redis_server").url, request.getfixturevalue("tier_secret_env")
        return ours({"type": "redis", "url": url, "prefix": prefix, "secret_env": secret})
    if name == "s3":
        endpoint = request.getfixturevalue("s3_server").endpoint
        tier = {"type": "s3", "bucket": S3_BUCKET, "prefix": prefix, "endpoint": endpoint, "allow_http": True}
        return ours({**tier, **S3_CREDENTIALS})
    if name == "vllm-fs":
        return [{"type": "fs", "root_dir": str(tmp_path / "vllm-fs")}]  # control: vLLM's own
    assert name == "vllm-example"
    return [{"type": "example"}]  # control: vLLM's own, in memory, this engine only


@pytest.fixture(params=["fs", "fs-sealed", "redis", "redis-sealed", "s3", "vllm-fs"])
def persistent(request: pytest.FixtureRequest, tmp_path: Path) -> list[dict[str, Any]]:
    return tier_configs(request.param, request, tmp_path)


@pytest.fixture(params=["fs", "redis", "s3", "vllm-fs", "vllm-example"])
def any_tier(request: pytest.FixtureRequest, tmp_path: Path) -> list[dict[str, Any]]:
    return tier_configs(request.param, request, tmp_path)


def test_store_reset_then_promotion_is_byte_exact(any_tier: list[dict[str, Any]]) -> None:
    engine = Engine(make_manager(any_tier))
    keys = chunk_keys(1, 8)
    payloads = random_rows(keys, engine.row_bytes, seed=1)
    engine.offload(payloads)
    engine.reset_cache()  # the primary tier is empty now

    ctx = engine.new_request()
    seen = engine.lookup_until_settled(ctx, keys)
    first_found = next(p for p in seen if p != [RETRY] * 8)
    assert first_found == [HIT_PENDING] * 8  # found in the secondary tier, promotion started
    if any_tier[0]["type"] == ADAPTER["type"]:
        assert seen[0] == first_found  # ours remembers what it stored: no RETRY round first
    assert seen[-1] == [HIT] * 8
    assert engine.load(ctx, keys) == payloads  # every byte of every row, padding included
    engine.finish(ctx)
    engine.step_end()
    assert engine.shutdown() == []  # no "Keeping ... mapped: buffers are still exported"
    assert engine.manager.primary_tier._mmap_region.mmap_obj is None  # unmapped


def test_a_new_engine_finds_what_the_last_one_stored(persistent: list[dict[str, Any]]) -> None:
    first = Engine(make_manager(persistent))
    keys = chunk_keys(2, 6)
    payloads = random_rows(keys, first.row_bytes, seed=2)
    first.offload(payloads)
    assert first.shutdown() == []

    second = Engine(make_manager(persistent))
    ctx = second.new_request()
    seen = second.lookup_until_settled(ctx, [*keys, *chunk_keys(3, 1)])
    assert seen[0] == [RETRY] * 7  # unknown to this process: the tier is asked, in one batch
    assert seen[-1] == [HIT] * 6 + [MISS]
    assert second.load(ctx, keys) == payloads
    second.finish(ctx)
    assert second.shutdown() == []


@pytest.mark.parametrize("backend", ["fs", "redis"])
def test_hundreds_of_store_and_reset_cycles_never_trip_the_drain_check(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # reset_cache() drains the tiers and then asserts that no job is left (manager.py:1164-1169):
    # every result must be queued before drain_jobs returns, never a moment after.
    if backend == "fs":
        tier: dict[str, Any] = {"type": "fs", "root": str(tmp_path)}
    else:
        tier = {
            "type": "redis",
            "url": request.getfixturevalue("redis_server").url,
            "prefix": uuid.uuid4().hex,
        }
    engine = Engine(make_manager(ours(tier), chunk_bytes=8192))
    for cycle in range(300):
        ctx = engine.new_request()
        engine.store(ctx, random_rows(chunk_keys(1000 + cycle, 2), engine.row_bytes, seed=cycle))
        engine.finish(ctx)
        engine.reset_cache()  # with the cascade jobs just submitted, still in flight
    (adapter,) = engine.manager.secondary_tiers
    assert adapter._tier.stats()["stored_blocks"] == 600
    assert engine.shutdown() == []


def test_kv_events_report_what_the_tier_stored_and_evicted() -> None:
    # A memory tier of 4 chunks: storing 8 evicts the first 4.
    engine = Engine(make_manager(ours({"type": "memory", "capacity_bytes": 4 * row_bytes()})))
    keys = chunk_keys(4, 8)
    ctx = engine.new_request()
    for key, payload in random_rows(keys, engine.row_bytes, seed=4).items():
        engine.store(ctx, {key: payload})
        engine.settle()
    engine.step_end()
    ours_events = [e for e in engine.events if e.ownership == "kvtier:memory"]
    stored = [k for e in ours_events if not e.removed for k in e.keys]
    removed = [k for e in ours_events if e.removed for k in e.keys]
    assert stored == keys and removed == keys[:4]
    assert all(e.medium is Medium.CPU and e.locality is Locality.LOCAL for e in ours_events)
    assert all(e.removal_expected for e in ours_events if not e.removed)
    engine.finish(ctx)
    assert engine.shutdown() == []


def test_a_partial_promotion_names_the_keys_that_arrived(tmp_path: Path) -> None:
    engine = Engine(make_manager(ours({"type": "fs", "root": str(tmp_path)})))
    keys = chunk_keys(5, 3)
    ctx = engine.new_request()
    engine.store(ctx, random_rows(keys, engine.row_bytes, seed=5))
    engine.settle()
    engine.step_end()  # the manager collects the store's result
    (adapter,) = engine.manager.secondary_tiers
    absent = chunk_keys(6, 1)[0]
    job = TransferJob(
        job_id=10_000,
        keys=[keys[0], absent, keys[2]],
        chunk_ids=np.array([20, 21, 22], dtype=np.int32),
        is_promotion=True,
        req_context=ReqContext(req_id="direct"),
    )
    adapter.submit_load(job)
    adapter.drain_jobs()
    (result,) = adapter.get_finished_jobs()
    assert (result.job_id, result.success) == (10_000, False)
    assert list(result.successful_keys) == [keys[0], keys[2]]
    assert result.transfer_bytes == 2 * engine.row_bytes and result.transfer_time is not None
    engine.finish(ctx)
    assert engine.shutdown() == []


def test_bad_jobs_are_refused_before_anything_starts(tmp_path: Path) -> None:
    engine = Engine(make_manager(ours({"type": "fs", "root": str(tmp_path)})))
    (adapter,) = engine.manager.secondary_tiers
    ctx = ReqContext(req_id="direct")
    keys = chunk_keys(7, 2)
    with pytest.raises(kt.InvalidArgumentError, match="2 keys but 1"):
        adapter.submit_store(TransferJob(1, keys, np.array([0], dtype=np.int32), False, ctx))
    with pytest.raises(kt.InvalidArgumentError, match="chunk_ids"):
        adapter.submit_store(TransferJob(2, keys, np.array([0, engine.rows], dtype=np.int32), False, ctx))
    assert not adapter.has_pending_work() and list(adapter.get_finished_jobs()) == []
    assert engine.shutdown() == []


def test_two_engines_on_one_root_find_each_others_chunks_while_both_run(tmp_path: Path) -> None:
    # Data-parallel engines of one model share a root: what one stores, the other promotes.
    tiers = ours({"type": "fs", "root": str(tmp_path), "refresh_interval_s": 0})
    first, second = Engine(make_manager(tiers)), Engine(make_manager(tiers))
    keys = chunk_keys(4, 5)
    payloads = random_rows(keys, first.row_bytes, seed=4)
    first.offload(payloads)
    ctx = second.new_request()
    assert second.lookup_until_settled(ctx, keys)[-1] == [HIT] * 5
    assert second.load(ctx, keys) == payloads
    second.finish(ctx)
    assert second.shutdown() == [] and first.shutdown() == []


def test_placement_and_backpressure_follow_the_wrapped_tier(
    tmp_path: Path, redis_server: servers.RedisServer
) -> None:
    bp = {"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}
    manager = make_manager(
        [
            {**ADAPTER, "tier": {"type": "fs", "root": str(tmp_path)}, **bp},
            {**ADAPTER, "tier": {"type": "redis", "url": redis_server.url, "prefix": uuid.uuid4().hex}},
            {**ADAPTER, "tier": {"type": "fs", "root": str(tmp_path / "nfs")}, "locality": "REMOTE"},
        ]
    )
    fs, redis, nfs = manager.secondary_tiers
    assert (fs.medium, fs.locality, fs.cache_hit_source) == (
        Medium.STORAGE,
        Locality.LOCAL,
        CacheHitSource.DISK,
    )
    assert (redis.medium, redis.locality) == (Medium.CPU, Locality.REMOTE)
    assert nfs.locality is Locality.REMOTE
    assert isinstance(fs.bp_detector, EMABackpressureDetector) and redis.bp_detector is None
    engine = Engine(manager)
    for n in range(12):  # past the detector's warm-up: its EMA is fed our transfer times and bytes
        engine.offload(random_rows(chunk_keys(100 + n, 1), engine.row_bytes, seed=n))
    assert fs.bp_detector.store_latency_ema > 0
    assert engine.shutdown() == []


def test_metrics_register_at_engine_start_and_carry_our_counters(tmp_path: Path) -> None:
    tiers = ours({"type": "fs", "root": str(tmp_path)})
    config = offloading_config(tiers)
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=config.extra_config)
    )
    # What the engine's stat logger does at start-up: the spec class names every metric and label.
    prom = OffloadPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]
    engine = Engine(OffloadingSpecFactory.create_spec(config).get_manager())
    engine.offload(random_rows(chunk_keys(8, 4), engine.row_bytes, seed=8))
    with engine.manager.lock:
        stats = engine.manager.get_stats()
        stats.set_info(engine.manager.config_info())
    prom.observe(stats.data)
    labels = {"model_name": "m", "engine": "0", "tier": "1:KVTierSecondaryTier"}
    assert registry.get_sample_value(METRICS["stored_bytes"] + "_total", labels) == 4 * engine.row_bytes
    assert registry.get_sample_value(METRICS["blocks"], labels) == 4
    info = {k: v for k, v in labels.items() if k != "tier"}
    found = [s for m in registry.collect() for s in m.samples if s.name == "vllm:kv_offload_config_info"]
    assert any(s.labels.get("kvtier_tier") == "kvtier:fs" and s.labels.items() >= info.items() for s in found)
    with engine.manager.lock:
        again = engine.manager.get_stats()
    assert METRICS["stored_bytes"] not in again.data["data"]  # increments, reported once
    assert engine.shutdown() == []


def test_namespaces_keep_models_and_layouts_apart() -> None:
    def namespace(**kwargs: Any) -> str:
        spec = OffloadingSpecFactory.create_spec(offloading_config(ours({"type": "memory"}), **kwargs))
        view = memoryview(np.zeros((spec.num_chunks, spec.kv_bytes_per_chunk), dtype=np.int8))
        return kt.OffloadingSpec.from_vllm(spec, view).namespace

    base = namespace()
    assert base.startswith("meta-llama/Llama-3.1-8B-Instruct|vllm-kv-")
    assert namespace() == base  # the same engine again (a restart, another DP replica)
    others = {namespace(model="Qwen/Qwen3-8B"), namespace(dtype="fp8"), namespace(tp_size=2)}
    assert base not in others and len(others) == 3


def test_new_weights_under_the_same_model_name_get_another_namespace(tmp_path: Path) -> None:
    """vLLM hands the tier the model's path, not its revision: the weights there decide."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"old")

    def namespace() -> str:
        spec = OffloadingSpecFactory.create_spec(
            offloading_config(ours({"type": "memory"}), model=str(model))
        )
        view = memoryview(np.zeros((spec.num_chunks, spec.kv_bytes_per_chunk), dtype=np.int8))
        return kt.OffloadingSpec.from_vllm(spec, view).namespace

    before = namespace()
    assert namespace() == before
    weights.write_bytes(b"new weights")  # updated in place
    assert namespace() != before


def test_from_vllm_reads_the_geometry_from_the_view_and_refuses_other_specs() -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config(ours({"type": "memory"}), chunks=8))
    view = memoryview(np.zeros((spec.num_chunks, spec.kv_bytes_per_chunk), dtype=np.int8))
    ours_spec = kt.OffloadingSpec.from_vllm(spec, view, io_threads=3)
    assert (ours_spec.num_cpu_blocks, ours_spec.block_nbytes) == (8, 15 * 4096)  # whole rows, padded
    assert ours_spec.block_stride == view.strides[0] and ours_spec.limits.io_threads == 3
    assert ours_spec.vllm_config is spec
    with pytest.raises(kt.ConfigError, match=r"vLLM 0\.33's OffloadingSpec"):
        kt.OffloadingSpec.from_vllm(SimpleNamespace(tokens_per_block=(16,), blocks_per_chunk=1), view)
    with pytest.raises(kt.ConfigError, match="2-D bytes"):
        kt.OffloadingSpec.from_vllm(spec, memoryview(bytearray(4096)))
    with pytest.raises(kt.ConfigError, match="unknown limits"):
        kt.OffloadingSpec.from_vllm(spec, view, io_thread=3)


def test_the_adapter_is_a_vllm_tier_and_needs_a_nested_tier(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    assert issubclass(KVTierSecondaryTier, SecondaryTierManager)
    with pytest.raises(kt.ConfigError, match="nested kvtier tier config"):
        make_manager([dict(ADAPTER)])
    with pytest.raises(kt.ConfigError, match="locality"):
        make_manager([{**ADAPTER, "tier": {"type": "memory"}, "locality": "MARS"}])


def test_a_root_others_may_write_stops_the_engine_at_start_up_with_the_message(tmp_path: Path) -> None:
    # Misconfiguration: an fs root of mode 0777. vLLM must not start "with" a tier that never
    # stores a byte: building the manager raises the tier's ConfigError.
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    with pytest.raises(kt.ConfigError, match="written by group or others"):
        make_manager(ours({"type": "fs", "root": str(root)}))


def test_a_redis_server_down_at_start_up_starts_the_engine_with_the_tier_degraded(tmp_path: Path) -> None:
    # A fault that may pass: the server is down while vLLM starts. The engine starts; the tier's
    # opening is counted, and its calls retry it (as a bare tier's or a cache's start-up does).
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = servers.RedisServer(tmp_path / "redis")  # not started
    engine = Engine(make_manager(ours({"type": "redis", "url": server.url, "timeout_s": 0.5})))
    (adapter,) = engine.manager.secondary_tiers
    assert adapter._tier.stats()["errors"] == 1
    assert not adapter._tier.closed
    assert engine.shutdown() == []


def documented_transfer_configs(page: str) -> dict[str, dict[str, Any]]:
    """The `--kv-transfer-config` JSON of each `vllm serve` command on a page, by tier type."""
    text = (Path(__file__).resolve().parent.parent / page).read_text()
    configs = [json.loads(found) for found in re.findall(r"--kv-transfer-config '(\{.*\})'", text)]
    return {c["kv_connector_extra_config"]["secondary_tiers"][0]["tier"]["type"]: c for c in configs}


@pytest.mark.parametrize(
    ("page", "kind"),
    [("docs/vllm.md", "fs"), ("docs/vllm.md", "s3"), ("docs/vllm.md", "redis"), ("README.md", "fs")],
)
def test_the_documented_configs_run_through_vllm(
    page: str, kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(**documented_transfer_configs(page)[kind])  # vLLM's own validation
    assert config.kv_connector == "OffloadingConnector"
    extra = config.kv_connector_extra_config
    (entry,) = extra["secondary_tiers"]
    tier = dict(entry["tier"])
    # Only where the servers are changes: this machine's directory, Redis and S3 server.
    if kind == "fs":
        tier["root"] = str(tmp_path)
    elif kind == "s3":
        endpoint = request.getfixturevalue("s3_server").endpoint
        tier.update(endpoint=endpoint, bucket=S3_BUCKET, **S3_CREDENTIALS)
    else:
        tier["url"] = request.getfixturevalue("redis_server").url
    if kind != "fs":
        tier["prefix"] += uuid.uuid4().hex  # every test its own names on the shared server
    assert extra["spec_name"] == "TieringOffloadingSpec"
    engine = Engine(make_manager([{**entry, "tier": tier}], chunks=16))  # 16 rows, not the documented 64 GiB
    keys = chunk_keys(9, 4)
    payloads = random_rows(keys, engine.row_bytes, seed=9)
    engine.offload(payloads)
    engine.reset_cache()
    ctx = engine.new_request()
    assert engine.lookup_until_settled(ctx, keys)[-1] == [HIT] * 4
    assert engine.load(ctx, keys) == payloads
    engine.finish(ctx)
    assert engine.shutdown() == []


def on_loop(adapter: KVTierSecondaryTier, work: Any) -> Any:
    """Run a coroutine on the adapter's loop, where its tier lives, and wait for it."""
    return asyncio.run_coroutine_threadsafe(work, adapter._bridge.loop).result()


async def close_gate(gate: asyncio.Event) -> None:
    gate.clear()


async def open_gate(gate: asyncio.Event) -> None:
    gate.set()


def gated_engine() -> tuple[Engine, KVTierSecondaryTier, Any]:
    import probe_tier  # noqa: F401  loaded by module_path, as a user's tier is

    engine = Engine(make_manager(ours({"type": "ProbeTier", "module_path": "probe_tier"})))
    (adapter,) = engine.manager.secondary_tiers
    return engine, adapter, adapter._tier


def test_a_chunk_being_stored_is_retry_until_its_store_lands() -> None:
    engine, adapter, probe = gated_engine()
    on_loop(adapter, close_gate(probe.gates["write"]))
    key = chunk_keys(10, 1)[0]
    ctx = engine.new_request()
    engine.store(ctx, random_rows([key], engine.row_bytes, seed=10))
    on_loop(adapter, probe.until(lambda: probe.held["write"] == 1))
    other = engine.new_request()
    with engine.manager.lock:
        assert adapter.lookup(key, other) is RETRY  # neither hit nor miss while it is written
        assert adapter.has_pending_work()
    on_loop(adapter, open_gate(probe.gates["write"]))
    engine.settle()
    with engine.manager.lock:
        assert adapter.lookup(key, other) is HIT
    engine.finish(ctx)
    engine.finish(other)
    assert engine.shutdown() == []


def test_shutdown_with_a_store_stuck_cancels_it_and_still_unmaps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_adapter, "SHUTDOWN_GRACE_S", 0.0)  # do not wait for the stuck store
    engine, adapter, probe = gated_engine()
    on_loop(adapter, close_gate(probe.gates["write"]))
    ctx = engine.new_request()
    engine.store(ctx, random_rows(chunk_keys(11, 2), engine.row_bytes, seed=11))
    on_loop(adapter, probe.until(lambda: probe.held["write"] == 1))
    assert engine.shutdown() == []
    assert [r.success for r in adapter.get_finished_jobs()] == [False]  # reported, as a failure
    assert not adapter._bridge.running
    with pytest.raises(kt.ClosedError):
        adapter.lookup(chunk_keys(11, 1)[0], ctx)
    adapter.shutdown()  # twice is harmless


def test_a_mooncake_tier_through_vllm_is_byte_exact(mooncake_master: servers.MooncakeMaster) -> None:
    tier = {"type": "mooncake", "master": mooncake_master.address, "segment_bytes": 64 << 20}
    engine = Engine(make_manager(ours({**tier, "prefix": f"test-{uuid.uuid4().hex[:12]}"})))
    keys = chunk_keys(12, 8)
    payloads = random_rows(keys, engine.row_bytes, seed=12)
    engine.offload(payloads)
    engine.reset_cache()  # the primary tier is empty now: the blocks come from the pool
    ctx = engine.new_request()
    assert engine.lookup_until_settled(ctx, keys)[-1] == [HIT] * 8
    assert engine.load(ctx, keys) == payloads
    engine.finish(ctx)
    assert engine.shutdown() == []
