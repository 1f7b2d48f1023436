"""GPU check: CopyEngine throughput, exactness, pipeline overlap and loop lag on one device.

    python bench/gpu_check.py            # on a CUDA machine: 1 GiB per case, < 5 minutes on an H200
    python bench/gpu_check.py --small    # anywhere: CPU tensors stand in, reduced sizes

Prints, for scattered 2 MiB and 64 KiB blocks, device -> host and host -> device
GB/s through `CopyEngine` next to a contiguous pinned copy of the same bytes in
the same run, and checks every byte both ways. Then the store/load pipeline
overlap ratio through a file-system tier (bench/pipeline.py) and the event-loop
lag while copies run. Exits 1 if any byte differs.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import GB, LoopLag, run
from pipeline import LAYERS, make_layers, one_round

import kvtier_async as kt
from kvtier_async.copy_engine import CopyEngine


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def copy_case(device: str, block_nbytes: int, blocks: int) -> tuple[dict[str, float], bool]:
    spec = kt.OffloadingSpec(block_nbytes=block_nbytes, num_cpu_blocks=blocks, namespace="gpu-check")
    primary = kt.PrimaryTier(spec)
    layers = make_layers(2 * blocks, block_nbytes, device)
    engine = CopyEngine(layers, primary, threads=spec.limits.copy_threads)
    device_ids = random.Random(0).sample(range(2 * blocks), blocks)  # scattered on the device
    taken = set(device_ids)
    targets = [i for i in range(2 * blocks) if i not in taken][:blocks]  # where the load goes back
    slots = list(range(blocks))
    nbytes = blocks * block_nbytes
    # Baseline: one contiguous device buffer <-> the pinned host buffer, same bytes.
    contiguous = torch.empty((blocks, spec.block_stride), dtype=torch.uint8, device=device)
    synchronize(device)
    started = time.perf_counter()
    primary.buffer.copy_(contiguous, non_blocking=True)
    synchronize(device)
    base_d2h = nbytes / (time.perf_counter() - started) / GB
    started = time.perf_counter()
    contiguous.copy_(primary.buffer, non_blocking=True)
    synchronize(device)
    base_h2d = nbytes / (time.perf_counter() - started) / GB
    with LoopLag() as lag:
        synchronize(device)
        started = time.perf_counter()
        await engine.to_host(device_ids, slots)
        d2h = nbytes / (time.perf_counter() - started) / GB
        started = time.perf_counter()
        await engine.to_device(slots, targets)
        synchronize(device)
        h2d = nbytes / (time.perf_counter() - started) / GB
    exact = True
    offset = 0
    for layer in layers:
        width = layer.shape[1]
        host = primary.buffer[:, offset : offset + width]
        exact &= torch.equal(host, layer[device_ids].cpu())
        exact &= torch.equal(layer[targets], layer[device_ids])
        offset += width
    engine.close()
    lags = lag.summary()
    return {
        "d2h_gbps": d2h,
        "d2h_base_gbps": base_d2h,
        "h2d_gbps": h2d,
        "h2d_base_gbps": base_h2d,
        "lag_p99_ms": lags["p99_ms"],
        "lag_max_ms": lags["max_ms"],
    }, exact


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="reduced sizes (the CPU fallback)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = args.small or device == "cpu"
    total = (32 << 20) if small else (1 << 30)
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (CPU fallback)'}, "
        f"torch {torch.__version__}, {total >> 20} MiB per case, {LAYERS} layers"
    )
    all_exact = True
    for block_kib in (2048, 64):
        block = block_kib * 1024
        result, exact = await copy_case(device, block, max(4, total // block))
        all_exact &= exact
        print(
            f"{block_kib:>5} KiB scattered: device->host {result['d2h_gbps']:.2f} GB/s "
            f"(contiguous pinned {result['d2h_base_gbps']:.2f}), host->device "
            f"{result['h2d_gbps']:.2f} GB/s (contiguous {result['h2d_base_gbps']:.2f}), "
            f"byte-exact {exact}, loop lag p99 {result['lag_p99_ms']:.2f} ms "
            f"max {result['lag_max_ms']:.2f} ms"
        )
    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-check-"))
    try:
        block = 2 << 20
        overlap = await one_round(work, block, max(8, total // block), device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"pipeline through the fs tier: store {overlap['store_ratio']:.2f}x, load "
        f"{overlap['load_ratio']:.2f}x the slower of copy-only and I/O-only (1.0 = full overlap)"
    )
    if not all_exact:
        print("FAILED: bytes differ")
        sys.exit(1)


if __name__ == "__main__":
    run(main)
