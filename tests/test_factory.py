from __future__ import annotations

import sys
from pathlib import Path

import oot_tier
import pytest

import kvtier_async as kt
from kvtier_async.tiers.memory import MemoryTier


@pytest.fixture
def spec() -> kt.OffloadingSpec:
    return kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)


@pytest.fixture
def view(spec: kt.OffloadingSpec) -> memoryview:
    return memoryview(bytearray(spec.primary_nbytes))


def test_builtin_memory_tier(spec: kt.OffloadingSpec, view: memoryview) -> None:
    config = {"type": "memory", "capacity_bytes": 1 << 20}
    tier = kt.SecondaryTierFactory.create_secondary_tier(config, view, spec)
    assert isinstance(tier, MemoryTier)
    assert tier.offloading_spec is spec
    assert tier.tier_type == "memory" and tier.capacity_bytes == 1 << 20
    assert config == {"type": "memory", "capacity_bytes": 1 << 20}  # the caller's dict untouched


def test_out_of_tree_tier_by_module_path(spec: kt.OffloadingSpec, view: memoryview) -> None:
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "RecordingTier", "module_path": "oot_tier", "label": "x"}, view, spec
    )
    assert tier is oot_tier.created[-1]
    assert isinstance(tier, oot_tier.RecordingTier)
    assert tier.offloading_spec is spec and tier.label == "x"


def test_register_is_lazy_and_unique(spec: kt.OffloadingSpec, view: memoryview) -> None:
    kt.SecondaryTierFactory.register_tier("lazy-test", "module_that_does_not_exist", "X")
    try:
        with pytest.raises(kt.ConfigError, match="already registered"):
            kt.SecondaryTierFactory.register_tier("lazy-test", "oot_tier", "RecordingTier")
        # Registration imported nothing; creating does, and says what failed.
        with pytest.raises(kt.ConfigError, match="cannot import 'module_that_does_not_exist'"):
            kt.SecondaryTierFactory.create_secondary_tier({"type": "lazy-test"}, view, spec)
    finally:
        kt.SecondaryTierFactory.unregister_tier("lazy-test")


def test_unknown_type_lists_known_ones(spec: kt.OffloadingSpec, view: memoryview) -> None:
    with pytest.raises(kt.UnknownTierError, match=r"unknown tier type 'nope'.*'memory'"):
        kt.SecondaryTierFactory.create_secondary_tier({"type": "nope"}, view, spec)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"capacity_bytes": 1}, '"type"'),
        ({"type": "NotATier", "module_path": "oot_tier"}, "not a SecondaryTierManager"),
        ({"type": "memory", "no_such_kwarg": 1}, "bad arguments"),
        ({"type": "memory", "capacity_bytes": 0}, "capacity_bytes"),
    ],
)
def test_bad_configs(
    spec: kt.OffloadingSpec, view: memoryview, config: dict[str, object], message: str
) -> None:
    with pytest.raises(kt.ConfigError, match=message):
        kt.SecondaryTierFactory.create_secondary_tier(config, view, spec)


def test_primary_view_must_fit_the_spec(spec: kt.OffloadingSpec) -> None:
    with pytest.raises(kt.InvalidArgumentError, match="primary_kv_view"):
        kt.SecondaryTierFactory.create_secondary_tier({"type": "memory"}, memoryview(bytearray(100)), spec)
    with pytest.raises(kt.InvalidArgumentError, match="writable"):
        kt.SecondaryTierFactory.create_secondary_tier(
            {"type": "memory"}, memoryview(bytes(spec.primary_nbytes)), spec
        )


def test_entry_point_registration(
    tmp_path: Path, spec: kt.OffloadingSpec, view: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "kvtier_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvtier_async.tiers]\nplugin-demo = oot_tier:RecordingTier\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert "plugin-demo" in kt.SecondaryTierFactory.known_types()
    tier = kt.SecondaryTierFactory.create_secondary_tier({"type": "plugin-demo"}, view, spec)
    assert isinstance(tier, oot_tier.RecordingTier)
