"""Tenants sharing one Redis server, bucket or fs root: with a tier secret, whoever can read or
write the store (but lacks the secret) learns nothing from names or values and cannot make a
tier load bytes they chose. Each attack runs against the real server or file system."""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import obstore
import pytest
import pytest_asyncio
import redis.asyncio
import servers
from obstore.store import S3Store

import kvtier_async as kt
import kvtier_async.tiers.fs
import kvtier_async.tiers.object_store
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.block_format import encode_block, namespace_id, sealed_fingerprint
from kvtier_async.secret import new_secret
from kvtier_async.testing import make_key
from kvtier_async.tiers.fs.layout import Folder, encode_entry, read_log

NAMESPACE = "tenant-a/llama-3-8b"
BLOCK = 2 * 4096 + 136
SLOTS = 16


class RawStore(Protocol):
    """The store as an attacker with read and write access sees it (no secret)."""

    async def items(self) -> dict[bytes, bytes]: ...

    async def put(self, name: bytes, value: bytes) -> None: ...

    async def aclose(self) -> None: ...


class RedisRaw:
    def __init__(self, url: str, prefix: str, cluster: bool) -> None:
        if cluster:
            self.client: Any = redis.asyncio.RedisCluster.from_url(url)
        else:
            self.client = redis.asyncio.Redis.from_url(url, driver_info=None)
        self.prefix = prefix.encode()

    async def items(self) -> dict[bytes, bytes]:
        names = [name async for name in self.client.scan_iter(match=self.prefix + b"*")]
        return {name: await self.client.get(name) for name in names}

    async def put(self, name: bytes, value: bytes) -> None:
        await self.client.set(name, value)

    async def aclose(self) -> None:
        await self.client.aclose()


class S3Raw:
    def __init__(self, endpoint: str, prefix: str) -> None:
        self.store = S3Store(
            servers.S3_BUCKET,
            config={**servers.S3_CREDENTIALS, "endpoint": endpoint, "region": "us-east-1"},
            client_options={"allow_http": True},
        )
        self.prefix = prefix

    async def items(self) -> dict[bytes, bytes]:
        out = {}
        async for batch in obstore.list(self.store, prefix=self.prefix):
            for meta in batch:
                got = await obstore.get_async(self.store, meta["path"])
                out[meta["path"].encode()] = bytes(await got.bytes_async())
        return out

    async def put(self, name: bytes, value: bytes) -> None:
        await obstore.put_async(self.store, name.decode(), value)

    async def aclose(self) -> None:
        pass


@pytest.fixture(params=["redis", "redis-cluster", "s3"])
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], RawStore]:
    """A shared store's tier config (no secret yet) and the raw view of it."""
    prefix = f"tenants-{uuid.uuid4().hex[:12]}"
    if request.param == "s3":
        server: Any = request.getfixturevalue("s3_server")
        config = {
            "type": "s3",
            "bucket": servers.S3_BUCKET,
            "prefix": prefix,
            "endpoint": server.endpoint,
            "allow_http": True,
            **servers.S3_CREDENTIALS,
        }
        return config, S3Raw(server.endpoint, prefix)
    cluster = request.param == "redis-cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    return {"type": "redis", "url": server.url, "cluster": cluster, "prefix": prefix}, RedisRaw(
        server.url, prefix, cluster
    )


@pytest.fixture
def secrets_env(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    monkeypatch.setenv("KVTIER_TENANT_A", new_secret())
    monkeypatch.setenv("KVTIER_TENANT_B", new_secret())
    return "KVTIER_TENANT_A", "KVTIER_TENANT_B"


@pytest.fixture
def spec() -> kt.OffloadingSpec:
    return kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=SLOTS, namespace=NAMESPACE)


@pytest_asyncio.fixture
async def primary(spec: kt.OffloadingSpec) -> AsyncIterator[kt.PrimaryTier]:
    yield kt.PrimaryTier(spec, pin_memory=False)


def make_tier(config: dict[str, Any], primary: kt.PrimaryTier, spec: kt.OffloadingSpec) -> Any:
    return kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)


