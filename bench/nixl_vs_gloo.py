"""KV transfer from a prefill rank's pool to a decode process: the torch transport (gloo: the
prefill gathers each layer's tokens, as PrefillConnector.save_layer does, and sends them) against
nixl (the decode reads the pool with NIXL READs), in the same run, between the same two processes;
and TTFT through a 1P1D cluster with each.

    python -m bench.nixl_vs_gloo                               # SmolLM2's KV shape, 1k/4k/16k tokens
    python -m bench.nixl_vs_gloo --tokens 1024 4096 --rounds 3 --json
    python -m bench.nixl_vs_gloo --ttft 1024 4096             # also TTFT through 1P1D SmolLM2 (in process)
    python -m bench.nixl_vs_gloo --tokens --ttft 16384 --ttft-model DIR --ttft-reps 1   # a longer-context model
    python -m bench.nixl_vs_gloo --two-hosts --rates 1gbit    # also across two network namespaces joined by a
                                                              # bridge, as is and with both links shaped (tc tbf)

Per transport and prompt length: GB/s of KV (a request's bytes / its time from begin to ack,
`--reps` requests in flight), and the prefill side's CPU per request: `step_ms`, the time the
thread that queues the transfer spends (what the prefill step pays: the gather and queueing for
gloo, announcements for nixl), and `process_ms`, the whole prefill process (its sending threads,
and NIXL's progress thread serving the reads). Rounds alternate the transports' order; medians.
The decode's slots are random blocks (a fragmented cache: nixl reads them one block run each,
straight into the cache); the prefill's are consecutive.

`--two-hosts` (root): the same between two hosts of a bridge (bench/multihost_net.py's Switch: a
network namespace each, a veth pair into the bridge), once as is and once per `--rates` with both
hosts' links shaped. UCX_TLS=tcp there: the two namespaces share one kernel, so UCX would otherwise
move the bytes through shared memory and the link would not be measured. In one host, UCX picks
(shared memory or cross-memory attach between two processes).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time

import torch

from bench.kv_transfer import enter_netns, start_receiver
from engine.core.request import Handover
from kvtransfer.base import KVPool
from kvtransfer.nixl_receiver import NixlReceiver
from kvtransfer.nixl_sender import NixlSender
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.receiver import TorchDistReceiver
from kvtransfer.sender import TorchDistSender
from kvtransfer.wire import cluster_secret

BLOCK = 16
TRANSPORTS = ("gloo", "nixl")


def _compat(args) -> CompatRecord:
    return CompatRecord("bench", "bfloat16", args.layers, args.kv_heads, args.head_dim, block_size=BLOCK)


def _pool(args) -> torch.Tensor:
    blocks = 2 * max(args.tokens) // BLOCK + 2
    return torch.zeros(args.layers, 2, blocks, BLOCK, args.kv_heads, args.head_dim, dtype=torch.bfloat16)


def receiver_main(conn, args) -> None:
    if args.receiver_netns:
        enter_netns(args.receiver_netns)
    torch.set_num_threads(1)
    ends = {"gloo": TorchDistReceiver(_compat(args), _pool(args), 0, host=args.receiver_host),
            "nixl": NixlReceiver(_compat(args), _pool(args), 0, host=args.receiver_host)}
    conn.send({name: end.endpoint_address for name, end in ends.items()})
    num_blocks = ends["gloo"].kv_cache.shape[2]
    while (msg := conn.recv()) != "bye":
        name, rids, tokens = msg
        blocks = torch.randperm(num_blocks - 1)[:-(-tokens // BLOCK)] + 1
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:tokens]
        for rid in rids:
            ends[name].expect(rid, slots, 1)
        conn.send("ready")
        got = 0
        while got < len(rids):
            done, failed = ends[name].poll()
            assert not failed, failed
            got += len(done)
            time.sleep(0.002)
        conn.send("done")
    conn.send({name: end.stats for name, end in ends.items()})
    os._exit(0)  # NOTE: skip interpreter teardown, which aborts on gloo's still-running threads


def _time(tx, name: str, dest: KVEndpoint, pool: torch.Tensor, slots: torch.Tensor, rids: list[str]) -> dict:
    """Sends `rids` (one part each, every layer of `slots`); seconds, step thread and process CPU."""
    flat = [pool[layer].view(2, -1, *pool.shape[-2:]) for layer in range(pool.shape[0])]
    trailer = Handover(1).pack()
    cpu0, step0, start = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    transfers = []
    for rid in rids:
        t = tx.begin(rid, dest, 0, pool.shape[4], slots.numel(), slots)
        for layer in range(pool.shape[0]):
            if name == "nixl":
                t.layer_ready(layer)
            else:  # what save_layer does: gather the shipped tokens, then hand them over
                t.send_layer(layer, flat[layer].index_select(1, slots))
        t.finish(trailer)
        transfers.append(t)
    step = time.thread_time() - step0
    for t in transfers:
        t.wait(300)
    seconds, cpu1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    return {"s": seconds, "step_s": step, "cpu_s": cpu}


def transfer_rows(args) -> tuple[list[dict], dict]:
    parent, proc = start_receiver(receiver_main, args)
    addresses = parent.recv()
    pool = _pool(args)
    pool.normal_()
    senders = {"gloo": TorchDistSender(_compat(args), "bench-gloo", host=args.sender_host),
               "nixl": NixlSender(_compat(args), "bench-nixl", KVPool(pool, "torch", 0), host=args.sender_host)}
    dests = {name: KVEndpoint("bench", 0, *address) for name, address in addresses.items()}
    rows = []
    for tokens in args.tokens:
        slots = torch.arange(BLOCK, BLOCK + tokens)
        request_bytes = 2 * tokens * args.kv_heads * args.head_dim * 2 * args.layers
        got = {name: [] for name in TRANSPORTS}
        for rnd in range(args.rounds + 1):  # round 0 warms each pair up (its connection, first sizes)
            for name in TRANSPORTS if rnd % 2 else reversed(TRANSPORTS):
                rids = [f"{name}-{tokens}-{rnd}-{r}" for r in range(args.reps)]
                parent.send((name, rids, tokens))
                assert parent.recv() == "ready"
                timed = _time(senders[name], name, dests[name], pool, slots, rids)
                assert parent.recv() == "done"
                if rnd:
                    got[name].append(timed)
        med = statistics.median
        row = {"tokens": tokens, "bytes_per_request": request_bytes, "rounds": args.rounds, "reps": args.reps}
        for name, runs in got.items():
            row[f"{name}_GBps"] = med(request_bytes * args.reps / r["s"] / 1e9 for r in runs)
            row[f"{name}_ms_per_request"] = med(r["s"] / args.reps * 1e3 for r in runs)
            row[f"{name}_step_ms_per_request"] = med(r["step_s"] / args.reps * 1e3 for r in runs)
            row[f"{name}_process_cpu_ms_per_request"] = med(r["cpu_s"] / args.reps * 1e3 for r in runs)
        row["nixl_vs_gloo_GBps"] = med(g["s"] / n["s"] for n, g in zip(got["nixl"], got["gloo"]))
        rows.append(row)
    parent.send("bye")
    rx_stats = parent.recv()
    proc.join(timeout=10)
    for tx in senders.values():
        tx.close()
    return rows, rx_stats


def ttft_rows(args) -> list[dict]:
    """TTFT of one request at a time through an in-process 1P1D SmolLM2 cluster per transport."""
    from cluster.control.cluster import Cluster
    from cluster.spec import ClusterSpec
    from engine.core.request import SamplingParams

    def random_prompts(n: int, lengths: list[int], seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, 20000) for _ in range(lengths[0])] for _ in range(n)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    out = {n: {} for n in args.ttft}
    for transport in ("torch", "nixl"):
        spec = ClusterSpec(model=args.ttft_model, dtype="bfloat16", device="cpu",
                           num_kv_blocks=-(-max(args.ttft) * 2 // 16) + 8, max_num_batched_tokens=4096,
                           kv_transport=transport, num_threads=args.ttft_threads)
        with Cluster(spec, use_ray=False) as cluster:
            cluster.generate(random_prompts(1, [64], seed=1), params)  # warm-up: the pair's connection
            for n in args.ttft:
                times = []
                for i in range(args.ttft_reps):
                    s = cluster.submit(f"ttft-{transport}-{n}-{i}", random_prompts(1, [n], seed=100 + i)[0], params)
                    s.result(timeout=600)
                    times.append(s.first_token_s - s.arrival_s)
                out[n]["gloo" if transport == "torch" else "nixl"] = statistics.median(times)
    return [{"prompt_tokens": n, "gloo_ttft_s": v["gloo"], "nixl_ttft_s": v["nixl"],
             "nixl_vs_gloo": v["nixl"] / v["gloo"]} for n, v in out.items()]


def two_host_rows(args) -> list[dict]:
    """The transfer rows between two network namespaces, as is and with each rate in `--rates`."""
    import secrets
    import subprocess
    import sys
    from bench.multihost_net import Switch
    switch = Switch(secrets.token_hex(2))
    switch.create()
    links = []
    try:
        links = [switch.plug("a", 2), switch.plug("b", 3)]
        out = []
        for rate in [None, *args.rates]:
            for link in links if rate else ():
                switch.slow(link, rate)
            argv = ["ip", "netns", "exec", links[0].netns, sys.executable, "-m", "bench.nixl_vs_gloo", "--json",
                    "--receiver-netns", links[1].netns, "--sender-host", links[0].ip, "--receiver-host", links[1].ip,
                    "--tokens", *map(str, args.tokens), "--reps", str(args.reps), "--rounds", str(args.rounds)]
            env = {**os.environ, "UCX_TLS": "tcp", "PDSERVE_CLUSTER_SECRET": cluster_secret().decode()}
            run = subprocess.run(argv, capture_output=True, text=True, env=env, check=True, timeout=3600)
            rows = json.loads(run.stdout.strip().splitlines()[-1])["transfer"]
            out += [{"link": rate or "bridge", **row} for row in rows]
            for link in links if rate else ():
                switch.unslow(link)
        return out
    finally:
        for link in links:
            switch.unplug(link)
        switch.destroy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nixl_vs_gloo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096, 16384])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="requests in flight per timed batch")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds after a warm-up; medians reported")
    p.add_argument("--ttft", type=int, nargs="*", default=[], help="prompt lengths for the TTFT section")
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--ttft-model", default="smollm2", help="the TTFT section's model (a checkpoint folder, or a name)")
    p.add_argument("--ttft-threads", type=int, default=1, help="threads per rank in the TTFT section")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sender-host", default="127.0.0.1")
    p.add_argument("--receiver-host", default="127.0.0.1")
    p.add_argument("--receiver-netns", default=None, help="run the receiver in this network namespace")
    p.add_argument("--two-hosts", action="store_true", help="also between two network namespaces (root)")
    p.add_argument("--rates", nargs="*", default=[], help="with --two-hosts: also with both links shaped to these")
    args = p.parse_args(argv)
    rows, rx_stats = transfer_rows(args) if args.tokens else ([], {})
    result = {"ucx_tls": os.environ.get("UCX_TLS", ""), "transfer": rows, "receiver_stats": rx_stats,
              "two_hosts": two_host_rows(args) if args.two_hosts else [],
              "ttft": ttft_rows(args) if args.ttft else []}
    if args.json:
        print(json.dumps(result))
        return 0
    for r in rows:
        print(f"{r['tokens']:>6} tokens  {r['bytes_per_request'] / 2**20:7.1f} MiB/request  "
              + "  ".join(f"{n}: {r[f'{n}_GBps']:.2f} GB/s, step {r[f'{n}_step_ms_per_request']:.1f} ms, "
                          f"process {r[f'{n}_process_cpu_ms_per_request']:.1f} ms" for n in TRANSPORTS))
    for r in result["two_hosts"]:
        print(f"two hosts, {r['link']}: {r['tokens']:>6} tokens  "
              + "  ".join(f"{n}: {r[f'{n}_GBps']:.2f} GB/s, step {r[f'{n}_step_ms_per_request']:.1f} ms"
                          for n in TRANSPORTS))
    for r in result["ttft"]:
        print(f"TTFT {r['prompt_tokens']:>6} tokens: gloo {r['gloo_ttft_s']:.3f} s, nixl {r['nixl_ttft_s']:.3f} s "
              f"({r['nixl_vs_gloo']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
