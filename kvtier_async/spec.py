"""`OffloadingSpec`: the frozen configuration every part of kvtier_async is sized from."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .errors import ConfigError, InvalidArgumentError
from .redact import redacted_config

__all__ = ["ALIGNMENT", "VLLM_SERIES", "OffloadingSpec", "SchedulerLimits", "vllm_namespace"]

#: Slots of the primary tier start on this boundary, so O_DIRECT can read and
#: write them in place.
ALIGNMENT = 4096

#: The scheduler sizing fields of `OffloadingSpec`: optional, each None or a positive int.
LIMIT_FIELDS = (
    "max_inflight_loads",
    "max_inflight_stores",
    "max_pending_stores",
    "io_threads",
    "copy_threads",
    "max_inflight_bytes",
)

# Soft targets the defaults are derived from (documented in docs/scheduling.md).
_BATCH_TARGET_BYTES = 16 << 20  # bytes handed to one write_blocks/read_blocks call
_CHUNK_TARGET_BYTES = 64 << 20  # bytes one pipeline step of the cache moves


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerLimits:
    """The concurrency limits in force, every one resolved from an `OffloadingSpec`."""

    io_threads: int
    """Worker threads shared by the blocking work of all tiers of one cache."""
    copy_threads: int
    """Worker threads for device <-> host copies on machines without CUDA."""
    max_inflight_loads: int
    """Concurrent `read_blocks` calls per tier."""
    max_inflight_stores: int
    """Concurrent `write_blocks` calls per tier."""
    max_pending_stores: int
    """Blocks that may wait for a `write_blocks` slot per tier; beyond it stores are dropped."""
    max_inflight_bytes: int
    """Bytes handed to `write_blocks` / `read_blocks` calls in flight, all tiers together."""
    batch_blocks: int
    """Blocks handed to one `write_blocks` / `read_blocks` call."""
    chunk_blocks: int
    """Blocks one step of a cache `store` / `load` moves through the primary tier."""
    store_slots: int
    """Primary slots that a cache's stores may hold at once (copying from the device, then
    pinned until every secondary tier has written them). Beyond it stores are not accepted, so
    loads always find room even while a tier stalls."""


def _check_positive_int(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"OffloadingSpec.{name} must be a positive int, got {value!r}")


def _freeze_tier_configs(value: object) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"OffloadingSpec.secondary_tiers must be a list of tier configs, got {type(value).__name__}"
        )
    frozen = []
    for i, config in enumerate(value):
        if not isinstance(config, Mapping):
            raise ConfigError(
                f"OffloadingSpec.secondary_tiers[{i}] must be a dict, got {type(config).__name__}"
            )
        tier_type = config.get("type")
        if not isinstance(tier_type, str) or not tier_type:
            raise ConfigError(f'OffloadingSpec.secondary_tiers[{i}] needs a "type" (a non-empty str)')
        # A private deep copy: later changes to the caller's dicts cannot reach us.
        frozen.append(MappingProxyType(copy.deepcopy(dict(config))))
    return tuple(frozen)


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadingSpec:
    """Geometry, capacity, tiers and scheduler sizing of one KV cache.

    Every limit in kvtier_async derives from this object; `limits` shows the
    resolved numbers. The tiers receive the spec itself, as vLLM's do.
    """

    block_nbytes: int
    """Bytes of one KV block: all layers, K and V."""
    num_cpu_blocks: int
    """Capacity of the primary (pinned host) tier, in blocks."""
    block_size: int = 16
    """Tokens per block."""
    secondary_tiers: Sequence[Mapping[str, Any]] = ()
    """Tier configs, `{"type": name, **kwargs}`, in lookup order; stored as read-only copies."""
    namespace: str = "default"
    """Keeps caches of different models or layouts apart; part of every key and on-disk name."""
    max_inflight_loads: int | None = None
    """Concurrent `read_blocks` calls per tier; None: twice `io_threads` (a read is queued for
    each I/O thread while the last one's checksums are checked elsewhere)."""
    max_inflight_stores: int | None = None
    """Concurrent `write_blocks` calls per tier; None: `io_threads`."""
    max_pending_stores: int | None = None
    """Blocks waiting to be written per tier before stores are dropped; None: `num_cpu_blocks`."""
    io_threads: int | None = None
    """Worker threads for blocking tier work; None: 2 per CPU core, between 4 and 32."""
    copy_threads: int | None = None
    """Worker threads for CPU work (host copies, checksums, sealing); None: one fewer than the
    CPU cores, between 1 and 4, so that the event loop always finds a core."""
    max_inflight_bytes: int | None = None
    """Bytes in `write_blocks` / `read_blocks` calls at once, all tiers of a cache together
    (loads first); None: enough for every tier's lanes to be full."""
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    """Free-form settings for out-of-tree tiers; kvtier_async itself reads none of it."""
    vllm_config: Any = None
    """The engine config behind this spec, carried through untouched."""

    def __post_init__(self) -> None:
        _check_positive_int("block_nbytes", self.block_nbytes)
        _check_positive_int("num_cpu_blocks", self.num_cpu_blocks)
        _check_positive_int("block_size", self.block_size)
        for name in LIMIT_FIELDS:
            _check_positive_int(name, getattr(self, name), optional=True)
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError(f"OffloadingSpec.namespace must be a non-empty str, got {self.namespace!r}")
        if len(self.namespace.encode()) > 255:
            raise ConfigError("OffloadingSpec.namespace must be at most 255 bytes in UTF-8")
        if not isinstance(self.extra_config, Mapping):
            raise ConfigError(
                f"OffloadingSpec.extra_config must be a dict, got {type(self.extra_config).__name__}"
            )
        object.__setattr__(self, "secondary_tiers", _freeze_tier_configs(self.secondary_tiers))

    def __repr__(self) -> str:
        # A tier config's URL or endpoint may carry credentials: shown redacted.
        shown = (
            f"{f.name}={[redacted_config(c) for c in self.secondary_tiers]!r}"
            if f.name == "secondary_tiers"
            else f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr
        )
        return f"OffloadingSpec({', '.join(shown)})"

    @property
    def block_stride(self) -> int:
        """`block_nbytes` rounded up to 4096: the distance between primary slots."""
        return -(-self.block_nbytes // ALIGNMENT) * ALIGNMENT

    @property
    def primary_nbytes(self) -> int:
        """Bytes of host memory the primary tier takes."""
        return self.num_cpu_blocks * self.block_stride

    def primary_view(self, buffer: Any) -> memoryview:
        """`buffer` as this spec's primary memory: a writable byte view of at least
        `primary_nbytes` bytes. Raises `InvalidArgumentError` for anything else."""
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as exc:
            raise InvalidArgumentError(
                f"primary_kv_view must be a C-contiguous writable buffer: {exc}"
            ) from exc
        if view.readonly:
            raise InvalidArgumentError("primary_kv_view must be writable")
        if view.nbytes < self.primary_nbytes:
            raise InvalidArgumentError(
                f"primary_kv_view has {view.nbytes} bytes; the spec needs "
                f"num_cpu_blocks * block_stride = {self.primary_nbytes}"
            )
        return view

    @property
    def limits(self) -> SchedulerLimits:
        """The scheduler limits in force, with every `None` resolved from the rest of the spec."""
        cpus = os.cpu_count() or 1
        # Each worker takes the GIL back after every syscall and checksum, in competition with
        # the event loop: on 2 cores, 8 threads instead of 4 raised the loop's p99 lag during
        # cold loads from 2.1-3.4 to 3.2-6.3 ms (bench/loop_lag.py --io-threads) and read no
        # faster, a batch being one multi-MiB preadv that keeps several requests at the disk.
        # Stores may take every thread: a store-only burst then runs at disk speed, and a load
        # still goes first, its lane's waiters being admitted ahead of any queued store
        # (test_scheduling: a load is never behind queued stores).
        io_threads = self.io_threads or min(32, max(4, 2 * cpus))
        stride = self.block_stride
        batch_blocks = max(1, min(256, _BATCH_TARGET_BYTES // stride))
        chunk_blocks = max(
            1, min(max(1, self.num_cpu_blocks // 4), max(batch_blocks, _CHUNK_TARGET_BYTES // stride))
        )
        loads = self.max_inflight_loads or 2 * io_threads
        stores = self.max_inflight_stores or io_threads
        every_lane_full = (loads + stores) * batch_blocks * stride * max(1, len(self.secondary_tiers))
        # The CPU threads (copies, checksums, sealing) leave one core free. Busy on every core,
        # they left no idle CPU for the loop's wake-ups, which then queued behind the I/O
        # threads' and the kernel's own non-preemptible work. bench/secret_threads.py, 2 cores,
        # the sealed fs tier (records at 43a6772, 994c25d, 244c535, 19d169e): loop-lag p99
        # 1.1-1.9 ms with one thread, 1.4-3.1 ms with two. Cold loads are within 0.03x of two
        # threads' since large blocks are read in parts (records.READ_PIECE_BYTES). The sealed
        # Redis tier moved faster with one.
        copy_threads = self.copy_threads or max(1, min(4, cpus - 1))
        return SchedulerLimits(
            io_threads=io_threads,
            copy_threads=copy_threads,
            max_inflight_loads=loads,
            max_inflight_stores=stores,
            max_pending_stores=self.max_pending_stores or self.num_cpu_blocks,
            max_inflight_bytes=self.max_inflight_bytes or every_lane_full,
            batch_blocks=batch_blocks,
            chunk_blocks=chunk_blocks,
            store_slots=max(1, self.num_cpu_blocks // 2),
        )

    @classmethod
    def from_vllm(
        cls,
        vllm_spec: Any,
        primary_kv_view: memoryview,
        *,
        secondary_tiers: Sequence[Mapping[str, Any]] = (),
        **limits: int | None,
    ) -> OffloadingSpec:
        """Our spec for one vLLM secondary tier: vLLM 0.33's `OffloadingSpec` and the primary view it
        hands its tiers.

        The geometry comes from the view, which vLLM shapes `(num_chunks, row_stride)`: a block
        here is one whole row (every worker's bytes, then the padding vLLM adds to reach its page
        size), so tiers move rows byte for byte. vLLM aligns rows to the host page size, which is
        a multiple of our 4096, so `block_stride` is the row stride. The namespace is the model
        name plus a digest of everything that decides a row's bytes (`vllm_namespace`: dtype,
        each KV-cache group's layer names, tokens per block and window, tokens per hash, blocks
        per chunk, bytes per chunk, KV layout, and the parallel layout unless vLLM declares the
        bytes parallelism-agnostic): two models, or one model with another dtype, group layout
        or parallel layout, never share blocks, while data-parallel replicas of one engine do.
        `limits` are the scheduler sizing fields (`io_threads`, `max_inflight_loads`, ...). The
        vLLM spec is kept in `vllm_config`.
        """
        try:
            view = memoryview(primary_kv_view)
        except TypeError as exc:
            raise ConfigError(f"from_vllm: primary_kv_view is not a buffer: {exc}") from exc
        shape, strides = view.shape or (), view.strides or ()
        if len(shape) != 2 or view.itemsize != 1 or strides[1] != 1:
            raise ConfigError(
                f"from_vllm: expected vLLM {VLLM_SERIES}'s primary view, 2-D bytes of shape "
                f"(num_chunks, row_stride); got shape {shape}, strides {strides}"
            )
        num_chunks, row_stride = shape[0], strides[0]
        if num_chunks < 1 or row_stride % ALIGNMENT:
            raise ConfigError(
                f"from_vllm: a primary view of {num_chunks} rows of {row_stride} bytes; "
                f"rows must be a multiple of {ALIGNMENT} bytes apart"
            )
        unknown = sorted(set(limits) - set(LIMIT_FIELDS))
        if unknown:
            raise ConfigError(f"from_vllm: unknown limits {unknown}; known: {sorted(LIMIT_FIELDS)}")
        fields: dict[str, Any] = {
            "block_nbytes": row_stride,
            "num_cpu_blocks": num_chunks,
            "block_size": _vllm_tokens_per_chunk(vllm_spec),
            "secondary_tiers": secondary_tiers,
            "namespace": vllm_namespace(vllm_spec, row_stride),
            "vllm_config": vllm_spec,
            **limits,
        }
        return cls(**fields)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> OffloadingSpec:
        """Build a spec from plain data (JSON, YAML, a vLLM `extra_config`).

        Takes the field names, plus `cpu_bytes_to_use` in place of
        `num_cpu_blocks` (`num_cpu_blocks = cpu_bytes_to_use // block_stride`).
        Unknown keys are an error, so a typo does not pass silently.
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"OffloadingSpec config must be a dict, got {type(config).__name__}")
        data = dict(config)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"cpu_bytes_to_use"})
        if unknown:
            raise ConfigError(
                f"OffloadingSpec got unknown keys {unknown}; known keys: "
                f"{sorted(known | {'cpu_bytes_to_use'})}"
            )
        if "cpu_bytes_to_use" in data:
            cpu_bytes = data.pop("cpu_bytes_to_use")
            if "num_cpu_blocks" in data:
                raise ConfigError("OffloadingSpec: give num_cpu_blocks or cpu_bytes_to_use, not both")
            _check_positive_int("cpu_bytes_to_use", cpu_bytes)
            _check_positive_int("block_nbytes", data.get("block_nbytes"))
            stride = -(-data["block_nbytes"] // ALIGNMENT) * ALIGNMENT
            if cpu_bytes < stride:
                raise ConfigError(
                    f"OffloadingSpec.cpu_bytes_to_use={cpu_bytes} holds no block of "
                    f"{stride} bytes (block_stride)"
                )
            data["num_cpu_blocks"] = cpu_bytes // stride
        for required in ("block_nbytes", "num_cpu_blocks"):
            if required not in data:
                raise ConfigError(f"OffloadingSpec.{required} is required")
        return cls(**data)


#: The vLLM release series whose `OffloadingSpec` `from_vllm` reads.
VLLM_SERIES = "0.33"


def _vllm_field(obj: Any, path: str) -> Any:
    """`obj.a.b.c` for `path` "a.b.c", or a `ConfigError` naming the field and the vLLM series expected."""
    value = obj
    for part in path.split("."):
        if not hasattr(value, part):
            raise ConfigError(
                f"from_vllm: the vLLM offloading spec has no {path!r}; kvtier_async reads vLLM "
                f"{VLLM_SERIES}'s OffloadingSpec (got {type(obj).__module__}.{type(obj).__name__})"
            )
        value = getattr(value, part)
    return value


def _vllm_tokens_per_chunk(vllm_spec: Any) -> int:
    tokens_per_block = _vllm_field(vllm_spec, "tokens_per_block")
    blocks_per_chunk = _vllm_field(vllm_spec, "blocks_per_chunk")
    tokens = max(tokens_per_block) if tokens_per_block else 0
    if not isinstance(tokens, int) or not isinstance(blocks_per_chunk, int) or tokens * blocks_per_chunk < 1:
        raise ConfigError(
            f"from_vllm: tokens_per_block={tokens_per_block!r}, blocks_per_chunk={blocks_per_chunk!r} "
            "give no tokens per chunk"
        )
    return tokens * blocks_per_chunk


def _vllm_group_layout(group: Any) -> dict[str, Any]:
    """What one KV-cache group contributes to a row's bytes.

    A row keyed with this group's index holds one block of each of the group's layers, in the
    order of `layer_names` (vLLM's worker copies `group_data_refs` in that order), so the names
    and their order decide the bytes: two engines whose groups hold other layers, even as many,
    must not share rows. vLLM's own fs tier hashes the same names into its path.
    """
    names = _vllm_field(group, "layer_names")
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"from_vllm: a group's layer_names must be a sequence of str, got {names!r}")
    return {
        "group_id": _vllm_field(group, "group_id"),
        "tokens_per_block": _vllm_field(group, "tokens_per_block"),
        "sliding_window_size_in_chunks": _vllm_field(group, "sliding_window_size_in_chunks"),
        "layer_names": list(names),
    }


def vllm_namespace(vllm_spec: Any, row_stride: int) -> str:
    """The namespace of a vLLM engine's blocks: its model name and a digest of their byte layout.

    The digest covers everything vLLM's `OffloadingConfig` holds that decides a row's bytes: the
    KV dtype, per group its index, tokens per block, sliding window and layer names in order, the
    bytes of one block per worker, tokens per hash, blocks per chunk, the row's bytes and stride,
    the KV and canonical layout, replication, and the parallel layout unless vLLM declares the
    bytes parallelism-agnostic.
    """
    model = _vllm_field(vllm_spec, "config.model.name")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"from_vllm: config.model.name must be a non-empty str, got {model!r}")
    parallel = _vllm_field(vllm_spec, "config.parallel")
    layout: dict[str, Any] = {
        "dtype": str(_vllm_field(vllm_spec, "config.model.dtype")),
        "tokens_per_block": list(_vllm_field(vllm_spec, "tokens_per_block")),
        "tokens_per_hash": _vllm_field(vllm_spec, "tokens_per_hash"),
        "blocks_per_chunk": _vllm_field(vllm_spec, "blocks_per_chunk"),
        "kv_bytes_per_chunk": _vllm_field(vllm_spec, "kv_bytes_per_chunk"),
        "row_stride": row_stride,
        "worker_kv_bytes_per_block": _vllm_field(vllm_spec, "config.worker_kv_bytes_per_block"),
        "groups": [_vllm_group_layout(g) for g in _vllm_field(vllm_spec, "config.groups")],
        "kv_cache_layout": str(_vllm_field(vllm_spec, "config.kv_cache_layout")),
        "canonical_layout": bool(_vllm_field(vllm_spec, "config.canonical_layout")),
        "replicated_layout": bool(_vllm_field(vllm_spec, "replicated_layout")),
    }
    from .integrations.model_identity import weights_identity

    weights = weights_identity(model)
    if weights is not None:  # other weights under the same name: another namespace
        layout["weights"] = weights
    if not _vllm_field(vllm_spec, "config.parallel.is_parallelism_agnostic"):
        layout["parallel"] = [
            parallel.world_size,
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
        ]
        layout["cpu_page_size_per_worker"] = _vllm_field(vllm_spec, "cpu_page_size_per_worker")
    digest = hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=8).hexdigest()
    suffix = f"|vllm-kv-{digest}"
    # Both parts are kept whole where they fit in 255 bytes; a very long model name keeps its end.
    room = 255 - len(suffix)
    name = model.encode()[-room:].decode(errors="ignore")
    return name + suffix
