#!/usr/bin/env bash
# Makes .venv with everything the test suite needs: the package with its dev extras, and the
# engines it is tested inside, as released (vLLM 0.33, SGLang 0.5.23, LMCache 0.5.6), importable on
# a CPU machine, with the tests of LMCache's source distribution that run against our adapter.
# The README's test command and .ci/run call it. KVTIER_TORCH names the torch to install first
# (default: the CPU wheel this project's machines carry; set it empty to keep the torch you have, on
# a GPU machine). Whatever torch that leaves is pinned for every later install, so no dependency can
# swap it for a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q)
torch_pin=${KVTIER_TORCH-torch==2.13.0}
[ -z "$torch_pin" ] || "${pip[@]}" "$torch_pin"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/python -c 'import torch; print(f"torch=={torch.__version__}")' >"$constraints"
"${pip[@]}" -c "$constraints" -e '.[dev]'
# vLLM, SGLang and LMCache without their dependency lists (CUDA torch, kernels, pins), then what
# their modules that we test against import.
"${pip[@]}" -c "$constraints" --no-deps vllm==0.33.0 xgrammar==0.2.8 sglang==0.5.23 triton==3.7.0 lmcache==0.5.6
"${pip[@]}" -c "$constraints" -r tests/requirements-vllm-cpu.txt -r tests/requirements-sglang-cpu.txt \
    -r tests/requirements-lmcache-cpu.txt
# The Mooncake Store client the Mooncake tier's tests use (its non-CUDA build: it depends on nothing
# heavier than requests, aiohttp and msgpack; its native libraries need Debian's libibverbs1).
"${pip[@]}" -c "$constraints" mooncake-transfer-engine-non-cuda==0.3.13.post1
.venv/bin/python tests/lmcache_contract/fetch_tests.py .venv/lmcache-tests
"${pip[@]}" --no-deps .venv/lmcache-tests/examples/lmc_external_l2_adapter  # its tests import it
