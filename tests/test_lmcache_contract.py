"""LMCache's own L2 adapter tests, from its 0.5.6 source distribution, run against `KVTierL2Adapter`.

tests/install.sh unpacks them into `.venv/lmcache-tests` (the wheel carries no tests). Each
file runs in its own pytest process with the `kvtier_swap` plugin, which points the test
module's adapter under test at ours (no LMCache file is edited), once over an fs tier and once
over a real Redis server; and once as LMCache wrote it, with its own adapter, as the control.
Tests that check a mock's own internals rather than the adapter contract are deselected, each
with the reason. LMCache's check mode for L2 adapters (`lmcache.v1.basic_check --mode
test_l2_adapter`) runs over ours and, as the control, over its mock adapter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from child_env import child_env

SOURCE = Path(os.environ.get("KVTIER_LMCACHE_TESTS", Path(sys.prefix) / "lmcache-tests"))
PLUGIN_DIR = Path(__file__).resolve().parent / "lmcache_contract"

if not (SOURCE / "pytest.ini").exists():
    if os.environ.get("KVTIER_REQUIRE_SERVERS") == "1":  # CI fetches them and never skips these
        raise RuntimeError(f"LMCache's tests are not at {SOURCE}: run tests/install.sh")
    pytest.skip(
        f"LMCache's tests are not at {SOURCE} (tests/install.sh fetches them)", allow_module_level=True
    )

MOCK = "tests/v1/distributed/test_mock_l2_adapter.py"
PLUGIN = "examples/lmc_external_l2_adapter/tests/test_plugin.py"
FS_DELETE = "tests/v1/distributed/test_fs_l2_adapter_delete.py"  # written for LMCache's fs adapter
SALT_EVICTION = "tests/v1/distributed/test_cache_salt_l2_eviction.py"  # its quota eviction controller
# Its real L1 manager, store and prefetch controllers over the adapter (the L2 cases; the others
# run beside them, not touching the adapter). The `lmcache_cpu` plugin lets it run without a GPU.
STORAGE_MANAGER = "tests/v1/distributed/test_distributed_storage_manager.py"
#: Each file, and how many of its tests must pass with ours (all but the deselected).
FILES = {MOCK: 40, PLUGIN: 11, FS_DELETE: 9, SALT_EVICTION: 6, STORAGE_MANAGER: 29}

#: Tests of LMCache's that check the adapter they were written for rather than the contract.
NOT_THE_CONTRACT = {
    MOCK: {
        "TestBandwidthSimulation::test_store_completion_is_delayed_by_bandwidth": (
            "times the mock's simulated bandwidth"
        ),
        "TestEvictionInterface::test_get_usage_empty_adapter_is_zero": (
            "expects a usage fraction from a declared capacity; ours declares none (the tier bounds "
            "and evicts itself), so LMCache's own eviction stays off, as for its fs adapter"
        ),
        "TestEvictionInterface::test_get_usage_increases_after_store": "the same: a usage fraction",
        "TestEvictionInterface::test_get_usage_decreases_after_delete": "the same: a usage fraction",
    },
    PLUGIN: {
        "TestPluginConfigParsing::test_from_dict": "compares the example's module path",
        "TestPluginConfigParsing::test_from_dict_with_config_class": "compares the example's module path",
        "TestPluginConfigParsing::test_parse_args": "compares the example's class name",
        "TestPluginRoundTrip::test_create_via_registry": "checks isinstance of the example's class",
        "TestPluginRoundTrip::test_fifo_eviction": "the example's FIFO policy at a 10 KB capacity",
    },
}


#: With a capacity declared in the tier config, the usage tests are the contract too.
USAGE_TESTS = {name for name in NOT_THE_CONTRACT[MOCK] if "get_usage" in name}


#: LMCache's check mode: keys stored and loaded, and the lines its verdicts are on.
CHECK_KEYS = 16
CHECKED = ["correctly absent", "Batch store OK", "found", "Validation (loaded)", "Validation (content)"]

#: LMCache's runs under way at once. A run is mostly its tests polling and waiting (the storage
#: manager's 29 tests: 42 s, 12 s of it on a CPU), so the module's 22 runs share a few lanes
#: rather than going one after another: on 2 cores, 4.4 minutes one by one, 2.4 in 4 lanes.
LANES = 4


@dataclasses.dataclass(frozen=True)
class Run:
    """One pytest or check-mode process of LMCache's, and where it runs."""

    command: list[str]
    env: dict[str, str] | None = None
    cwd: Path | None = None

    def __call__(self) -> tuple[int, str]:
        done = subprocess.run(
            self.command, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=600
        )
        return done.returncode, done.stdout + done.stderr


def lmcache_test_run(
    test_file: str, root: Path, *, ours: bool, tier: str = "fs", capacity: int | None = None, only: str = ""
) -> Run:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    if test_file == STORAGE_MANAGER:
        command += ["-p", "lmcache_cpu"]
    if only:
        command += ["-k", only]
    if ours:
        command += ["-p", "kvtier_swap"]
        for name in NOT_THE_CONTRACT.get(test_file, {}):
            if not (capacity and name in USAGE_TESTS):
                command += ["--deselect", f"{test_file}::{name}"]
    env = {
        **child_env(PLUGIN_DIR),
        "KVTIER_LMCACHE_TIER": tier,
        "KVTIER_LMCACHE_ROOT": str(root),
        "KVTIER_LMCACHE_CAPACITY": str(capacity or ""),
    }
    return Run(command, env, SOURCE)


