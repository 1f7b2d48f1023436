from __future__ import annotations

import dataclasses
import os

import pytest

import kvtier_async as kt


def test_defaults_and_stride() -> None:
    spec = kt.OffloadingSpec(block_nbytes=5000, num_cpu_blocks=10)
    assert spec.block_size == 16
    assert spec.namespace == "default"
    assert spec.secondary_tiers == ()
    assert spec.block_stride == 8192
    assert kt.OffloadingSpec(block_nbytes=8192, num_cpu_blocks=1).block_stride == 8192
    assert spec.primary_nbytes == 10 * 8192


def test_frozen() -> None:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_cpu_blocks = 2  # type: ignore[misc]


def test_tier_configs_are_private_copies() -> None:
    config = {"type": "memory", "capacity_bytes": 1 << 20}
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1, secondary_tiers=[config])
    config["capacity_bytes"] = 1
    assert spec.secondary_tiers[0]["capacity_bytes"] == 1 << 20
    with pytest.raises(TypeError):
        spec.secondary_tiers[0]["type"] = "x"  # type: ignore[index]


def test_resolved_limits_fill_every_none() -> None:
    spec = kt.OffloadingSpec(block_nbytes=2 << 20, num_cpu_blocks=512)
    limits = spec.limits
    assert all(isinstance(v, int) and v > 0 for v in dataclasses.asdict(limits).values())
    assert limits.max_pending_stores == 512  # a whole primary tier's worth is admitted
    assert limits.max_inflight_loads == 2 * limits.io_threads  # a read queued behind each one checked
    assert limits.max_inflight_stores == limits.io_threads
    explicit = dataclasses.replace(
        spec, max_inflight_loads=3, max_inflight_stores=2, max_pending_stores=7, io_threads=5
    ).limits
    assert (
        explicit.max_inflight_loads,
        explicit.max_inflight_stores,
        explicit.max_pending_stores,
        explicit.io_threads,
    ) == (3, 2, 7, 5)


@pytest.mark.parametrize(("cpus", "copy_threads"), [(None, 1), (1, 1), (2, 1), (3, 2), (5, 4), (64, 4)])
def test_copy_threads_leave_a_core_free(
    monkeypatch: pytest.MonkeyPatch, cpus: int | None, copy_threads: int
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    limits = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8).limits
    assert limits.copy_threads == copy_threads
    assert kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8, copy_threads=3).limits.copy_threads == 3


def test_vllm_config_is_carried_untouched() -> None:
    marker = object()
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1, vllm_config=marker)
    assert spec.vllm_config is marker


def test_from_dict_with_cpu_bytes() -> None:
    spec = kt.OffloadingSpec.from_dict(
        {
            "block_nbytes": 5000,
            "cpu_bytes_to_use": 10 * 8192 + 100,
            "secondary_tiers": [{"type": "memory"}],
            "namespace": "m",
        }
    )
    assert spec.num_cpu_blocks == 10
    assert spec.namespace == "m"
    assert spec.secondary_tiers[0]["type"] == "memory"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_nbytes": 0, "num_cpu_blocks": 1}, "block_nbytes"),
        ({"block_nbytes": -4, "num_cpu_blocks": 1}, "block_nbytes"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 0}, "num_cpu_blocks"),
        ({"block_nbytes": 4096, "num_cpu_blocks": True}, "num_cpu_blocks"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "block_size": 0}, "block_size"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "namespace": ""}, "namespace"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "io_threads": 0}, "io_threads"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "copy_threads": 0}, "copy_threads"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "max_pending_stores": -1}, "max_pending_stores"),
        (
            {"block_nbytes": 4096, "num_cpu_blocks": 1, "secondary_tiers": {"type": "memory"}},
            "secondary_tiers",
        ),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "secondary_tiers": [{"root": "/x"}]}, "secondary_tiers"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 1, "extra_config": []}, "extra_config"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(kt.ConfigError, match=field) as info:
        kt.OffloadingSpec(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, kt.KVTierError)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"block_nbytes": 4096}, "num_cpu_blocks"),
        ({"num_cpu_blocks": 4}, "block_nbytes"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 4, "cpu_bytes_to_use": 1 << 20}, "not both"),
        ({"block_nbytes": 4096, "cpu_bytes_to_use": 100}, "cpu_bytes_to_use"),
        ({"block_nbytes": 4096, "num_cpu_blocks": 4, "num_gpu_blocks": 3}, "unknown keys"),
        ([("block_nbytes", 1)], "dict"),
    ],
)
def test_from_dict_errors(config: object, message: str) -> None:
    with pytest.raises(kt.ConfigError, match=message):
        kt.OffloadingSpec.from_dict(config)  # type: ignore[arg-type]
