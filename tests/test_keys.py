from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvtier_async as kt


def test_one_key_per_full_block() -> None:
    assert len(kt.block_hashes(range(47), 16)) == 2
    assert len(kt.block_hashes(range(48), 16)) == 3
    assert kt.block_hashes([], 16) == []
    assert all(isinstance(k, bytes) and len(k) == 32 for k in kt.block_hashes(range(64)))


@given(st.lists(st.integers(0, 2**31), min_size=32, max_size=96), st.integers(0, 31))
def test_keys_are_chained(tokens: list[int], change_at: int) -> None:
    keys = kt.block_hashes(tokens, 16)
    changed = list(tokens)
    changed[change_at] += 1
    other = kt.block_hashes(changed, 16)
    block = change_at // 16
    assert keys[:block] == other[:block]
    assert all(a != b for a, b in zip(keys[block:], other[block:]))  # every later key differs


def test_namespace_and_block_size_separate_keys() -> None:
    tokens = list(range(64))
    assert kt.block_hashes(tokens, 16, namespace="a") != kt.block_hashes(tokens, 16, namespace="b")
    assert kt.block_hashes(tokens, 16)[0] != kt.block_hashes(tokens, 32)[0]


def test_tensor_input_matches_list() -> None:
    tokens = list(range(100, 164))
    assert kt.block_hashes(torch.tensor(tokens), 16) == kt.block_hashes(tokens, 16)


def test_deterministic_across_processes() -> None:
    code = "import kvtier_async as kt; print(kt.block_hashes(range(64), 16, namespace='x')[-1].hex())"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {kt.block_hashes(range(64), 16, namespace="x")[-1].hex()}


@pytest.mark.parametrize(
    ("tokens", "block_size", "namespace"),
    [(["a"], 16, "n"), ([2**63], 16, "n"), ([1], 0, "n"), ([1], 16, "")],
)
def test_bad_arguments(tokens: list[object], block_size: int, namespace: str) -> None:
    with pytest.raises(kt.InvalidArgumentError):
        kt.block_hashes(tokens, block_size, namespace=namespace)