def fill(primary: kt.PrimaryTier, slots: range) -> list[bytes]:
    payloads = []
    for slot in slots:
        data = os.urandom(BLOCK)
        primary.slot_view(slot)[:] = data
        payloads.append(data)
    return payloads


def read(primary: kt.PrimaryTier, slots: range) -> list[bytes]:
    return [bytes(primary.slot_view(slot)) for slot in slots]


def assert_nothing_in_clear(stored: dict[bytes, bytes], keys: list[bytes], payloads: list[bytes]) -> None:
    """No name or value holds the namespace id, a key, or any 64-byte run of a payload."""
    ns = namespace_id(NAMESPACE)
    assert stored
    for name, value in stored.items():
        for secret_bit in (ns, ns.hex().encode(), *keys, *(k.hex().encode() for k in keys)):
            assert secret_bit not in name and secret_bit not in value
        for payload in payloads:
            # Any run of the payload in clear holds a 64-byte piece at a multiple of 64 of it.
            assert not any(payload[i : i + 64] in value for i in range(0, len(payload) - 63, 64))


def name_of(tier: Any, key: bytes) -> bytes:
    """The name a Redis or S3 tier stores `key` under, as the raw store lists it."""
    if hasattr(tier, "value_name"):
        return bytes(tier.value_name(key))
    return str(tier.object_name(key)).encode()


@pytest.mark.asyncio
async def test_shared_store_with_a_secret(
    shared: tuple[dict[str, Any], RawStore],
    secrets_env: tuple[str, str],
    spec: kt.OffloadingSpec,
    primary: kt.PrimaryTier,
) -> None:
    base, raw = shared
    try:
        await shared_store_attacks(base, raw, secrets_env, spec, primary)
    finally:
        await raw.aclose()


