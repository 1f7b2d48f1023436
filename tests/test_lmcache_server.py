"""A real `lmcache server` (LMCache 0.5.6's multiprocess server) with `KVTierL2Adapter` as its L2.

The server is started as a user starts it, `lmcache server ... --l2-adapter '<our JSON>'`, in a
process of its own, and driven by LMCache's own client of that server (the one `lmcache bench
server` uses), in CPU mode: the client's KV cache lies in shared memory that the server maps,
and STORE / RETRIEVE move chunks between it and the server's L1, whose store controller writes
them on to our tier. Chunks are stored, the server's L1 is cleared over its HTTP API, the
client's KV blocks are zeroed, and every chunk must then be found (in L2: L1 is empty) and
retrieved with the checksums the server computed over the client's blocks at store time; then
the same from a new server process on the same root, after the first one was stopped. Each
server must shut down cleanly on Ctrl-C (its cache server closed, no traceback).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs LMCache and never skips these
    pytest.importorskip("lmcache.cli.commands.bench.server_bench.client")
    pytest.importorskip("httpx")  # of the server's own dependencies, the ones tests/install.sh adds

from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig
from lmcache.cli.commands.bench.server_bench.helpers import _zero_fill_client_blocks

#: 4 layers of 8 heads x 128, float16, 16 tokens a block: a 256-token chunk is 4 MiB.
SHAPE = "(2,256,16,8,128):float16:4"
TOKENS = 1024  # per request: 4 chunks
SEQUENCES = 3  # requests, in blocks of their own in the client's KV cache
START_S = 120  # for a server to answer its health check, and to exit once told to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def adapter_json(tier: dict[str, Any]) -> str:
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvtier_async.integrations.lmcache",
            "class_name": "KVTierL2Adapter",
            "adapter_params": {"tier": tier},
        }
    )


def http(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read() or b"null")


@contextmanager
def lmcache_server(tier: dict[str, Any], log: Path) -> Iterator[tuple[str, str]]:
    """`lmcache server` with our adapter over `tier`: its (rpc URL, HTTP URL). On exit it is
    stopped with SIGINT (Ctrl-C; uvicorn shuts the server down) and must close cleanly."""
    port, http_port = free_port(), free_port()
    command = [str(Path(sys.executable).with_name("lmcache")), "server", "--l1-size-gb", "0.25"]
    command += ["--eviction-policy", "LRU", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--http-host", "127.0.0.1", "--http-port", str(http_port)]
    command += ["--l2-adapter", adapter_json(tier)]
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
    with log.open("ab") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + START_S
        while True:  # until it answers, or has exited, or the deadline passed
            if server.poll() is not None:
                pytest.fail(f"lmcache server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if http("GET", f"{base}/healthcheck"):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"lmcache server did not start:\n{log.read_text()[-4000:]}")
                time.sleep(0.2)  # polling a process that is starting, not synchronising our own work
        yield f"tcp://127.0.0.1:{port}", base
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=START_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            pytest.fail(f"lmcache server did not exit on SIGINT:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    # 130 = 128 + SIGINT: how uvicorn exits once it has shut the application down on Ctrl-C.
    assert code in (0, 130), text[-4000:]
    assert text.count("MPCacheServer closed") == text.count("Application startup complete"), text[-4000:]
    assert "Traceback" not in text, text[-4000:]


@contextmanager
def client(rpc_url: str, http_url: str) -> Iterator[ServerBenchClient]:
    config = BenchConfig(
        rpc_url=rpc_url,
        http_url=http_url,
        mode="cpu",
        transfer_mode="lmcache_driven",  # the client's KV in shared memory, the server's path
        tp_size=1,
        use_mla=False,
        num_tokens=TOKENS,
        kvcache_shape_spec=SHAPE,
        num_blocks=256,
        block_size=16,
    )
    bench = ServerBenchClient(config, lambda line: None)
    bench.start()
    try:
        yield bench
    finally:
        bench.close()


def store_all(bench: ServerBenchClient) -> dict[int, list[str]]:
    """Store every sequence (none of it cached before); the server's checksums of each."""
    stored = {}
    for seq in range(SEQUENCES):
        request = bench.create_request(seq, f"store-{seq}", "cold")
        assert request is not None
        lookup = bench.lookup(request)
        assert lookup.succeeded and lookup.is_full_miss, lookup
        checksums = bench.compute_checksums(request, 0, request.num_full_tokens)
        assert checksums and len(checksums) == request.total_chunks
        result = bench.store(request, 0, request.num_full_tokens)
        assert result is not None and result.succeeded, result
        bench.end_session(request)
        stored[seq] = checksums
    return stored


def l2_stores(http_url: str) -> int:
    """Chunks our tiers hold written, by the adapter's own report on the server's status page."""
    status = http("GET", f"{http_url}/status")
    reports = [r for r in find_reports(status) if r.get("type") == "KVTierL2Adapter"]
    assert len(reports) == 1, status
    tiers = reports[0]["tiers_by_object_size"].values()
    return sum(t["stored_blocks"] for t in tiers)


def find_reports(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from find_reports(value)
    elif isinstance(node, list):
        for value in node:
            yield from find_reports(value)


def retrieve_all_from_l2(bench: ServerBenchClient, http_url: str, stored: dict[int, list[str]]) -> None:
    """With the server's L1 empty and the client's blocks zeroed: every sequence found whole and
    retrieved with the checksums it was stored with."""
    http("POST", f"{http_url}/cache/clear", {"tier": "l1"})
    for seq, checksums in stored.items():
        request = bench.create_request(seq, f"load-{seq}", "warm")
        assert request is not None
        blocks = request.num_full_tokens // 16
        for worker in bench._workers:  # the client's KV cache, which the server maps
            _zero_fill_client_blocks(list(worker.kv_caches.values()), request.block_offset, blocks)
        assert bench.compute_checksums(request, 0, request.num_full_tokens) != checksums
        lookup = bench.lookup(request)
        assert lookup.succeeded and lookup.is_full_hit, (seq, lookup)
        result = bench.retrieve(request, 0, request.num_full_tokens)
        assert result is not None and result.succeeded, result
        assert bench.compute_checksums(request, 0, request.num_full_tokens) == checksums, seq
        bench.end_session(request)


def wait_for_l2(http_url: str, chunks: int) -> None:
    """Until the server's store controller has written `chunks` chunks to our tier."""
    deadline = time.monotonic() + START_S
    while (held := l2_stores(http_url)) < chunks:
        assert time.monotonic() < deadline, f"{held} of {chunks} chunks reached L2"
        time.sleep(0.05)  # polling another process's progress


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_a_real_lmcache_server_stores_to_our_tier_and_retrieves_from_it_after_a_restart(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tier: dict[str, Any] = {"type": "fs", "root": str(tmp_path / "kv")}
    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        tier = {"type": "redis", "url": url, "prefix": f"lmcache-server-{tmp_path.name}"}
    log = tmp_path / "server.log"
    chunks = SEQUENCES * TOKENS // 256
    with lmcache_server(tier, log) as (rpc, web), client(rpc, web) as bench:
        stored = store_all(bench)
        wait_for_l2(web, chunks)
        retrieve_all_from_l2(bench, web, stored)
    # A new server process on the same root: L1 starts empty, L2 holds the chunks.
    with lmcache_server(tier, log) as (rpc, web), client(rpc, web) as bench:
        retrieve_all_from_l2(bench, web, stored)
        assert l2_stores(web) == 0  # found on disk, not written again
