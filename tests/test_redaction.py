"""Credentials in a tier's URL or endpoint never shown: judged on the decoded names (as the
clients read them), wherever the URL appears (stats, repr, the bench's config)."""

from __future__ import annotations

import json
import logging
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers

import kvtier_async as kt
import kvtier_async.tiers.object_store
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.cli import main
from kvtier_async.redact import redact_url, redacted_config

PASSWORD = "Pw-9f3c1e77ab"
CASES = [
    f"redis://h/0?pass%77ord={PASSWORD}",  # redis-py decodes the name: the password is used
    f"redis://h/0?db=0&PASSWORD={PASSWORD}",
    f"redis://h/0?db=0;pwd={PASSWORD}",
    f"rediss://alice:{PASSWORD}@h:6380/0",
    f"redis://{PASSWORD}@h/0",
    f"https://user:{PASSWORD}@s3.internal:9000",
    f"http://h:9000/?X-Amz-Signature={PASSWORD}",
]


@pytest.mark.parametrize("url", CASES)
def test_credentials_are_redacted_on_decoded_names(url: str) -> None:
    # Attack (a leak): a password under a percent-encoded query name, or in an endpoint's
    # user-info, was shown verbatim in stats() and the bench's output.
    assert PASSWORD not in redact_url(url)
    assert PASSWORD not in repr(redacted_config({"type": "x", "url": url, "endpoint": url}))


def make(config: dict[str, Any]) -> Any:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=2, secondary_tiers=[config])
    primary = kt.PrimaryTier(spec, pin_memory=False)
    return spec, kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)


def test_a_percent_encoded_password_in_a_redis_url_is_not_in_stats_or_repr() -> None:
    spec, tier = make({"type": "redis", "url": f"redis://127.0.0.1:1/0?pass%77ord={PASSWORD}"})
    assert PASSWORD not in repr(tier.stats()) + repr(spec) + str(spec)
    assert tier.stats()["url"] == "redis://127.0.0.1:1/0?pass%77ord=***"


def test_an_s3_endpoint_with_user_info_is_refused_and_not_shown() -> None:
    # Attack (a leak): an endpoint with user:password@ was in the text of every error obstore
    # raised (a failing LIST or GET), which the fault guard logs.
    endpoint = f"https://user:{PASSWORD}@s3.internal:9000"
    config = {"type": "s3", "bucket": "b", "endpoint": endpoint}
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=2, secondary_tiers=[config])
    assert PASSWORD not in repr(spec)
    with pytest.raises(kt.ConfigError, match="carries credentials") as raised:
        make(config)
    assert PASSWORD not in str(raised.value) and "https://user:***@s3.internal:9000" in str(raised.value)


@pytest.mark.parametrize(
    "endpoint", [f"https://s3.internal:9000/?X-Amz-Signature={PASSWORD}", "https://s3.internal:x/"]
)
def test_an_s3_endpoint_with_a_query_or_a_bad_port_is_refused(endpoint: str) -> None:
    with pytest.raises(kt.ConfigError, match=r"carries credentials|malformed") as raised:
        make({"type": "s3", "bucket": "b", "endpoint": endpoint})
    assert PASSWORD not in str(raised.value)


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RedisServer]:
    """A redis-server on loopback that requires PASSWORD."""
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = servers.RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()  # answering PING first: start-up waits for that
    assert servers.REDIS_CLI is not None
    subprocess.run(
        [servers.REDIS_CLI, "-p", str(server.port), "config", "set", "requirepass", PASSWORD],
        check=True,
        capture_output=True,
    )
    yield server
    server.stop()


@pytest.mark.parametrize("where", ["user-info", "percent-encoded query name"])
def test_kvtier_bench_against_a_real_server_never_shows_the_password(
    where: str,
    redis_with_password: servers.RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Attack (a leak): `kvtier bench` run against a Redis URL that carries the password echoed
    # the URL in its table, its JSON and its logs.
    port = redis_with_password.port
    url = {
        "user-info": f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
        "percent-encoded query name": f"redis://127.0.0.1:{port}/0?pass%77ord={PASSWORD}",
    }[where]
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "bench.json"
    argv = ["bench", "--tiers", json.dumps([{"type": "redis", "url": url, "prefix": uuid.uuid4().hex}])]
    argv += ["--block-kib", "64", "--mib", "1", "--request-blocks", "4", "--no-progress"]
    argv += ["--dir", str(tmp_path), "--json", str(out)]
    assert main(argv) == 0
    shown = capsys.readouterr()
    result = json.loads(out.read_text())
    # The run reached the server with the password (it refuses everything without it).
    assert [(c["exact"], c["load_hits"] == c["blocks"] > 0) for c in result["cases"]] == [(True, True)]
    for text in (shown.out, shown.err, out.read_text(), caplog.text):
        assert PASSWORD not in text
    assert "***" in json.dumps(result["config"])  # the URL is shown, redacted


@pytest.mark.parametrize("host", ["10.1.2.3", "cache.internal", "127.0.0.1", "localhost"])
def test_plain_redis_off_this_machine_logs_one_warning(host: str, caplog: pytest.LogCaptureFixture) -> None:
    # Attack: blocks and the password cross a network in clear, the operator never told.
    caplog.set_level(logging.WARNING)
    make({"type": "redis", "url": f"redis://:{PASSWORD}@{host}:6379/0"})
    warnings = [r.getMessage() for r in caplog.records if "in plain text" in r.getMessage()]
    assert len(warnings) == (0 if host in ("127.0.0.1", "localhost") else 1)
    assert PASSWORD not in caplog.text
