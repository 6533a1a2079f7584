"""The `two_gpu` section of bench/gpu_check.py: what only two GPUs can check (docs/gpu.md), run
when the probe sees two devices. Two spawned ranks, one per device:

1. `join_tp_group` on `cuda` (each rank's current device: the index rule of `select_device`):
   NCCL for tensors, gloo beside it; all_reduce, all_gather and broadcast_step checked by value.
2. The KV data channel between them (kvtransfer/channel_factory.py `open_channel`: NCCL on CUDA): one
   KV-sized tensor sent by rank 0, received by rank 1, compared by checksum, and its GB/s.
3. A TP=2 colocated engine (cluster/ranks/rank.py `RankHost`) on the engine section's tiny random
   Llama in float32 (in bf16 the two sum partial products in another order and a near-tie may
   flip): greedy tokens against TP=1 on the first device, run after the ranks have ended.

Its dry run (`Plan.dry_run()`): two CPU processes, gloo in NCCL's place, the same code.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.gpu_sections import TINY, Plan, _greedy, _hf_llama, _prompts, engine_config, model_config_of

logger = logging.getLogger("bench.gpu_two")
CHANNEL_MIB = 64  # the KV tensor sent over the data channel
NUM_PROMPTS = 4
RESULT_S = 30.0  # the section waits this long for both ranks (within its own limit in gpu_check)


def _config(device: str):
    return replace(engine_config(device, dict(num_blocks=128, block_size=16), max_num_seqs=8), dtype="float32")


def _collectives(tp, device: torch.device) -> dict:
    x = torch.full((1024,), float(tp.rank + 1), device=device)
    reduced = tp.all_reduce(x.clone())
    gathered = tp.all_gather(x[:4].clone(), dim=0)
    step = tp.broadcast_step({"ids": torch.arange(8, device=device) * 3, "n": 7} if tp.rank == 0 else None)
    return {"all_reduce_ok": bool((reduced == 3).all()),
            "all_gather_ok": gathered.tolist() == [1.0] * 4 + [2.0] * 4,
            "broadcast_step_ok": step["n"] == 7 and step["ids"].tolist() == list(range(0, 24, 3))}


def _channel(store_port: int, rank: int, device: torch.device, timeout_s: float) -> dict:
    from kvtransfer.channel_factory import open_channel
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    kind = "nccl" if device.type == "cuda" else "gloo"  # two devices: what the receiver picks (kvtransfer)
    channel = open_channel(dist.PrefixStore("channel/", store), rank, kind, device, "127.0.0.1", timeout_s)
    try:
        n = CHANNEL_MIB << 20
        g = torch.Generator().manual_seed(5)
        want = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g).to(device)
        buf = want.clone() if rank == 0 else torch.zeros_like(want)
        start = time.perf_counter()
        if rank == 0:
            channel.send(buf, timeout_s)
        else:
            channel.recv(buf, timeout_s)
            channel.settle(timeout_s)
        seconds = time.perf_counter() - start
        return {"channel": type(channel).__name__, "equal": bool(torch.equal(buf, want)), "GBps": n / seconds / 1e9}
    finally:
        channel.close()


def _rank_main(rank: int, plan: Plan, addresses: tuple[str, str], store_port: int, model_config, weights: dict,
               prompts: list[list[int]], conn) -> None:
    """Child: checks 1 and 2 on a TP group of its own, then check 3 in a RankHost (its own group)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s [tp{rank}] %(name)s: %(message)s")
    sys.stdout = sys.stderr  # the check's stdout carries its JSON object only
    from cluster.ranks.rank import RankHost, join_tp_group
    from engine.runner.model_runner import select_device
    try:
        if plan.device.startswith("cuda"):
            torch.cuda.set_device(rank)
        device = select_device(plan.device.partition(":")[0])  # "cuda": this rank's current device, indexed
        out = {"device": str(device)}
        tp = join_tp_group(device, rank, 2, addresses[0])
        out.update(_collectives(tp, device))
        out.update(_channel(store_port, rank, device, RESULT_S / 2))
        dist.destroy_process_group()
        host = RankHost(_config(plan.device.partition(":")[0]), "colocated", "tp2-0", rank=rank, tp_size=2, tp_address=addresses[1],
                        model_config=model_config, weights=weights.items())
        try:
            if rank == 0:
                out["tokens"] = _generate(host.worker, prompts, plan.output_len)
            elif not host.wait_stopped(RESULT_S):
                raise TimeoutError(f"rank 0 did not end this follower's loop within {RESULT_S:.0f} s")
        finally:
            host.shutdown()  # rank 0's ends the followers' loops
        conn.send(out)
    except Exception as exc:  # noqa: BLE001 -- reported in the section's JSON
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _generate(worker, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine.core.request import RequestMessage
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        worker.add_request(RequestMessage(f"r{i}", prompt, _greedy(max_tokens)))
    deadline, done = time.monotonic() + RESULT_S / 2, set()
    while len(done) < len(prompts) and time.monotonic() < deadline:
        for o in worker.poll_outputs(timeout=1.0):
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                done.add(o.request_id)
    if len(done) < len(prompts):
        raise TimeoutError(f"{len(prompts) - len(done)} of {len(prompts)} TP=2 requests unfinished")
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def two_gpu(plan: Plan) -> dict:
    from cluster.ranks.rank import free_address
    hf = _hf_llama(TINY, seed=0, device="cpu")
    mc = model_config_of(hf.config, "tiny")
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    del hf
    prompts = _prompts(NUM_PROMPTS, plan.prompt_len, mc.vocab_size, 40)
    store_port = int(free_address().rpartition(":")[2])
    store = dist.TCPStore("127.0.0.1", store_port, world_size=3, is_master=True, wait_for_workers=False)
    from kvtransfer.wire import cluster_secret
    cluster_secret()  # made here if none is set, into the environment the two ranks inherit: one TP key
    ctx = mp.get_context("spawn")
    addresses = (free_address(), free_address())
    conns, procs = [], []
    for rank in (0, 1):
        mine, child = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_rank_main, name=f"tp2-rank{rank}", daemon=True,
                                 args=(rank, plan, addresses, store_port, mc, weights, prompts, child)))
        procs[-1].start()
        child.close()
        conns.append(mine)
    deadline = time.monotonic() + 3 * RESULT_S
    ranks = []
    for rank, conn in enumerate(conns):
        ranks.append(conn.recv() if conn.poll(max(0.0, deadline - time.monotonic()))
                     else {"error": f"rank {rank} sent nothing within {3 * RESULT_S:.0f} s"})
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    del store
    out = {"ranks": [{k: v for k, v in r.items() if k != "tokens"} for r in ranks]}
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
    if errors:
        out["error"] = "; ".join(errors)
        return out
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.runner.model_runner import ModelRunner
    config = _config(plan.device)
    llm = LLM(engine=ColocatedEngine(config, runner=ModelRunner(config, model_config=mc, weights=weights.items())))
    want = [o.token_ids for o in llm.generate(prompts, _greedy(plan.output_len))]
    checks = [k for k in ("all_reduce_ok", "all_gather_ok", "broadcast_step_ok", "equal") if k in ranks[0]]
    equal = [got == w for got, w in zip(ranks[0]["tokens"], want)]
    out.update(tp2_prompts_equal_tp1=sum(equal), num_prompts=len(equal), channel_GBps=ranks[1]["GBps"],
               channel=ranks[0]["channel"])
    out["ok"] = all(equal) and all(r[k] for r in ranks for k in checks)
    return out