def check_mode_run(tier: str, obj_size: int | None, root: Path, redis_url: Callable[[], str]) -> Run:
    """`python -m lmcache.v1.basic_check --mode test_l2_adapter` over our adapter on `tier`, or
    over LMCache's mock adapter for the "control"."""
    if tier == "control":
        spec: dict[str, object] = {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 100}
    else:
        config: dict[str, object] = {"type": "fs", "root": str(root / "kv")}
        if tier == "redis":
            config = {"type": "redis", "url": redis_url(), "prefix": f"check-{root.name}"}
        spec = {
            "type": "plugin",
            "module_path": "kvtier_async.integrations.lmcache",
            "class_name": "KVTierL2Adapter",
            "adapter_params": {"tier": config},
        }
    command = [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter"]
    command += ["--l2-adapter", json.dumps(spec), "--num-keys", str(CHECK_KEYS)]
    if obj_size is not None:
        command += ["--obj-size", str(obj_size)]
    return Run(command)


def planned_run(item: pytest.Item, root: Path, redis_url: Callable[[], str]) -> Run:
    """The run a test of this module checks, from its name and parameters."""
    callspec = getattr(item, "callspec", None)
    param = callspec.params if callspec is not None else {}
    name = getattr(item, "originalname", item.name)
    if name == "test_lmcaches_own_adapter_passes_them_as_the_control":
        return lmcache_test_run(param["test_file"], root, ours=False)
    if name == "test_ours_passes_lmcaches_adapter_tests":
        where = redis_url() if param["tier"] == "redis" else "fs"
        return lmcache_test_run(param["test_file"], root, ours=True, tier=where)
    if name == "test_with_a_declared_capacity_lmcaches_usage_tests_pass":
        return lmcache_test_run(MOCK, root, ours=True, capacity=64 << 20, only="TestEvictionInterface")
    if name == "test_lmcaches_check_mode_for_l2_adapters":
        return check_mode_run(param["tier"], param["obj_size"], root, redis_url)
    raise LookupError(f"no LMCache run for {item.nodeid}")


@pytest.fixture(scope="module")
def lmcache_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[tuple[int, str]]]]:
    """Every selected test's run, all started at the module's first test, `LANES` at a time,
    the storage manager's (the longest) first: by test id, its exit code and output."""
    mine = [item for item in request.session.items if item.path == request.path]
    mine.sort(key=lambda item: STORAGE_MANAGER not in item.nodeid)

    def redis_url() -> str:
        return str(request.getfixturevalue("redis_server").url)

    pool = ThreadPoolExecutor(LANES, thread_name_prefix="lmcache-run")
    try:
        yield {
            item.nodeid: pool.submit(planned_run(item, tmp_path_factory.mktemp("lmcache"), redis_url))
            for item in mine
        }
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def lmcache_run(
    lmcache_runs: dict[str, Future[tuple[int, str]]], request: pytest.FixtureRequest
) -> tuple[int, str]:
    """This test's run, once it has ended: its exit code and output."""
    return lmcache_runs[request.node.nodeid].result()


def passed(output: str) -> int:
    found = re.search(r"(\d+) passed", output)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize("test_file", list(FILES))
def test_lmcaches_own_adapter_passes_them_as_the_control(
    test_file: str, lmcache_run: tuple[int, str]
) -> None:
    code, output = lmcache_run
    assert code == 0, output[-3000:]
    assert "kvtier_swap" not in output


@pytest.mark.parametrize("tier", ["fs", "redis"])
@pytest.mark.parametrize("test_file", list(FILES))
def test_ours_passes_lmcaches_adapter_tests(
    test_file: str,
    tier: str,
    lmcache_run: tuple[int, str],
) -> None:
    code, output = lmcache_run
    assert code == 0, output[-3000:]
    assert f"the adapter under test is KVTierL2Adapter over {tier}" in output, output[-3000:]
    assert passed(output) >= FILES[test_file], output[-3000:]


def test_with_a_declared_capacity_lmcaches_usage_tests_pass(lmcache_run: tuple[int, str]) -> None:
    """A tier config with `capacity_bytes`: the adapter reports it, and LMCache's own
    `TestEvictionInterface` (its three usage tests included) passes; without one, those three
    are deselected above, as LMCache's fs adapter reports no capacity either."""
    code, output = lmcache_run
    assert code == 0, output[-3000:]
    assert passed(output) >= 3 + len(USAGE_TESTS), output[-3000:]


@pytest.mark.parametrize("obj_size", [None, 512 << 10])  # LMCache's default (1024 bf16: 2 KiB), 1 MiB
@pytest.mark.parametrize("tier", ["control", "fs", "redis"])
def test_lmcaches_check_mode_for_l2_adapters(
    tier: str, obj_size: int | None, lmcache_run: tuple[int, str]
) -> None:
    """`python -m lmcache.v1.basic_check --mode test_l2_adapter`, LMCache's own check of an L2
    adapter built from a user's `--l2-adapter` JSON: lookups of absent keys, a batch store,
    lookups, loads compared byte for byte. It prints its verdicts and exits 0 either way, so its
    lines are read; LMCache's mock adapter goes through the same check as the control."""
    code, output = lmcache_run
    assert code == 0, output[-3000:]
    assert "Test Failed" not in output and "FAIL" not in output, output[-3000:]
    assert "KVTierL2Adapter" in output if tier != "control" else "MockL2Adapter" in output
    for what in CHECKED:
        verdict = next((line for line in output.splitlines() if what in line), "")
        assert verdict, f"no {what!r} line in:\n{output[-3000:]}"
        if "/" in verdict:
            assert re.search(rf"\b{CHECK_KEYS}/{CHECK_KEYS}\b", verdict), verdict
