"""The vLLM adapter driven exactly as vLLM's tiering manager drives a secondary tier, without vLLM.

Jobs are plain objects with `job_id`, `keys` and `block_ids`; the primary tier is a memoryview;
results are collected with `get_finished*`. Waiting is `drain_jobs()` (or a probe's gate), never time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import probe_tier  # noqa: F401  the gated tier, loaded by module_path
import pytest

import kvtier_async as kt
from kvtier_async.integrations.vllm import JobResult, KVTierSecondaryTier, LookupResult
from kvtier_async.testing import make_key

BLOCK = 4096
SLOTS = 64


@dataclass
class Job:
    job_id: int
    keys: list[bytes]
    block_ids: list[int]


def vllm_spec(**extra: Any) -> SimpleNamespace:
    """A stand-in for vLLM's OffloadingSpec: what the adapter reads of it, duck-typed."""
    model_config = SimpleNamespace(model="meta-llama/Llama-3.1-8B-Instruct")
    return SimpleNamespace(
        extra_config={"block_nbytes": BLOCK, "num_cpu_blocks": SLOTS, **extra},
        offloaded_block_size=16,
        vllm_config=SimpleNamespace(model_config=model_config),
    )


@pytest.fixture
def primary() -> memoryview:
    view = memoryview(bytearray(SLOTS * BLOCK))
    for slot in range(SLOTS):
        view[slot * BLOCK : (slot + 1) * BLOCK] = bytes([slot % 251]) * BLOCK
    return view


def make(primary: memoryview, tier: dict[str, Any], **kwargs: Any) -> KVTierSecondaryTier:
    return KVTierSecondaryTier(vllm_spec(), primary, "kvtier", tier=tier, **kwargs)


@pytest.fixture
def fs_adapter(primary: memoryview, tmp_path: Path) -> Iterator[KVTierSecondaryTier]:
    adapter = make(primary, {"type": "fs", "root": str(tmp_path)}, lookup_result="bool")
    yield adapter
    adapter.shutdown()


def finished(adapter: KVTierSecondaryTier) -> dict[int, bool]:
    adapter.drain_jobs()
    return {r.job_id: r.success for r in adapter.get_finished()}


def test_store_then_lookup_hits(fs_adapter: KVTierSecondaryTier) -> None:
    keys = [make_key(i) for i in range(4)]
    fs_adapter.submit_store(Job(1, keys, [0, 1, 2, 3]))
    assert finished(fs_adapter) == {1: True}
    assert [fs_adapter.lookup(k, None) for k in keys] == [True] * 4
    assert fs_adapter.get_finished() == []  # each result is given once


def test_promotion_load_is_byte_exact(fs_adapter: KVTierSecondaryTier, primary: memoryview) -> None:
    keys = [make_key(i) for i in range(4)]
    expected = [bytes(primary[s * BLOCK : (s + 1) * BLOCK]) for s in (5, 6, 7, 8)]
    fs_adapter.submit_store(Job(1, keys, [5, 6, 7, 8]))
    assert finished(fs_adapter) == {1: True}
    fs_adapter.submit_load(Job(2, keys, [40, 41, 42, 43]))
    assert finished(fs_adapter) == {2: True}
    assert [bytes(primary[s * BLOCK : (s + 1) * BLOCK]) for s in (40, 41, 42, 43)] == expected


def test_a_partial_load_reports_failure(fs_adapter: KVTierSecondaryTier) -> None:
    fs_adapter.submit_store(Job(1, [make_key(0)], [0]))
    fs_adapter.submit_load(Job(2, [make_key(0), make_key(99)], [10, 11]))
    assert finished(fs_adapter) == {1: True, 2: False}


def test_unknown_keys_are_in_flight_then_answered_from_the_tier(primary: memoryview, tmp_path: Path) -> None:
    writer = make(primary, {"type": "fs", "root": str(tmp_path / "a")}, lookup_result="bool")
    try:
        writer.submit_store(Job(1, [make_key(7)], [7]))
        assert finished(writer) == {1: True}
    finally:
        writer.shutdown()  # another process, in effect: the reader has no record of its stores
    reader = make(primary, {"type": "fs", "root": str(tmp_path / "a")}, lookup_result="enum")
    try:
        assert reader.lookup(make_key(7)) is LookupResult.RETRY  # the tier is being asked
        assert reader.lookup(make_key(8)) is LookupResult.RETRY
        reader.drain_jobs()
        assert reader.lookup(make_key(7)) is LookupResult.HIT
        assert reader.lookup(make_key(8)) is LookupResult.MISS
        assert reader.lookup(make_key(7)) is LookupResult.HIT  # remembered now
    finally:
        reader.shutdown()


def gated(primary: memoryview) -> tuple[KVTierSecondaryTier, Any]:
    adapter = make(primary, {"type": "ProbeTier", "module_path": "probe_tier"}, lookup_result="bool")
    probe = adapter._tier  # the test reaches in only to open and close the probe's gates
    return adapter, probe