async def shared_store_attacks(
    base: dict[str, Any],
    raw: RawStore,
    secrets_env: tuple[str, str],
    spec: kt.OffloadingSpec,
    primary: kt.PrimaryTier,
) -> None:
    env_a, env_b = secrets_env
    keys = [make_key(i) for i in range(4)]
    async with make_tier({**base, "secret_env": env_a}, primary, spec) as tier_a:
        payloads = fill(primary, range(4))
        assert await tier_a.store(keys, list(range(4))) == [True] * 4
        stored = await raw.items()
        assert len(stored) == 4
        assert_nothing_in_clear(stored, keys, payloads)

        # Another tenant: same server, prefix, namespace and keys, another secret.
        async with make_tier({**base, "secret_env": env_b}, primary, spec) as tier_b:
            assert await tier_b.lookup(keys) == 0
            assert await tier_b.load(keys, list(range(8, 12))) == [False] * 4
            fill(primary, range(4, 8))
            assert await tier_b.store(keys, list(range(4, 8))) == [True] * 4
        # ...and a tier without a secret sees none of it.
        async with make_tier(base, primary, spec) as plain:
            assert await plain.lookup(keys) == 0
            assert await plain.load(keys, list(range(8, 12))) == [False] * 4
        assert await tier_a.load(keys, list(range(8, 12))) == [True] * 4
        assert read(primary, range(8, 12)) == payloads

        # An attacker with write access: swap two values, flip a byte of a third, and put a
        # block in the no-secret format (checksums right) under the fourth's name.
        names = sorted(name for name in stored)
        by_name = {name: value for name, value in stored.items()}
        a, b, c, d = names
        await raw.put(a, by_name[b])
        await raw.put(b, by_name[a])
        flipped = bytearray(by_name[c])
        flipped[len(flipped) // 2] ^= 1
        await raw.put(c, bytes(flipped))
        forged = os.urandom(BLOCK)
        d_key = next(k for k in keys if name_of(tier_a, k) == d)
        await raw.put(
            d, bytes(encode_block(memoryview(forged), namespace=namespace_id(NAMESPACE), key=d_key))
        )
        before = tier_a.stats()["unauthenticated_blocks"]
        for key in keys:
            assert await tier_a.load([key], [12]) == [False]
            assert bytes(primary.slot_view(12)) != forged
        assert tier_a.stats()["unauthenticated_blocks"] - before == 4


@pytest.mark.asyncio
async def test_shared_fs_root_with_a_secret(
    tmp_path: Path, secrets_env: tuple[str, str], spec: kt.OffloadingSpec, primary: kt.PrimaryTier
) -> None:
    env_a, env_b = secrets_env
    base = {"type": "fs", "root": str(tmp_path / "root"), "capacity_bytes": 4 << 20}
    keys = [make_key(i) for i in range(4)]
    async with make_tier({**base, "secret_env": env_a}, primary, spec) as tier_a:
        payloads = fill(primary, range(4))
        assert await tier_a.store(keys, list(range(4))) == [True] * 4
        directory = tier_a.directory
        record_bytes, stored_nbytes = tier_a.record_bytes, tier_a.stored_nbytes
    files = await asyncio.to_thread(lambda: {p.name.encode(): p.read_bytes() for p in directory.iterdir()})
    files[directory.name.encode()] = b""
    assert_nothing_in_clear(files, keys, payloads)
    [data] = [v for k, v in files.items() if k.endswith(b".kvs")]
    for start in range(0, len(data), record_bytes):  # a record's padding: zeros, nothing else
        assert not any(data[start + stored_nbytes : start + record_bytes])
    assert NAMESPACE.encode() not in b"".join(files.values())

    async with make_tier({**base, "secret_env": env_b}, primary, spec) as tier_b:
        assert await tier_b.lookup(keys) == 0
        fill(primary, range(4, 8))
        assert await tier_b.store(keys, list(range(4, 8))) == [True] * 4
    async with make_tier(base, primary, spec) as plain:
        assert await plain.lookup(keys) == 0

    # An attacker who can write the root rewrites records *and* their index entries, so the
    # index's checksums pass: swap two records, flip a byte of a third, put plain bytes in a fourth.
    await asyncio.to_thread(tamper, directory, record_bytes, stored_nbytes)
    async with make_tier({**base, "secret_env": env_a}, primary, spec) as again:
        assert await again.lookup(keys) == 4  # the names are there...
        assert await again.load(keys, list(range(8, 12))) == [False] * 4  # ...the blocks are not
        assert again.stats()["unauthenticated_blocks"] == 4


def tamper(directory: Path, record_bytes: int, stored_nbytes: int) -> None:
    [data] = directory.glob("slab-*.kvs")
    log = data.with_suffix(".idx")
    with Folder.open(directory) as folder:
        entries, _, _ = read_log(folder / log.name)
    live = {e.record: e for e in entries if not e.deleted}
    assert len(live) == 4
    r = sorted(live)
    with open(data, "r+b") as f:
        records = {}
        for n in r:
            f.seek(n * record_bytes)
            records[n] = f.read(record_bytes)
        flipped = bytearray(records[r[2]])
        flipped[100] ^= 1
        new = {r[0]: records[r[1]], r[1]: records[r[0]], r[2]: bytes(flipped)}
        new[r[3]] = os.urandom(BLOCK).ljust(record_bytes, b"\0")
        for n, value in new.items():
            f.seek(n * record_bytes)
            f.write(value)
    seq = max(e.seq for e in entries)
    with open(log, "ab") as f:
        for i, (n, value) in enumerate(new.items(), 1):
            f.write(encode_entry(seq + i, n, live[n].key, sealed_fingerprint(value[:stored_nbytes])))


@pytest.mark.parametrize("tier_type", ["fs", "redis", "s3"])
def test_secret_sources_are_checked_and_never_shown(
    tier_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: kt.OffloadingSpec
) -> None:
    primary = kt.PrimaryTier(spec, pin_memory=False)
    base: dict[str, Any] = {
        "fs": {"type": "fs", "root": str(tmp_path / "root")},
        "redis": {"type": "redis", "url": "redis://127.0.0.1:1/0"},
        "s3": {"type": "s3", "bucket": "b"},
    }[tier_type]
    value = new_secret()
    monkeypatch.setenv("KVTIER_SHORT", "x" * 31)
    # Weak secrets that pass the length check: one byte repeated, a few bytes cycled, in hex too.
    monkeypatch.setenv("KVTIER_REPEATED", "a" * 32)
    monkeypatch.setenv("KVTIER_CYCLED", "abcdefghijklmn" * 3)
    monkeypatch.setenv("KVTIER_HEX_CYCLED", "00112233445566778899aabbccdd" * 2)
    monkeypatch.setenv("KVTIER_GOOD", value)
    good_file = tmp_path / "secret"
    good_file.write_text(value + "\n")
    good_file.chmod(0o600)
    open_file = tmp_path / "open-secret"
    open_file.write_text(value)
    open_file.chmod(0o644)
    link = tmp_path / "link"
    link.symlink_to(good_file)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    long_file = tmp_path / "long-secret"  # a regular file, too long to be a secret
    long_file.write_text(value * 100)
    long_file.chmod(0o600)
    bad = [
        ({"secret": value}, "inline"),
        ({"secret_env": "KVTIER_GOOD", "secret_file": str(good_file)}, "not both"),
        ({"secret_env": "KVTIER_NOT_SET_ANYWHERE"}, "not set"),
        ({"secret_env": "KVTIER_SHORT"}, "shorter than 32 bytes"),
        ({"secret_file": str(tmp_path / "missing")}, "cannot open"),
        ({"secret_file": str(open_file)}, "open to group or others"),
        ({"secret_file": str(link)}, "cannot open"),
        ({"secret_file": str(fifo)}, "not a regular file"),
        ({"secret_file": str(long_file)}, "longer than 4096 bytes"),
        ({"secret_env": "KVTIER_REPEATED"}, "obviously weak.*kvtier secret new"),
        ({"secret_env": "KVTIER_CYCLED"}, "obviously weak"),
        ({"secret_env": "KVTIER_HEX_CYCLED"}, "obviously weak"),
        # A pseudo-file of ours, mode 0400, that stat() calls regular and empty: the environment.
        ({"secret_file": "/proc/self/environ"}, "not a regular file"),
    ]
    for extra, message in bad:
        with pytest.raises(kt.ConfigError, match=message) as caught:
            make_tier({**base, **extra}, primary, spec)
        assert value not in str(caught.value) and "x" * 31 not in str(caught.value)
    for extra in ({"secret_env": "KVTIER_GOOD"}, {"secret_file": str(good_file)}):
        tier = make_tier({**base, **extra}, primary, spec)
        assert tier.stats()["sealed"] is True
        assert value not in repr(tier.stats()) and value not in repr(vars(tier))


def test_random_128_bit_hex_secrets_are_never_refused_as_weak(
    monkeypatch: pytest.MonkeyPatch, spec: kt.OffloadingSpec
) -> None:
    # Attack (on availability): 16 random bytes as 32 hex digits (secrets.token_hex(16), a
    # uuid4) were refused about 2 times in 5, their bytes not all 16 distinct.
    primary = kt.PrimaryTier(spec, pin_memory=False)
    one_repeat = bytes(range(15)) + b"\x00"  # 15 distinct of 16: as random ones mostly are
    values = [
        one_repeat.hex(),
        *(uuid.uuid4().hex for _ in range(100)),
        *(secrets.token_hex(16) for _ in range(100)),
    ]
    for value in values:
        monkeypatch.setenv("KVTIER_128", value)
        tier = make_tier(
            {"type": "redis", "url": "redis://127.0.0.1:1/0", "secret_env": "KVTIER_128"}, primary, spec
        )
        assert tier.stats()["sealed"] is True
    # ... while 16 bytes that are half repeats still are.
    monkeypatch.setenv("KVTIER_128", "0123456789abcdef" * 2)
    with pytest.raises(kt.ConfigError, match="obviously weak"):
        make_tier(
            {"type": "redis", "url": "redis://127.0.0.1:1/0", "secret_env": "KVTIER_128"}, primary, spec
        )


PASSWORD = "pa/ss#w@rd?&x=" + uuid.uuid4().hex  # every character a URL parser trips on


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{PASSWORD}@127.0.0.1:6379/0",
        f"redis://alice:{PASSWORD}@127.0.0.1:6379/0",
        f"rediss://alice:{PASSWORD}@[::1]:6379/0",
        f"redis://127.0.0.1:6379/0?password={PASSWORD}",
        f"redis://127.0.0.1:6379/0?db=0&password={PASSWORD}",
        f"redis://:{PASSWORD}@127.0.0.1:notaport/0",
        f"unix://:{PASSWORD}@/run/redis.sock?db=0",
    ],
)
def test_redis_credentials_never_shown(
    url: str, spec: kt.OffloadingSpec, caplog: pytest.LogCaptureFixture
) -> None:
    from kvtier_async.tiers.redis_tier import redact_url

    pieces = [PASSWORD, *PASSWORD.replace("?", "/").replace("#", "/").replace("@", "/").split("/")]
    pieces = [p for p in pieces if len(p) >= 4]
    assert not any(p in redact_url(url) for p in pieces)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    try:
        tier = make_tier({"type": "redis", "url": url}, primary, spec)
    except kt.ConfigError as exc:  # a password with '/', '#' or '@' unencoded makes a URL malformed
        assert "malformed" in str(exc) and exc.__cause__ is None and exc.__suppress_context__
        shown = str(exc) + repr(exc)
    else:
        shown = repr(tier.stats()) + repr(tier.where)
    assert not any(p in shown or p in caplog.text for p in pieces)


