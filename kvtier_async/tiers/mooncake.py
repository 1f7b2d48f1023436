"""`MooncakeTier`: blocks in a Mooncake Store pool (a `mooncake_master` and the memory segments its
clients contribute), shared by every instance using the same master.

Each block is one object, `<prefix>:<namespace id hex>:<name hex>`, in the self-verifying block
format (`block_format`: a 4096-byte header with checksums, then the payload; with a secret, the
sealed AES-256-GCM format under a keyed name), so a value that was changed, truncated, evicted
meanwhile or written for another namespace or secret reads as a miss, counted.

Zero copy where Mooncake allows it: the primary memory is registered with the client once
(`register_buffer`); a store sends each block's header from a small registered pool and its
payload straight from its primary slot (`batch_put_from_multi_buffers`), and a load lands them
the same way (`batch_get_into_multi_buffers`), the payload straight in its slot, then checked.
With a secret, values are sealed into, and read into, one registered staging pool (`SlotPool`,
made when the tier opens), since a sealed value is not the block's bytes.

What Mooncake 0.3.13 does, and what we do about it (measured here; docs/tiers/mooncake.md):

- `setup()` against a master port nobody listens on retries for ~90 s holding the GIL: nothing
  on the event loop or in another thread runs meanwhile. So the tier opens a TCP connection to
  the master (and to an HTTP metadata server) first, bounded by `timeout_s`, and calls `setup`
  only once that succeeded; the error names the address.
- Every client call blocks: each runs on the scheduler's worker threads, never the loop.
- Closing a client holds the GIL for 1-2.5 s, and each client mounts a segment of its own: the
  tiers of a process with the same options share one client (`mooncake_clients`).
- A read's size is never trusted: a value larger than our buffers is refused by the client
  (-600), a shorter one fails the transfer or returns its own size, checked.
- `put` of a name that exists keeps the old value. A load that finds a value that fails its
  checks removes it (`force`), so that the next store of that block writes it again.
- An object lives in one client's segment: when that client exits, it is gone (loads fail at
  once, a counted miss) although `is_exist` may answer 1 until the master's `client_ttl`; a
  lookup may over-count, the load's own checks decide.
- The master evicts by its own watermarks: a stored block can vanish at any time (a miss).
  There is no byte capacity per client: `capacity_bytes` is refused.
- Every `get` takes a lease (10 s by default) during which a plain `remove` fails: `delete`
  forces removal. A reader whose object is removed mid-read gets bytes that fail their checks.
- The master down: each call fails at once or after up to ~4 s of retries, with an RPC error;
  the tier counts it as a fault and its fault breaker then fails calls at once for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from ..block_format import HEADER_BYTES, BlockSealer, encode_header, verify_block
from ..block_format import block_codec as make_block_codec
from ..buffers import address_of, copy_into
from ..errors import ConfigError
from ..secret import load_tier_secret
from ..slot_pool import SlotPool, for_batches_in_flight
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager
from . import mooncake_clients as clients

__all__ = ["MooncakeTier"]

#: Mooncake's answers (`mooncake/store` error codes) that we tell apart.
NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
RPC_FAILED = -900

#: With a secret, sealed values are built and read in a registered pool of at most this many
#: bytes (and of one batch of values at least).
SEALED_POOL_BYTES = 64 << 20


def _host_port(what: str, value: object) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"mooncake tier: {what} must be 'HOST:PORT', got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"mooncake tier: {what} must be 'HOST:PORT', got {value!r}")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MooncakeTier(SecondaryTierManager):
    """Blocks as objects in a Mooncake Store pool, reached through the master at `master`.

    `segment_bytes` is the memory this process gives the pool (0: it stores into others'
    segments only); objects stored in it are lost when the client closes, with the last tier
    of this process using it (`mooncake_clients`). `replicas` copies of
    each block are placed (fewer when the pool has fewer segments). `metadata` is
    "P2PHANDSHAKE" or the transfer engine's HTTP metadata server URL; `local_hostname` is the
    address other clients reach this one at (needed unless the master is on loopback).
    """

    # A put of a held name returns at once, keeping the value held: asking first costs a round trip.
    check_held_before_write = False

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "mooncake",
        *,
        master: str,
        segment_bytes: int | None = None,
        metadata: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device: str = "",
        local_hostname: str | None = None,
        replicas: int = 1,
        prefix: str = "kvtier",
        timeout_s: float = 5.0,
        capacity_bytes: object = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        secret: object = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        tier_secret = load_tier_secret(
            tier_type, secret_env=secret_env, secret_file=secret_file, secret=secret
        )
        if capacity_bytes is not None:
            raise ConfigError(
                "mooncake tier: capacity_bytes is not supported: the master evicts by its own "
                "watermarks over the whole pool; size the pool with each client's segment_bytes"
            )
        self._master_host, self._master_port = _host_port("master", master)
        self.master = master
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 0:
            raise ConfigError(
                "mooncake tier: segment_bytes (the memory this process gives the pool; 0: none) "
                f"must be an int >= 0, got {segment_bytes!r}"
            )
        self.segment_bytes = segment_bytes
        self._metadata_probe: tuple[str, int] | None = None
        if metadata != "P2PHANDSHAKE":
            if not isinstance(metadata, str):
                raise ConfigError("mooncake tier: metadata must be 'P2PHANDSHAKE' or an http:// URL")
            try:
                parts = urlsplit(metadata)
                port = parts.port
            except ValueError:
                raise ConfigError("mooncake tier: the metadata URL is malformed") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError("mooncake tier: metadata must be 'P2PHANDSHAKE' or an http:// URL")
            default_port = 443 if parts.scheme == "https" else 80
            self._metadata_probe = (parts.hostname, port or default_port)
        self.metadata = metadata
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake tier: protocol must be 'tcp' or 'rdma', got {protocol!r}")
        self.protocol = protocol
        if not isinstance(device, str):
            raise ConfigError(f"mooncake tier: device must be a str (RDMA device names), got {device!r}")
        self._device = device
        if local_hostname is None:
            if not _is_loopback(self._master_host):
                raise ConfigError(
                    "mooncake tier: local_hostname (the address other clients reach this one at) "
                    "is needed when the master is on another machine"
                )
            local_hostname = "127.0.0.1"
        if not isinstance(local_hostname, str) or not local_hostname:
            raise ConfigError(
                f"mooncake tier: local_hostname must be a non-empty str, got {local_hostname!r}"
            )
        self.local_hostname = local_hostname
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"mooncake tier: replicas must be an int >= 1, got {replicas!r}")
        self.replicas = replicas
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"mooncake tier: prefix must be a non-empty str, got {prefix!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"mooncake tier: timeout_s must be a number > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.codec = make_block_codec(offloading_spec.namespace, tier_secret)
        self.value_nbytes = self.codec.value_nbytes(self.block_nbytes)
        self._name_prefix = f"{prefix}:{self.codec.namespace_tag.hex()}:"
        self._options = clients.ClientOptions(
            master=master,
            segment_bytes=segment_bytes,
            metadata=metadata,
            protocol=protocol,
            device=device,
            local_hostname=local_hostname,
        )
        self._shared: clients.SharedClient | None = None
        self._client: Any = None
        self._put_config: Any = None
        #: Registered memory values are staged in: headers (plain) or sealed values (a secret).
        self._staging: SlotPool | None = None

    def value_name(self, key: bytes) -> str:
        """The name a block is stored under in the pool (keyed with a secret)."""
        return self._name_prefix + self.codec.name(key).hex()

    # -- opening and closing -------------------------------------------------------------------
    async def open_backend(self) -> None:
        # Mooncake's setup() against a closed port holds the GIL for ~90 s: reach the ports first.
        await self._probe("master", self._master_host, self._master_port)
        if self._metadata_probe is not None:
            await self._probe("metadata server", *self._metadata_probe)
        store = await self.run_blocking(clients.import_store)
        if self.codec.sealed:
            staging = for_batches_in_flight(self.offloading_spec.limits, self.value_nbytes, SEALED_POOL_BYTES)
        else:
            staging = for_batches_in_flight(self.offloading_spec.limits, HEADER_BYTES, 1 << 30)
        await self.run_blocking(staging.populate)
        shared = await self.run_blocking(clients.acquire, self._options)
        memory = [(address_of(view), view.nbytes) for view in (self.primary_kv_view, staging.view)]
        registered: list[tuple[int, int]] = []
        try:
            for address, nbytes in memory:
                await self.run_blocking(shared.register, address, nbytes)
                registered.append((address, nbytes))
        except BaseException:
            await self.run_blocking(self._let_go, shared, registered)
            raise
        config = store.ReplicateConfig()
        config.replica_num = self.replicas
        self._shared, self._client, self._put_config, self._staging = shared, shared.client, config, staging

    def _let_go(self, shared: clients.SharedClient, registered: list[tuple[int, int]]) -> None:
        """Unregister our memory and release the client (blocking: the last user closes it)."""
        for address, nbytes in registered:
            shared.unregister(address, nbytes)
        clients.release(self._options)

    async def _probe(self, what: str, host: str, port: int) -> None:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            reason = "no answer" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
            raise ConnectionError(
                f"mooncake tier: the {what} at {host}:{port} is not reachable over TCP "
                f"within {self.timeout_s:g} s ({reason})"
            ) from None
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    async def close_backend(self) -> None:
        if self._shared is not None and self._staging is not None:
            shared, self._shared, self._client = self._shared, None, None
            memory = [(address_of(view), view.nbytes) for view in (self.primary_kv_view, self._staging.view)]
            await self.run_blocking(self._let_go, shared, memory)

    # -- the hooks -----------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        client, pool = await self._ready()
        names = [self.value_name(key) for key in keys]
        codes: list[int] = []
        slot_nbytes = self.value_nbytes if self.codec.sealed else HEADER_BYTES
        for part in pool.parts(len(keys)):
            async with pool.borrowed(len(names[part]), slot_nbytes) as slots:
                codes += await self.run_blocking(
                    self._put, client, keys[part], blocks[part], names[part], slots
                )
        self._check_reached(codes)
        refused = [code for code in codes if code != 0]
        if refused:  # e.g. no segment with room (the pool full, or none mounted)
            self.counters["writes_refused"] += len(refused)
            self.fault_log.warning(
                ("refused", refused[0]),
                "tier %r: the pool refused %d of %d writes (Mooncake error %d)",
                self.name,
                len(refused),
                len(codes),
                refused[0],
            )
        return [code == 0 for code in codes]

    def _put(
        self,
        client: Any,
        keys: Sequence[bytes],
        blocks: Sequence[memoryview],
        names: list[str],
        slots: list[memoryview],
    ) -> list[int]:
        """Seal into the slots or write headers there, then one batch put (a worker thread's work)."""
        if isinstance(self.codec, BlockSealer):
            self.codec.seal_many(keys, blocks, slots)
            return list(
                client.batch_put_from(
                    names, [address_of(v) for v in slots], [self.value_nbytes] * len(names), self._put_config
                )
            )
        namespace = self.codec.namespace_tag
        for key, block, header in zip(keys, blocks, slots):
            copy_into(header, encode_header(block, namespace=namespace, key=key))
        return list(
            client.batch_put_from_multi_buffers(
                names,
                [[address_of(h), address_of(b)] for h, b in zip(slots, blocks)],
                [[HEADER_BYTES, self.block_nbytes]] * len(names),
                self._put_config,
            )
        )

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        client, pool = await self._ready()
        names = [self.value_name(key) for key in keys]
        codes: list[int] = []
        ok: list[bool] = []
        slot_nbytes = self.value_nbytes if self.codec.sealed else HEADER_BYTES
        for part in pool.parts(len(keys)):
            async with pool.borrowed(len(names[part]), slot_nbytes) as slots:
                got, good = await self.run_blocking(
                    self._get, client, keys[part], blocks[part], names[part], slots
                )
            codes += got
            ok += good
        self._check_reached(codes)
        # Landed whole but failed its checks, or larger than ours: not a value of ours.
        bad = [
            name
            for name, code, good in zip(names, codes, ok)
            if not good and (code > 0 or code == BUFFER_TOO_SMALL)
        ]
        self.counters[self.codec.failure_counter] += len(bad)
        self.counters["absent_blocks"] += codes.count(NOT_FOUND)
        self.counters["read_failures"] += sum(
            code < 0 and code not in (NOT_FOUND, BUFFER_TOO_SMALL) for code in codes
        )
        if bad:  # a put would keep it: removed, so that the next store writes the block again
            removed = await self.run_blocking(client.batch_remove, bad, True)
            self.counters["bad_values_removed"] += sum(code == 0 for code in removed)
        return ok

    def _get(
        self,
        client: Any,
        keys: Sequence[bytes],
        blocks: Sequence[memoryview],
        names: list[str],
        slots: list[memoryview],
    ) -> tuple[list[int], list[bool]]:
        """One batch get into the blocks (headers into the slots) or, sealed, into the slots,
        then every value checked (a worker thread's work). Each value's size, then whether it
        is the exact block."""
        n = len(names)
        if isinstance(self.codec, BlockSealer):
            codes = list(
                client.batch_get_into(names, [address_of(v) for v in slots], [self.value_nbytes] * n)
            )
            return codes, [
                code == self.value_nbytes and self.codec.open_into(block, value, key)
                for key, block, value, code in zip(keys, blocks, slots, codes)
            ]
        codes = list(
            client.batch_get_into_multi_buffers(
                names,
                [[address_of(h), address_of(b)] for h, b in zip(slots, blocks)],
                [[HEADER_BYTES, self.block_nbytes]] * n,
            )
        )
        namespace = self.codec.namespace_tag
        return codes, [
            code == self.value_nbytes and verify_block(header, block, namespace=namespace, key=key)
            for key, block, header, code in zip(keys, blocks, slots, codes)
        ]

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        client, _ = await self._ready()
        codes = await self.run_blocking(client.batch_is_exist, [self.value_name(key) for key in keys])
        self._check_reached(codes)
        return [code == 1 for code in codes]

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        client, _ = await self._ready()
        # Forced: a plain remove fails for as long as a recent get's lease runs (10 s by default).
        codes = await self.run_blocking(client.batch_remove, [self.value_name(key) for key in keys], True)
        self._check_reached(codes)
        removed = [key for key, code in zip(keys, codes) if code == 0]
        self.notify_removed(removed)
        return len(removed)

    def backend_stats(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "metadata": self.metadata,
            "protocol": self.protocol,
            "replicas": self.replicas,
            "segment_bytes": self.segment_bytes,
            "sealed": self.codec.sealed,
            "corrupt_blocks": self.counters["corrupt_blocks"],
            "unauthenticated_blocks": self.counters["unauthenticated_blocks"],
            "absent_blocks": self.counters["absent_blocks"],
            "read_failures": self.counters["read_failures"],
            "bad_values_removed": self.counters["bad_values_removed"],
            "writes_refused": self.counters["writes_refused"],
            "staging_bytes": 0 if self._staging is None else self._staging.nbytes,
        }

    # -- internals -----------------------------------------------------------------------------
    async def _ready(self) -> tuple[Any, SlotPool]:
        """Open first (hooks may be called directly); the client and its staging pool."""
        if not await self._ensure_open() or self._client is None or self._staging is None:
            raise ConnectionError(
                f"mooncake tier {self.name!r}: not connected to the master at {self.master}"
            )
        return self._client, self._staging

    def _check_reached(self, codes: Sequence[int]) -> None:
        """A call the master did not answer at all is a fault (counted; the fault breaker
        decides when to try again), not a batch of misses."""
        if codes and all(code == RPC_FAILED for code in codes):
            raise ConnectionError(f"mooncake tier {self.name!r}: the master at {self.master} does not answer")