def set_gate(adapter: KVTierSecondaryTier, gate: Any, is_open: bool) -> None:
    done = threading.Event()

    def flip() -> None:
        gate.set() if is_open else gate.clear()
        done.set()

    adapter._loop.call_soon_threadsafe(flip)
    done.wait()


def test_lookup_is_in_flight_while_its_store_is_pending(primary: memoryview) -> None:
    adapter, probe = gated(primary)
    try:
        set_gate(adapter, probe.gates["write"], False)
        adapter.submit_store(Job(1, [make_key(3)], [3]))
        assert adapter.lookup(make_key(3)) is None  # neither hit nor miss: it is being stored
        assert adapter.get_finished() == []
        set_gate(adapter, probe.gates["write"], True)
        assert finished(adapter) == {1: True}
        assert adapter.lookup(make_key(3)) is True
    finally:
        adapter.shutdown()


def test_many_jobs_in_flight(primary: memoryview, tmp_path: Path) -> None:
    spec = vllm_spec(max_pending_stores=1000)  # queue them all: vLLM's jobs, not best-effort cache stores
    adapter = KVTierSecondaryTier(spec, primary, "kvtier", tier={"type": "fs", "root": str(tmp_path)})
    try:
        source = {make_key(j): j % 32 for j in range(200)}  # stores read slots 0..31
        for j in range(100):
            keys = [make_key(j), make_key(100 + j)]
            adapter.submit_store(Job(j, keys, [source[k] for k in keys]))
        for j in range(100, 200):  # loads write slots 32..63, some before their store has landed
            adapter.submit_load(Job(j, [make_key(j - 100)], [32 + j % 32]))
        results = finished(adapter)
        assert set(results) == set(range(200))
        assert all(results[j] for j in range(100))  # every store landed
        adapter.submit_load(Job(500, [make_key(j) for j in range(32)], list(range(32, 64))))
        assert finished(adapter) == {500: True}
        for j in range(32):  # byte-exact
            assert primary[(32 + j) * BLOCK : (33 + j) * BLOCK] == bytes([source[make_key(j)] % 251]) * BLOCK
    finally:
        adapter.shutdown()


def test_a_job_id_in_flight_twice_is_refused(primary: memoryview) -> None:
    adapter, probe = gated(primary)
    try:
        set_gate(adapter, probe.gates["write"], False)
        adapter.submit_store(Job(1, [make_key(0)], [0]))
        with pytest.raises(ValueError, match="already in flight"):
            adapter.submit_store(Job(1, [make_key(1)], [1]))
        with pytest.raises(ValueError, match="2 keys but 1 block ids"):
            adapter.submit_load(Job(2, [make_key(0), make_key(1)], [0]))
        set_gate(adapter, probe.gates["write"], True)
    finally:
        adapter.shutdown()


def test_shutdown_with_jobs_pending_fails_them_and_stops_the_thread(primary: memoryview) -> None:
    adapter, probe = gated(primary)
    set_gate(adapter, probe.gates["write"], False)
    for j in range(5):
        adapter.submit_store(Job(j, [make_key(j)], [j]))
    adapter.shutdown()
    results = {r.job_id: r.success for r in adapter.get_finished()}
    assert results == {j: False for j in range(5)}
    assert not adapter._thread.is_alive()
    with pytest.raises(kt.ClosedError):
        adapter.submit_store(Job(9, [make_key(9)], [9]))
    with pytest.raises(kt.ClosedError):
        adapter.lookup(make_key(0))
    adapter.shutdown()  # twice is harmless


def test_spec_from_a_vllm_spec() -> None:
    original = vllm_spec(secondary_tiers=[{"type": "memory"}], max_inflight_loads=3)
    spec = kt.OffloadingSpec.from_vllm(original)
    assert (spec.block_nbytes, spec.num_cpu_blocks, spec.block_size) == (BLOCK, SLOTS, 16)
    assert spec.namespace == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.vllm_config is original
    assert spec.limits.max_inflight_loads == 3 and spec.secondary_tiers[0]["type"] == "memory"
    by_bytes = SimpleNamespace(extra_config={"block_nbytes": BLOCK, "cpu_bytes_to_use": 10 * BLOCK})
    assert kt.OffloadingSpec.from_vllm(by_bytes).num_cpu_blocks == 10
    with pytest.raises(kt.ConfigError, match="bytes per block"):
        kt.OffloadingSpec.from_vllm(SimpleNamespace(extra_config={"num_cpu_blocks": 4}))
    with pytest.raises(kt.ConfigError, match="num_cpu_blocks"):
        kt.OffloadingSpec.from_vllm(SimpleNamespace(extra_config={"block_nbytes": BLOCK}))


def test_the_adapter_needs_a_nested_tier(primary: memoryview) -> None:
    with pytest.raises(kt.ConfigError, match="nested tier config"):
        KVTierSecondaryTier(vllm_spec(), primary, "kvtier")
    with pytest.raises(kt.ConfigError, match="lookup_result"):
        make(primary, {"type": "memory"}, lookup_result="maybe")


def test_results_are_job_results() -> None:
    assert JobResult(1, True).job_id == 1 and JobResult(1, True).success
