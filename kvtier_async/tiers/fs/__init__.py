"""The file-system tier (`"fs"`), one room per job along a block's way:

- `tier`: `FileSystemTier`, the tier contract wired to the rooms below;
- `index`: `SlabIndex`, which record holds which block (event-loop thread, no I/O), in flat
  arrays; `key_table`: `KeyTable`, its hash table from keys to records;
- `slab_files`: `SlabFiles`, the namespace's files (opening, claiming a slab, following
  the other processes' logs; worker threads);
- `records`: `RecordIO`, records and log entries written and read (worker threads);
- `layout`: the on-disk format; `staging`: staged O_DIRECT; `admin`: `kvtier fs`.
"""

from .tier import DEFAULT_CAPACITY_BYTES, DEFAULT_REFRESH_INTERVAL_S, FileSystemTier

__all__ = ["DEFAULT_CAPACITY_BYTES", "DEFAULT_REFRESH_INTERVAL_S", "FileSystemTier"]
