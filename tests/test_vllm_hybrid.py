"""A hybrid model's KV-cache groups through vLLM 0.33's real connector, tiering manager and our tier.

Two hybrid models: gpt-oss / Gemma-like (full attention; a 48-token window in 16-token blocks; a
64-token window in 32-token blocks) and Qwen3-Next-like (full attention; linear attention, a
Mamba-state group in vLLM), driven by vLLM's `OffloadingConnectorScheduler`
(`vllm_connector.HybridEngine`): vLLM decides which chunks of which group are stored, looked up
and promoted; every promoted row is checked against the bytes its group's layers computed.
vLLM's own fs tier runs the same scenarios as a control.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("KVTIER_REQUIRE_SERVERS") != "1":  # CI installs vLLM and never skips these
    pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from vllm_connector import (
    LAYOUT,
    LINEAR_LAYOUT,
    HybridEngine,
    hybrid_offloading_config,
    kv_cache_groups,
    linear_attention_groups,
)
from vllm_engine import ADAPTER

import kvtier_async as kt

PROMPT = list(range(1000, 1200))  # 200 tokens: 12 whole 16-token chunks, 6 whole 32-token chunks
HIT_TOKENS = 192  # a hit ends before the prompt's last token, on a 16-token chunk


@dataclass(frozen=True)
class Model:
    groups: Callable[..., list[Any]]  # vLLM's KV-cache groups, given each group's layer names
    layout: tuple[tuple[str, ...], ...]
    other_layout: tuple[tuple[str, ...], ...]  # as many layers per group, other ones
    stored: dict[int, int]  # rows vLLM's connector stores of PROMPT, per group
    promoted: dict[int, int]  # rows a hit of HIT_TOKENS loads, per group
    extended: dict[int, int]  # rows stored of PROMPT and 64 new tokens, once PROMPT is stored


MODELS = {
    # Every full-attention chunk; of the 48-token window in 16-token blocks only the window at
    # the prompt's end; of the 64-token window in 32-token blocks every chunk (its blocks do not
    # divide the 16-token hit alignment, so vLLM keeps them all). A hit loads every
    # full-attention chunk and each window.
    "sliding-windows": Model(
        groups=kv_cache_groups,
        layout=LAYOUT,
        other_layout=(("layers.0", "layers.1"), ("layers.2", "layers.3"), ("layers.4", "layers.5")),
        stored={0: 12, 1: 3, 2: 6},
        promoted={0: 12, 1: 3, 2: 2},
        extended={0: 4, 1: 3, 2: 2},
    ),
    # The state group stores and loads one chunk: the state at the boundary.
    "linear-attention": Model(
        groups=linear_attention_groups,
        layout=LINEAR_LAYOUT,
        other_layout=(
            ("layers.0", "layers.4"),
            ("layers.1", "layers.2", "layers.3", "layers.5", "layers.6", "layers.7"),
        ),
        stored={0: 12, 1: 1},
        promoted={0: 12, 1: 1},
        extended={0: 4, 1: 1},
    ),
}


def counts(per_group: dict[int, list[Any]]) -> dict[int, int]:
    return {group: len(keys) for group, keys in per_group.items()}


@pytest.fixture(params=["fs", "redis", "vllm-fs"])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> list[dict[str, Any]]:
    """Every engine of a test gets the same: one fs root, or one Redis server and prefix."""
    if request.param == "fs":
        return [{**ADAPTER, "tier": {"type": "fs", "root": str(tmp_path / "kv"), "refresh_interval_s": 0}}]
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        return [{**ADAPTER, "tier": {"type": "redis", "url": url, "prefix": uuid.uuid4().hex}}]
    return [{"type": "fs", "root_dir": str(tmp_path / "vllm-fs")}]  # the control: vLLM's own


@pytest.fixture(params=list(MODELS))
def model(request: pytest.FixtureRequest) -> Model:
    return MODELS[request.param]


def test_every_group_is_stored_found_and_promoted_byte_exact_restarts_included(
    model: Model, tiers: list[dict[str, Any]]
) -> None:
    engine = HybridEngine(tiers, model.groups(model.layout))
    try:
        first = engine.prefill(PROMPT)
        assert (first.hit_tokens, counts(first.stored), first.loaded) == (0, model.stored, {})
        again = engine.prefill(PROMPT)  # from vLLM's primary tier
        assert (again.hit_tokens, counts(again.loaded), again.wrong) == (HIT_TOKENS, model.promoted, [])
        engine.reset_cache()  # the primary tier forgets: only the secondary tier has the rows
        promoted = engine.prefill(PROMPT)
        assert (promoted.hit_tokens, counts(promoted.loaded), promoted.wrong) == (
            HIT_TOKENS,
            model.promoted,
            [],
        )
    finally:
        assert engine.shutdown() == []
    restarted = HybridEngine(tiers, model.groups(model.layout))  # a new engine over the same tier
    try:
        found = restarted.prefill(PROMPT)
        assert (found.hit_tokens, counts(found.loaded), found.wrong) == (HIT_TOKENS, model.promoted, [])
        assert found.stored == {}  # nothing new to store: every chunk vLLM keeps was found
        longer = restarted.prefill(PROMPT + list(range(64)))  # the shared prefix, then new chunks
        assert (longer.hit_tokens, longer.wrong, counts(longer.stored)) == (HIT_TOKENS, [], model.extended)
    finally:
        assert restarted.shutdown() == []


def test_engines_share_rows_only_when_their_groups_hold_the_same_layers(
    model: Model, tiers: list[dict[str, Any]]
) -> None:
    """Two engines of one layout share; an engine whose groups hold other layers (as many of
    them, same block sizes and windows) gets nothing of theirs, and they nothing of its."""
    same, other, peer = (
        HybridEngine(tiers, model.groups(model.layout)),
        HybridEngine(tiers, model.groups(model.other_layout)),
        HybridEngine(tiers, model.groups(model.layout)),
    )
    try:
        assert same.prefill(PROMPT).hit_tokens == 0
        elsewhere = other.prefill(PROMPT)
        assert (elsewhere.hit_tokens, elsewhere.loaded, counts(elsewhere.stored)) == (0, {}, model.stored)
        shared = peer.prefill(PROMPT)  # running beside the engine that stored
        assert (shared.hit_tokens, counts(shared.loaded), shared.wrong) == (HIT_TOKENS, model.promoted, [])
        mine = other.prefill(PROMPT)
        assert (mine.hit_tokens, mine.wrong) == (HIT_TOKENS, [])  # its own rows, its own bytes
    finally:
        for engine in (same, other, peer):
            assert engine.shutdown() == []


def test_the_namespace_digests_each_groups_layer_names_in_order() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    def namespace(layout: Any) -> str:
        config = hybrid_offloading_config([{"type": "example"}], kv_cache_groups(layout))
        spec = OffloadingSpecFactory.create_spec(config)
        view = memoryview(np.zeros((spec.num_chunks, spec.kv_bytes_per_chunk), dtype=np.int8))
        return kt.OffloadingSpec.from_vllm(spec, view).namespace

    with pytest.raises(kt.ConfigError, match="layer_names must be a sequence of str"):
        namespace((("layers.0", 3), *LAYOUT[1:]))
    base = namespace(LAYOUT)
    assert namespace(LAYOUT) == base  # a restart, another data-parallel replica
    reordered = tuple(tuple(reversed(names)) for names in LAYOUT)  # a row holds them in this order
    swapped = (LAYOUT[1], LAYOUT[0], LAYOUT[2])
    others = {namespace(MODELS["sliding-windows"].other_layout), namespace(reordered), namespace(swapped)}
    assert base not in others and len(others) == 3


def test_the_documented_hybrid_config_runs(tmp_path: Path) -> None:
    """docs/vllm.md's extra config for groups of different block sizes: vLLM's validation, then
    our tier from it in the three-group engine (its root moved here)."""
    from vllm.config import KVTransferConfig

    text = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    (found,) = re.findall(r"```json\n(.*?)```", text, re.S)
    extra = json.loads(found)
    assert "block_size" not in extra and extra["blocks_per_chunk"] == 1
    config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    (entry,) = config.kv_connector_extra_config["secondary_tiers"]
    engine = HybridEngine([{**entry, "tier": {**entry["tier"], "root": str(tmp_path)}}])
    try:
        assert counts(engine.prefill(PROMPT).stored) == MODELS["sliding-windows"].stored
        engine.reset_cache()
        found_again = engine.prefill(PROMPT)
        assert (found_again.hit_tokens, found_again.wrong) == (HIT_TOKENS, [])
    finally:
        assert engine.shutdown() == []
