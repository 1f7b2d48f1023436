"""The exceptions kvtier_async raises.

    KVTierError                      root of everything we raise on purpose
    ├── InvalidArgumentError         (also ValueError) bad arguments to a call; nothing changed
    │   └── ConfigError              (also ValueError) bad OffloadingSpec or tier config
    │       └── UnknownTierError     a tier "type" nobody registered
    ├── ClosedError                  (also RuntimeError) the cache or tier was closed
    └── NamespaceInUseError          an older (format-1) process holds a file-system tier's namespace

A missing block is not an error: `load` reports it as a miss. Backend faults
(I/O errors, a server that is gone) are translated at the tier boundary into
misses and failed stores, counted in `stats()`, and logged; they do not reach
the caller.
"""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "ConfigError",
    "InvalidArgumentError",
    "KVTierError",
    "NamespaceInUseError",
    "UnknownTierError",
]


class KVTierError(Exception):
    """Root of the exceptions kvtier_async raises."""


class InvalidArgumentError(KVTierError, ValueError):
    """A call got arguments it cannot accept; it raised before changing any state."""


class ConfigError(InvalidArgumentError):
    """An `OffloadingSpec` or tier config is invalid; the message names the field."""


class UnknownTierError(ConfigError):
    """A tier config names a type that is not registered; the message lists the known ones."""


class ClosedError(KVTierError, RuntimeError):
    """The cache or tier was closed before or during the call."""


class NamespaceInUseError(KVTierError):
    """A format-1 kvtier_async process (one process per root) holds this file-system tier's
    namespace directory, so it can be neither shared nor rebuilt; the message names the process."""
