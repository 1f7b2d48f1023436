"""`ObjectStoreTier`: blocks as objects in an S3-compatible store (AWS S3, MinIO, Ceph RGW), via obstore.

Each block is one object, `<prefix>/<namespace id hex>/<key hex>`, in the
self-verifying block format (a 4096-byte header with checksums, then the
payload), written in one PUT; the namespace id (BLAKE2b-128 of the namespace, as in the fs tier)
keeps any namespace string a safe path segment. A batch becomes concurrent
PUT / GET / HEAD requests, at most `max_requests` of the tier's at the server at once
(`ServerGate`: the rest wait their turn, loads first; a small server drops connections past
its backlog, and a large one throttles); a batch's blocks beyond that limit are not begun
until one of its requests ends. A store does not ask first which blocks the bucket
holds. Each block's value is copied and checksummed between its own requests, with the GIL
released (`buffers`), always on a CPU worker thread: a batch's blocks all start in the same turn
of the event loop, so per-block work done on the loop adds up there (1 MiB blocks, 4 batches of
16 in flight: 64 MiB copied into fresh memory and hashed in one turn, an 18-55 ms stall), and a
request to the store costs far more than the hand-off.
A load reads no more than a value can be: a ranged GET of one byte more than our values hold,
the size the server claims for it (`Content-Range`) checked before any of the body is read,
and the body read as a stream that stops one byte past a value (`READ_PIECE_BYTES` at a time),
whatever length the server announces or sends.
obstore retries with exponential backoff (throttling answers such as 503 SlowDown too), and
both the retries and a hard bound on each request, its wait for a place included, stay within
`timeout_s`: a KV load must not wait minutes. A store that is down or slow makes stores return
False and loads miss, counted in stats; the next call simply tries again.

The tier keeps no record of what the bucket holds.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..block_format import block_codec
from ..errors import ConfigError
from ..redact import redact_url
from ..secret import load_tier_secret
from ..server_gate import QueueTimeout, ServerGate
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager

__all__ = ["ObjectStoreTier"]

T = TypeVar("T")

# The largest object S3 takes in one PUT. A block is one object, written in one request: obstore's
# default splits values past 5 MiB into a multipart upload (four requests for an 8 MiB block, each
# billed and each counted against the bucket's request rate), and an upload cut short leaves parts
# that cost storage until a lifecycle rule removes them. One PUT is atomic and leaves nothing
# behind. (Against moto, 16 x 8 MiB at 8 at once: 0.34 GB/s in one PUT each, 0.15 GB/s multipart.)
MAX_SINGLE_PUT = 5 << 30

#: A value is read as pieces of about this many bytes (obstore turns each into a `bytes` with the
#: GIL held, so a piece is also the longest the event loop waits for one), and reading stops
#: once the pieces hold more than a value: a server that sends more is read no further.
READ_PIECE_BYTES = 1 << 20


def _check_endpoint(endpoint: str) -> None:
    """An endpoint is scheme://host[:port][/path]: credentials in it (user:password@, a signed
    query) would be in every error obstore raises, and so in logs; they belong in
    access_key_id / secret_access_key or the environment."""
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 (read for its ValueError)
    except ValueError:
        raise ConfigError(f"s3 tier: the endpoint {redact_url(endpoint)} is malformed") from None
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"s3 tier: the endpoint {redact_url(endpoint)} carries credentials (user:password@ or a "
            "query): give them as access_key_id / secret_access_key or in the environment"
        )


def _optional_str(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"s3 tier: {name} must be a non-empty str or None, got a {type(value).__name__}")


async def _outcome(request: Callable[..., Awaitable[T]], row: tuple[Any, ...]) -> Any:
    """`request(*row)`'s result, or the exception it raised (an outcome the caller counts). Caught
    here, not in the loop that calls it: the exception's traceback then holds this frame alone,
    not one that holds the outcomes list, which would make a cycle that keeps the blocks' views
    of the primary memory alive until the garbage collector finds it (vLLM cannot unmap memory
    that is still exported)."""
    try:
        return await request(*row)
    except Exception as exc:
        return exc


class ObjectStoreTier(SecondaryTierManager):
    """Blocks as objects in one bucket. Credentials not given fall back to the usual AWS
    environment variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`...).

    A `store` passed in (an `obstore.store.S3Store`, or any obstore store) is
    used as it is; the tier then ignores the connection settings.
    """

    # A HEAD per block before its PUT costs a request and a round trip, and mostly confirms
    # what the engine's lookup just found: the block is absent. A PUT of a held block rewrites
    # the same bytes, atomically. (`bench/remote_tiers.py`: stores 0.62x raw PUTs with the
    # HEADs at 1 MiB blocks.)
    check_held_before_write = False

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "s3",
        *,
        bucket: str,
        prefix: str = "",
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        allow_http: bool = False,
        timeout_s: float = 5.0,
        max_retries: int = 3,
        max_requests: int = 64,
        store: Any = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        secret: object = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        tier_secret = load_tier_secret(
            tier_type, secret_env=secret_env, secret_file=secret_file, secret=secret
        )
        if not isinstance(bucket, str) or not bucket:
            raise ConfigError("s3 tier: bucket must be a non-empty str")
        if not isinstance(prefix, str) or prefix.startswith("/") or "//" in prefix:
            raise ConfigError("s3 tier: prefix must be a str like 'a/b' (no leading '/', no empty parts)")
        for name, value in (
            ("endpoint", endpoint),
            ("region", region),
            ("access_key_id", access_key_id),
            ("secret_access_key", secret_access_key),
        ):
            _optional_str(name, value)
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError("s3 tier: give both access_key_id and secret_access_key, or neither")
        if not isinstance(allow_http, bool):
            raise ConfigError(f"s3 tier: allow_http must be True or False, got {allow_http!r}")
        if endpoint is not None:
            _check_endpoint(endpoint)
        if endpoint is not None and endpoint.startswith("http://") and not allow_http:
            raise ConfigError("s3 tier: the endpoint is plain http://; set allow_http=True to allow it")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"s3 tier: timeout_s must be a number > 0, got {timeout_s!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(f"s3 tier: max_retries must be an int >= 0, got {max_retries!r}")
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ConfigError(f"s3 tier: max_requests must be an int >= 1, got {max_requests!r}")
        self.codec = block_codec(offloading_spec.namespace, tier_secret)
        self.value_nbytes = self.codec.value_nbytes(self.block_nbytes)
        if self.value_nbytes > MAX_SINGLE_PUT:
            raise ConfigError(
                f"s3 tier: a block of {self.block_nbytes} bytes is past the 5 GiB of an object in one PUT"
            )
        self.bucket = bucket
        #: The endpoint as it may be shown (`redact_url`): its own credentials never are.
        self.endpoint = None if endpoint is None else redact_url(endpoint)
        self.timeout_s = float(timeout_s)
        self._config = {
            name: value
            for name, value in (
                ("endpoint", endpoint),
                ("region", region),
                ("access_key_id", access_key_id),
                ("secret_access_key", secret_access_key),
            )
            if value is not None
        }
        self._allow_http = allow_http
        self._max_retries = max_retries
        self._store = store
        self._own_store = False  # made by the tier (not passed in): its bucket is checked at start
        parts = [p for p in prefix.strip("/").split("/") if p] + [self.codec.namespace_tag.hex()]
        self._name_prefix = "/".join(parts) + "/"
        # obstore's retries stop within timeout_s; the gate's deadline also bounds a request
        # that hangs anyway, and the wait for a place.
        self.gate = ServerGate(f"{tier_type}/server", max_requests, 1.5 * self.timeout_s)

    def object_name(self, key: bytes) -> str:
        """The object a block is stored as (its name keyed with a secret)."""
        return self._name_prefix + self.codec.name(key).hex()

    # -- opening ---------------------------------------------------------------------------------
    async def open_backend(self) -> None:
        if self._store is None:
            # On a worker thread: building the store reads the environment and may read files.
            self._store = await self.run_blocking(self._make_store)
            self._own_store = True

    async def check_config(self) -> None:
        # docstring inherited
        if self._own_store:
            await self._request(self._check_bucket())

    async def _check_bucket(self) -> None:
        """A bucket that does not exist can never hold a block: a `ConfigError`. A LIST of at
        most one name under the tier's prefix, since a HEAD answers a missing bucket as it does
        a missing object; any other fault may pass."""
        import obstore
        from obstore.exceptions import BaseError, NotFoundError

        try:
            await obstore.list(self._store, prefix=self._name_prefix, chunk_size=1).__anext__()
        except StopAsyncIteration:
            pass  # the bucket exists, and holds nothing of ours yet
        except (NotFoundError, BaseError) as exc:
            # Only S3's own answer: a proxy's 404 while its backend starts may pass.
            if "NoSuchBucket" in str(exc):
                raise ConfigError(
                    f"s3 tier: the bucket {self.bucket!r} does not exist; create it first"
                ) from None
            raise

    def _make_store(self) -> Any:
        from obstore.store import S3Store

        config = dict(self._config)
        if not {"region", "AWS_REGION", "AWS_DEFAULT_REGION"} & (set(config) | set(os.environ)):
            config["region"] = "us-east-1"  # what S3-compatible servers expect when none is set
        timeout = timedelta(seconds=self.timeout_s)
        return S3Store(
            self.bucket,
            config=config,  # type: ignore[arg-type]
            client_options={"allow_http": self._allow_http, "timeout": timeout, "connect_timeout": timeout},
            retry_config={
                "max_retries": self._max_retries,
                "retry_timeout": timeout,
                "backoff": {
                    "init_backoff": timedelta(milliseconds=50),
                    "max_backoff": timedelta(seconds=max(0.05, self.timeout_s / 4)),
                    "base": 2,
                },
            },
        )

    # -- the hooks -------------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        await self._ready()
        replies = await self._each(self._put, keys, blocks)
        self._count_failures(replies)
        return [not isinstance(reply, BaseException) for reply in replies]

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        await self._ready()
        replies = await self._each(self._get_into, keys, blocks)
        self._count_failures(replies)
        return [reply is True for reply in replies]

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        await self._ready()
        replies = await self._each(self._head, keys)
        self._count_failures(replies)
        return [reply is True for reply in replies]

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        import obstore

        held = [key for key, present in zip(keys, await self.contains(keys)) if present]
        if held:
            await self._request(obstore.delete_async(self._store, [self.object_name(k) for k in held]))
            self.notify_removed(held)
        return len(held)

    def backend_stats(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "endpoint": self.endpoint,
            "sealed": self.codec.sealed,
            "corrupt_blocks": self.counters["corrupt_blocks"],
            "unauthenticated_blocks": self.counters["unauthenticated_blocks"],
            "request_failures": self.counters["request_failures"],
            "server_gate": self.gate.stats(),
        }

    # -- internals -------------------------------------------------------------------------------
    # Each block on its own from here: its copy and checksum overlap the other blocks' requests.
    async def _put(self, key: bytes, block: memoryview) -> None:
        import obstore

        [value] = await self.scheduler.run_cpu(self.codec.encode_values, [key], [block])
        await self._request(obstore.put_async(self._store, self.object_name(key), value, use_multipart=False))

    async def _get_into(self, key: bytes, block: memoryview) -> bool:
        """Whether `block` now holds the stored block's exact bytes (False: absent or corrupt)."""
        value = await self._request(self._get(key))
        if value is None:
            return False
        [ok] = await self.scheduler.run_cpu(self.codec.decode_values, [key], [value], [block])
        self.counters[self.codec.failure_counter] += not ok
        return ok

    async def _get(self, key: bytes) -> Any:
        """The object's bytes as consecutive pieces (None: absent; b"": not of our values'
        length, read no further). A ranged GET of a byte more than our values hold, whatever
        the bucket holds; the size the server claims checked first, then the body read a piece
        at a time, and no further once it is longer than a value, whatever the server sends."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            result = await obstore.get_async(
                self._store, self.object_name(key), options={"range": (0, self.value_nbytes + 1)}
            )
            # The size and range come from Content-Range. The Content-Length cannot be checked
            # first: obstore's GetResult (0.12) shows `meta`, `range` and `attributes`, none of
            # them it, and its stream goes on past that range to the length the response
            # announces (tried: 64 MiB sent for a 1 MiB range). The cut below bounds the read.
            if result.meta["size"] != self.value_nbytes or tuple(result.range) != (0, self.value_nbytes):
                return b""
            pieces, received = [], 0
            async for piece in result.stream(min_chunk_size=min(READ_PIECE_BYTES, self.value_nbytes + 1)):
                pieces.append(piece)
                received += len(piece)
                if received > self.value_nbytes:
                    return b""  # more than it claimed: the rest is never read
            return pieces if received == self.value_nbytes else b""
        except (NotFoundError, FileNotFoundError):
            return None

    async def _head(self, key: bytes) -> bool:
        return await self._request(self._exists(key))

    async def _exists(self, key: bytes) -> bool:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            await obstore.head_async(self._store, self.object_name(key))
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    async def _ready(self) -> None:
        """Open first (hooks may be called directly); the requests then find the store."""
        if not await self._ensure_open():
            raise ConnectionError(f"s3 tier {self.name!r}: the store could not be set up")

    async def _each(self, request: Callable[..., Awaitable[T]], *columns: Sequence[Any]) -> list[Any]:
        """`request(*row)` for each row of `columns`: its outcomes in order, a failure as its
        exception. At most the gate's limit of them at once, each task taking the next row when
        its last one ends: the others could only wait at the gate, and a task, coroutines and
        a gate waiter each (a batch of 256 blocks of 64 KiB, 8 loads in flight: 2,048 of each)
        were young objects enough to bring on collections of the garbage collector."""
        rows = list(zip(*columns))
        replies: list[Any] = [None] * len(rows)
        todo = iter(range(len(rows)))  # shared: each task takes the next row not begun

        async def take_turns() -> None:
            for i in todo:
                replies[i] = await _outcome(request, rows[i])

        await asyncio.gather(*(take_turns() for _ in range(min(len(rows), self.gate.limit))))
        return replies

    async def _request(self, call: Awaitable[T]) -> T:
        """One request to the server, through the gate, within the deadline."""
        return await self.gate.call(call)

    def _count_failures(self, replies: Sequence[object]) -> None:
        """Count failed requests; if every one failed, the store is unreachable: raise (an error;
        a wait for our own limit only if no request reached the server)."""
        failed = [reply for reply in replies if isinstance(reply, BaseException)]
        self.counters["request_failures"] += len(failed)
        if failed and len(failed) == len(replies):
            raise next((e for e in failed if not isinstance(e, QueueTimeout)), failed[0])
