"""Out-of-tree tiers the tests load through `module_path` and entry points."""

from __future__ import annotations

from kvtier_async.tiers.memory import MemoryTier

created: list[object] = []


class RecordingTier(MemoryTier):
    """A memory tier that remembers what the factory handed it."""

    def __init__(self, offloading_spec, primary_kv_view, tier_type, *, label="", **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(offloading_spec, primary_kv_view, tier_type, **kwargs)
        self.label = label
        created.append(self)


class NotATier:
    pass
