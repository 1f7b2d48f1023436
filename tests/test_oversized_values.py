"""A value far larger than a block under a tier's own name (another program's, or an attacker's)
is a counted miss, and reading it costs no more memory than a block: against a real Redis
server (both of the tier's read paths) and a real S3 server."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import redis.asyncio
import servers
from obstore.store import S3Store

import kvtier_async as kt
import kvtier_async.tiers.object_store
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.testing import make_key

BLOCK = 8 << 20
HUGE = 64 << 20
STATUS = Path("/proc/self/status")

pytestmark = pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc/self")


def reset_peak() -> None:
    """Make the peak resident size (VmHWM) the current one (Linux, /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident() -> tuple[int, int]:
    """(current, peak) resident bytes of this process."""
    fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


async def peak_growth_of(load: Any) -> int:
    """How far the process's resident size peaked above where it was, while `load` ran."""
    await asyncio.to_thread(reset_peak)
    before, _ = await asyncio.to_thread(resident)
    await load
    _, peak = await asyncio.to_thread(resident)
    return peak - before


@pytest.fixture
def spec() -> kt.OffloadingSpec:
    return kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=2, namespace="oversized")


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["direct", "redis-py"])
async def test_redis_value_of_64_mib_is_a_bounded_miss(
    path: str, redis_server: servers.RedisServer, spec: kt.OffloadingSpec
) -> None:
    primary = kt.PrimaryTier(spec, pin_memory=False)
    raw = redis.asyncio.Redis.from_url(redis_server.url, driver_info=None)
    config: dict[str, Any] = {"type": "redis", "url": redis_server.url, "prefix": uuid.uuid4().hex}
    if path == "redis-py":
        config["client"] = redis.asyncio.Redis.from_url(redis_server.url, driver_info=None)
    key = make_key(1)
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        await tier.open()
        await raw.set(tier.value_name(key), os.urandom(1 << 20) * (HUGE >> 20))
        growth = await peak_growth_of(tier.load([key], [0]))
        assert tier.stats()["load_misses"] == 1
        assert tier.stats()["corrupt_blocks"] == 1
    await raw.aclose()
    if path == "redis-py":
        await config["client"].aclose()
    assert growth <= BLOCK + (4 << 20), f"reading a foreign {HUGE >> 20} MiB value grew the peak by {growth}"


@pytest.mark.asyncio
async def test_s3_object_of_64_mib_is_a_bounded_miss(
    s3_server: servers.S3Server, spec: kt.OffloadingSpec
) -> None:
    primary = kt.PrimaryTier(spec, pin_memory=False)
    prefix = f"oversized-{uuid.uuid4().hex[:12]}"
    config = {
        "type": "s3",
        "bucket": servers.S3_BUCKET,
        "prefix": prefix,
        "endpoint": s3_server.endpoint,
        "allow_http": True,
        **servers.S3_CREDENTIALS,
    }
    raw = S3Store(
        servers.S3_BUCKET,
        config={**servers.S3_CREDENTIALS, "endpoint": s3_server.endpoint, "region": "us-east-1"},
        client_options={"allow_http": True},
    )
    key = make_key(1)
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        await obstore.put_async(raw, tier.object_name(key), os.urandom(1 << 20) * (HUGE >> 20))
        await tier.open()
        growth = await peak_growth_of(tier.load([key], [0]))
        assert tier.stats()["load_misses"] == 1
        assert tier.stats()["corrupt_blocks"] == 1
    assert growth <= BLOCK + (4 << 20), f"reading a foreign {HUGE >> 20} MiB object grew the peak by {growth}"


class _HostileS3Handler(http.server.BaseHTTPRequestHandler):
    """Answers a bucket listing as an empty bucket's, and every other GET as a ranged GET of an
    object of `claimed` bytes should be answered (206, the right Content-Range), then sends
    `sent` bytes of body: a hostile endpoint, or a man in the middle, that only a bounded read
    survives."""

    protocol_version = "HTTP/1.1"
    claimed = 0
    sent = 0

    def do_GET(self) -> None:
        if "list-type=" in self.path:  # the tier's bucket check at start-up: an empty bucket
            listing = (
                b'<?xml version="1.0" encoding="UTF-8"?>'
                b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                b"<KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>"
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(listing)))
            self.end_headers()
            self.wfile.write(listing)
            return
        self.send_response(206)
        self.send_header("Content-Range", f"bytes 0-{self.claimed - 1}/{self.claimed}")
        self.send_header("Content-Length", str(self.sent))
        self.send_header("ETag", '"hostile"')
        self.send_header("Last-Modified", "Mon, 07 Dec 2026 12:00:00 GMT")
        self.end_headers()
        piece = bytes(1 << 20)
        with contextlib.suppress(OSError):  # the client hanging up is the outcome we want
            for _ in range(self.sent >> 20):
                self.wfile.write(piece)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hostile_s3() -> Iterator[type[_HostileS3Handler]]:
    handler = type("Handler", (_HostileS3Handler,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.endpoint = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.asyncio
async def test_s3_endpoint_sending_a_huge_body_for_a_right_content_range_is_a_bounded_miss(
    hostile_s3: type[_HostileS3Handler], spec: kt.OffloadingSpec
) -> None:
    # The attack: a ranged GET answered with the right Content-Range and a 512 MiB body.
    primary = kt.PrimaryTier(spec, pin_memory=False)
    config = {
        "type": "s3",
        "bucket": servers.S3_BUCKET,
        "endpoint": hostile_s3.endpoint,  # type: ignore[attr-defined]
        "allow_http": True,
        "max_retries": 0,
        **servers.S3_CREDENTIALS,
    }
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        assert isinstance(tier, kvtier_async.tiers.object_store.ObjectStoreTier)
        hostile_s3.claimed = tier.value_nbytes
        hostile_s3.sent = 512 << 20
        await tier.open()
        growth = await peak_growth_of(tier.load([make_key(1)], [0]))
        assert tier.stats()["load_misses"] == 1
    assert growth < BLOCK + (64 << 20), f"a hostile endpoint's 512 MiB body grew the peak by {growth}"
