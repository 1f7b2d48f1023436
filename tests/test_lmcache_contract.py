"""LMCache's own L2 adapter tests, from its 0.5.6 source distribution, run against `KVTierL2Adapter`.

tests/install.sh unpacks them into `.venv/lmcache-tests` (the wheel carries no tests). Each
file runs in its own pytest process with the `kvtier_swap` plugin, which points the test
module's adapter under test at ours (no LMCache file is edited), once over an fs tier and once
over a real Redis server; and once as LMCache wrote it, with its own adapter, as the control.
Tests that check a mock's own internals rather than the adapter contract are deselected, each
with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
#: Each file, and how many of its tests must pass with ours (all but the deselected).
FILES = {MOCK: 40, PLUGIN: 11, FS_DELETE: 9, SALT_EVICTION: 6}

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


def run_lmcache_tests(test_file: str, root: Path, *, ours: bool, tier: str = "fs") -> tuple[int, str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    if ours:
        command += ["-p", "kvtier_swap"]
        for name in NOT_THE_CONTRACT.get(test_file, {}):
            command += ["--deselect", f"{test_file}::{name}"]
    env = {
        **os.environ,
        "PYTHONPATH": str(PLUGIN_DIR),
        "KVTIER_LMCACHE_TIER": tier,
        "KVTIER_LMCACHE_ROOT": str(root),
    }
    done = subprocess.run(command, cwd=SOURCE, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def passed(output: str) -> int:
    found = re.search(r"(\d+) passed", output)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize("test_file", list(FILES))
def test_lmcaches_own_adapter_passes_them_as_the_control(test_file: str, tmp_path: Path) -> None:
    code, output = run_lmcache_tests(test_file, tmp_path, ours=False)
    assert code == 0, output[-3000:]
    assert "kvtier_swap" not in output


@pytest.mark.parametrize("tier", ["fs", "redis"])
@pytest.mark.parametrize("test_file", list(FILES))
def test_ours_passes_lmcaches_adapter_tests(
    test_file: str, tier: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    where = request.getfixturevalue("redis_server").url if tier == "redis" else "fs"
    code, output = run_lmcache_tests(test_file, tmp_path, ours=True, tier=where)
    assert code == 0, output[-3000:]
    assert f"the adapter under test is KVTierL2Adapter over {tier}" in output, output[-3000:]
    assert passed(output) >= FILES[test_file], output[-3000:]