def test_plain_redis_off_this_machine_warns_once(
    spec: kt.OffloadingSpec, caplog: pytest.LogCaptureFixture
) -> None:
    primary = kt.PrimaryTier(spec, pin_memory=False)
    with caplog.at_level("WARNING", logger="kvtier_async.tiers.redis_tier"):
        make_tier({"type": "redis", "url": "redis://127.0.0.1:1/0"}, primary, spec)
        make_tier({"type": "redis", "url": "rediss://cache.example:6380/0"}, primary, spec)
        assert "rediss://" not in caplog.text
        make_tier({"type": "redis", "url": "redis://:hunter2hunter2@cache.example:6379/0"}, primary, spec)
    assert caplog.text.count("use rediss://") == 1 and "hunter2" not in caplog.text


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Any:
    """A redis-server that asks for PASSWORD (set once it is up, so the start-up ping works)."""
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = servers.RedisServer(tmp_path / "redis-auth")
    server.start()
    import redis as sync_redis

    sync_redis.Redis.from_url(server.url).config_set("requirepass", PASSWORD)
    yield server
    server.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("source", ["password_env", "password_file"])
async def test_redis_password_from_env_or_file(
    source: str,
    redis_with_password: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spec: kt.OffloadingSpec,
    primary: kt.PrimaryTier,
) -> None:
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", PASSWORD)
    password_file = tmp_path / "redis-password"
    fd = await asyncio.to_thread(os.open, password_file, os.O_CREAT | os.O_WRONLY, 0o600)
    await asyncio.to_thread(os.write, fd, PASSWORD.encode() + b"\n")
    await asyncio.to_thread(os.close, fd)
    value = "KVTIER_REDIS_PASSWORD" if source == "password_env" else str(password_file)
    base = {"type": "redis", "url": redis_with_password.url, "prefix": uuid.uuid4().hex}
    keys = [make_key(i) for i in range(3)]
    async with make_tier({**base, source: value}, primary, spec) as tier:
        payloads = fill(primary, range(3))
        assert await tier.store(keys, list(range(3))) == [True] * 3
        assert await tier.load(keys, list(range(4, 7))) == [True] * 3
        assert read(primary, range(4, 7)) == payloads
        assert PASSWORD not in repr(tier.stats())
    async with make_tier(base, primary, spec) as without:  # no password: refused, quietly
        assert await without.store(keys, list(range(3))) == [False] * 3
