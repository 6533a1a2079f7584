"""The `nixl` section of bench/gpu_check.py: the nixl KV transport (kvtransfer/nixl_*.py) between
two processes on one GPU, VRAM to VRAM: a prefill pool registered on the device, a decode process
reading parts of it into its own device cache with NIXL READs (UCX's CUDA transports), checked
byte for byte, and the GB/s of a part of NIXL_TOKENS tokens.

NIXL is an optional package (`pdserve[nixl]`): where it does not import (the GPU machine has no
network to install it), the section says so ({"available": false, "why": ...}) and checks nothing.
Its dry run (`Plan.dry_run()`): host memory in both processes, the same code.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.multiprocessing as mp

from bench.gpu_sections import Plan

logger = logging.getLogger("bench.gpu_nixl")
LIMIT_S = 30.0
LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # an 8B model's KV shape (bf16)
NIXL_TOKENS = 2048
DRY_TOKENS = 256


def _compat():
    from kvtransfer.params import CompatRecord
    return CompatRecord("gpu-check", "bfloat16", LAYERS, HEADS, HEAD_DIM, block_size=BLOCK)


def _pool(device: str, tokens: int) -> torch.Tensor:
    return torch.zeros(LAYERS, 2, 2 * tokens // BLOCK + 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)


def _decode(conn, device: str, tokens: int, secret: str) -> None:
    import os
    os.environ["PDSERVE_CLUSTER_SECRET"] = secret
    from kvtransfer.nixl_receiver import NixlReceiver
    cache = _pool(device, tokens)
    rx = NixlReceiver(_compat(), cache, 0)
    conn.send(rx.endpoint_address)
    slots = torch.randperm(cache.shape[2] - 1)[:tokens // BLOCK] + 1
    slots = (slots[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    for rid in ("warm-up", "timed"):
        rx.expect(rid, slots.to(device), 1)
    conn.send(slots)
    done = 0
    while done < 2:
        got, failed = rx.poll()
        if failed:
            conn.send({"error": str(failed)})
            return
        done += len(got)
        time.sleep(0.001)
    from kvtransfer.wire import checksum_of
    conn.send({"checksum": checksum_of([cache.view(LAYERS, 2, -1, HEADS, HEAD_DIM)[:, :, slots.to(device)]]),
               "stats": rx.stats})
    conn.recv()
    rx.close()


def nixl(plan: Plan) -> dict:
    from kvtransfer.nixl_agent import nixl_unavailable
    why = nixl_unavailable()
    if why is not None:
        return {"available": False, "why": why}
    from kvtransfer.base import KVPool
    from kvtransfer.nixl_sender import NixlSender
    from kvtransfer.params import KVEndpoint
    from kvtransfer.wire import cluster_secret
    tokens = NIXL_TOKENS if plan.device == "cuda" else DRY_TOKENS
    secret = cluster_secret().decode()
    ctx = mp.get_context("spawn" if plan.device == "cuda" else "fork")  # CUDA needs a fresh process
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode, args=(child, plan.device, tokens, secret), daemon=True)
    proc.start()
    pool = _pool(plan.device, tokens)
    pool.normal_()
    tx = NixlSender(_compat(), "gpu-check", KVPool(pool, "torch", 0))
    try:
        dest = KVEndpoint("gpu-check", 0, *parent.recv())
        dst_slots = parent.recv()
        src_slots = torch.arange(BLOCK, BLOCK + tokens, device=plan.device)
        seconds = 0.0
        for rid in ("warm-up", "timed"):
            start = time.perf_counter()
            t = tx.begin(rid, dest, 0, HEADS, tokens, src_slots)
            for layer in range(LAYERS):
                t.layer_ready(layer)
            t.finish(b"")
            t.wait(LIMIT_S)
            seconds = time.perf_counter() - start
        got = parent.recv()
        parent.send("bye")
        if "error" in got:
            return {"available": True, "error": got["error"]}
        from kvtransfer.wire import checksum_of
        want = checksum_of([pool.view(LAYERS, 2, -1, HEADS, HEAD_DIM)[:, :, src_slots]])
        part_bytes = LAYERS * 2 * tokens * HEADS * HEAD_DIM * 2
        return {"available": True, "memory": "VRAM" if plan.device == "cuda" else "DRAM", "tokens": tokens,
                "bytes": part_bytes, "equal": got["checksum"] == want, "GBps": part_bytes / seconds / 1e9,
                "read_direct": got["stats"].get("parts_read_direct", 0), "dst_blocks_random": len(dst_slots) == tokens}
    finally:
        tx.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
