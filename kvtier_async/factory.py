"""`SecondaryTierFactory`: a lazy registry from tier type names to tier classes.

A backend module is imported only when a config names it, so `redis` or
`obstore` are needed only by those who configure those tiers. Three sources,
in order: `register_tier` (built-ins are registered this way), a `"module_path"`
in the tier config that names the module holding a class called after the
`"type"`, and the entry-point group `kvtier_async.tiers`
(`name = "package.module:ClassName"`).

Importing a backend module reads files: the first cache or tier made with a
given type pays that once, on the calling thread. Create caches before the
serving loop gets busy, or import the backend module up front.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any, ClassVar

from .errors import ConfigError, UnknownTierError
from .spec import OffloadingSpec
from .tier import SecondaryTierManager

__all__ = ["ENTRY_POINT_GROUP", "SecondaryTierFactory"]

ENTRY_POINT_GROUP = "kvtier_async.tiers"


class SecondaryTierFactory:
    """Creates secondary tiers from `{"type": name, **kwargs}` configs."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Make `tier_type` create `module_path.class_name`; the module is imported on first use."""
        for name, value in (
            ("tier_type", tier_type),
            ("module_path", module_path),
            ("class_name", class_name),
        ):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"register_tier: {name} must be a non-empty str, got {value!r}")
        if tier_type in cls._registry:
            module, klass = cls._registry[tier_type]
            raise ConfigError(f"tier type {tier_type!r} is already registered ({module}.{klass})")
        cls._registry[tier_type] = (module_path, class_name)

    @classmethod
    def unregister_tier(cls, tier_type: str) -> None:
        """Forget a registration (for tests and plugins that replace a tier)."""
        cls._registry.pop(tier_type, None)

    @classmethod
    def known_types(cls) -> list[str]:
        """Registered types and those offered through entry points."""
        return sorted(set(cls._registry) | set(_entry_points()))

    @classmethod
    def get_tier_class(cls, tier_type: str, module_path: str | None = None) -> type[SecondaryTierManager]:
        if tier_type in cls._registry:
            module_name, class_name = cls._registry[tier_type]
        elif module_path is not None:
            module_name, class_name = module_path, tier_type
        elif (entry := _entry_points().get(tier_type)) is not None:
            module_name, _, class_name = entry.value.partition(":")
        else:
            raise UnknownTierError(
                f"unknown tier type {tier_type!r}; known types: {cls.known_types()} "
                '(an out-of-tree tier also needs "module_path")'
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                f"tier type {tier_type!r}: cannot import {module_name!r} ({exc}); "
                "is the extra for this tier installed?"
            ) from exc
        tier_cls = getattr(module, class_name, None)
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
            raise ConfigError(
                f"tier type {tier_type!r}: {module_name}.{class_name} is not a SecondaryTierManager subclass"
            )
        return tier_cls

    @classmethod
    def create_secondary_tier(
        cls,
        tier_config: Mapping[str, Any],
        primary_kv_view: memoryview,
        offloading_spec: OffloadingSpec,
    ) -> SecondaryTierManager:
        """Create the tier a config names, passing the spec itself and the other keys as kwargs."""
        if not isinstance(tier_config, Mapping):
            raise ConfigError(f"tier config must be a dict, got {type(tier_config).__name__}")
        config = dict(tier_config)
        tier_type = config.pop("type", None)
        if not isinstance(tier_type, str) or not tier_type:
            raise ConfigError('tier config needs a "type" (a non-empty str)')
        module_path = config.pop("module_path", None)
        if module_path is not None and not isinstance(module_path, str):
            raise ConfigError(f'tier config "module_path" must be a str, got {module_path!r}')
        tier_cls = cls.get_tier_class(tier_type, module_path)
        try:
            return tier_cls(offloading_spec, primary_kv_view, tier_type, **config)
        except TypeError as exc:
            raise ConfigError(f"tier type {tier_type!r}: bad arguments: {exc}") from exc


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


SecondaryTierFactory.register_tier("memory", "kvtier_async.tiers.memory", "MemoryTier")
SecondaryTierFactory.register_tier("fs", "kvtier_async.tiers.fs", "FileSystemTier")
SecondaryTierFactory.register_tier("redis", "kvtier_async.tiers.redis_tier", "RedisTier")
SecondaryTierFactory.register_tier("s3", "kvtier_async.tiers.object_store", "ObjectStoreTier")
SecondaryTierFactory.register_tier("mooncake", "kvtier_async.tiers.mooncake", "MooncakeTier")
