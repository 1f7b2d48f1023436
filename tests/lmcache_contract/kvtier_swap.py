"""A pytest plugin that runs LMCache's own L2 adapter tests against `KVTierL2Adapter`.

Loaded with `-p kvtier_swap` when pytest runs test files of LMCache's source distribution
(`tests/test_lmcache_contract.py` does). No LMCache file is edited: after collection, each test
module's names for the adapter under test are pointed at ours, over the tier named by the
environment (`KVTIER_LMCACHE_TIER`: "fs", the default, on a fresh directory per adapter, or a
`redis://` URL).

LMCache's conftest replaces redis-py with an in-memory fake around every test. Over a real
Redis server, this plugin puts the real redis-py back for the test's own call (the fake
returns after it, for the fixtures' teardown): the tier then talks to the server.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

from kvtier_async.integrations.lmcache import KVTierL2Adapter, object_key

# What LMCache's conftest patches, as it is before any test runs.
_REAL_REDIS = [
    (redis, "Redis", redis.Redis),
    (redis, "from_url", redis.from_url),
    (redis.asyncio, "Redis", redis.asyncio.Redis),
    (redis.asyncio, "from_url", redis.asyncio.from_url),
    (redis.asyncio.ConnectionPool, "from_url", redis.asyncio.ConnectionPool.__dict__["from_url"]),
]


def tier_config() -> dict[str, Any]:
    where = os.environ.get("KVTIER_LMCACHE_TIER", "fs")
    if where.startswith(("redis://", "unix://")):
        return {"type": "redis", "url": where, "prefix": f"lmcache-contract-{uuid.uuid4().hex[:12]}"}
    under = os.environ.get("KVTIER_LMCACHE_ROOT")  # the runner's temporary directory
    config: dict[str, Any] = {"type": "fs", "root": tempfile.mkdtemp(prefix="kvtier-lmcache-", dir=under)}
    capacity = os.environ.get("KVTIER_LMCACHE_CAPACITY")  # a declared capacity, reported to LMCache
    if capacity:
        config["capacity_bytes"] = int(capacity)
    return config


def config_for_ours(*args: Any, **kwargs: Any) -> PluginL2AdapterConfig:
    """Stands in for the mock adapter's config class: whatever it was given, the `plugin` config a
    user writes for ours (LMCache's factory builds an adapter from it, as its storage manager does)."""
    return PluginL2AdapterConfig(
        module_path="kvtier_async.integrations.lmcache",
        class_name="KVTierL2Adapter",
        adapter_params={"tier": tier_config()},
    )


def adapter_for_ours(config: Any, *args: Any, **kwargs: Any) -> KVTierL2Adapter:
    if isinstance(config, PluginL2AdapterConfig):
        return KVTierL2Adapter(config.adapter_params)
    return KVTierL2Adapter({"tier": tier_config()})


def debug_has_key(adapter: KVTierL2Adapter, key: Any) -> bool:
    """What LMCache's storage-manager tests ask their mock (`debug_has_key`) to learn that a
    store reached L2: asked of our tiers, every size class the adapter has opened."""
    wanted = object_key(key)

    async def ask() -> bool:
        for size_class in adapter._sizes.opened():
            if (await size_class.tier.lookup_each([wanted]))[0]:
                return True
        return False

    return adapter._bridge.call(ask())


KVTierL2Adapter.debug_has_key = debug_has_key  # in the test process only


def plugin_json() -> str:
    """The `--l2-adapter` JSON a user writes for ours (LMCache's plugin tests build from it)."""
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvtier_async.integrations.lmcache",
            "class_name": "KVTierL2Adapter",
            "adapter_params": {"tier": tier_config()},
        }
    )


SWAPS: dict[str, Any] = {
    "MockL2Adapter": adapter_for_ours,
    "MockL2AdapterConfig": config_for_ours,
    "FSL2Adapter": adapter_for_ours,
    "FSL2AdapterConfig": config_for_ours,
    # examples/lmc_external_l2_adapter/tests/test_plugin.py builds its adapter from these
    "ADAPTER_JSON": plugin_json(),
    "ADAPTER_JSON_CFG": plugin_json(),
}


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for item in items:
        module = getattr(item, "module", None)
        for name, replacement in SWAPS.items():
            if module is not None and hasattr(module, name):
                setattr(module, name, replacement)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    if not os.environ.get("KVTIER_LMCACHE_TIER", "").startswith(("redis://", "unix://")):
        return (yield)
    faked = [(owner, name, owner.__dict__[name]) for owner, name, _ in _REAL_REDIS if name in owner.__dict__]
    for owner, name, real in _REAL_REDIS:
        setattr(owner, name, real)
    try:
        return (yield)
    finally:
        for owner, name, fake in faked:
            setattr(owner, name, fake)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    where = os.environ.get("KVTIER_LMCACHE_TIER", "fs").split("://")[0]
    terminalreporter.write_line(f"kvtier_swap: the adapter under test is KVTierL2Adapter over {where}")
