"""KV transfer bandwidth, prefill process -> decode process: pdserve's transport against raw gloo
send/recv of the same bytes, in the same run, between the same two processes.

    python -m bench.kv_transfer                 # SmolLM2's KV shape (30 layers, 3 KV heads, 64, bf16)
    python -m bench.kv_transfer --tokens 1024 4096 --reps 5 --json
    python -m bench.kv_transfer --slots contiguous  # where the reservation's blocks lie (default: both)
    python -m bench.kv_transfer --kv-checksum   # also with checksums, interleaved in the same rounds
    python -m bench.kv_transfer --control-auth-off  # also with the control channel unauthenticated
    python -m bench.kv_transfer --payload-mac-off   # also the data channel without payload MACs
    ip netns exec A python -m bench.kv_transfer --receiver-netns B --sender-host IP_A --receiver-host IP_B
                                                # two hosts (network namespaces: bench/multihost.py)

Raw gloo sends each layer's bytes as one message (what the transport's data channel sends,
without its control messages and the receiver's scatter into paged blocks); "raw gloo, one
message" sends a request's whole KV at once, the best case. pdserve's numbers are the
handshake-free steady state: the pair is built by a warm-up transfer first, as in serving.
The receiving request's slots are either random blocks ("random": a fragmented cache; the
receiver takes each layer into a buffer and scatters it) or consecutive blocks ("contiguous":
it receives K and V straight into the cache). "same device" is the transport between two ranks
on one device (here one CPU): the sender writes into the receiver's cache, shared with it
(shared_cache.py), against a plain copy of the same bytes within one process. `--kv-checksum`
adds both transports with checksums (kvtransfer/wire.py) to every round, each pair of a
transport with and without them timed back to back, in alternating order, and reports their
ratio per round (the median): what checksums cost on a shared machine, drift cancelled.
`--control-auth-off` does the same with both transports' control channel unauthenticated
(kvtransfer/control.py `authenticate=False`, which exists for this comparison only): the ratio
authenticated / unauthenticated is what the handshake-free steady state pays for per-message MACs.
`--payload-mac-off` adds the data-channel transport without payload MACs (wire.py PartMac;
`payload_mac=False`, for this comparison only; same-device writes carry none): the ratio with /
without is what the keyed BLAKE3 over every payload byte costs. The unauthenticated transport
has no payload MACs either.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from engine.core.request import Handover
from kvtransfer.wire import cluster_secret
from kvtransfer.channel import RECEIVER, SENDER, GlooChannel
from kvtransfer.params import CompatRecord, KVEndpoint
from kvtransfer.receiver import TorchDistReceiver
from kvtransfer.sender import TorchDistSender

BLOCK = 16
DONE = torch.zeros(1, dtype=torch.uint8)
VARIANTS = ("_checksum", "_noauth", "_nomac")  # suffixes of the transports timed beside the plain two


def _shape(args, tokens: int) -> tuple[int, int]:
    """(bytes per layer message, bytes per request)."""
    layer = 2 * tokens * args.kv_heads * args.head_dim * 2  # bf16
    return layer, layer * args.layers


def _compat(args, kv_checksum: bool = False) -> CompatRecord:
    return CompatRecord("bench", "bfloat16", args.layers, args.kv_heads, args.head_dim, block_size=BLOCK,
                        kv_checksum=kv_checksum)


def _ends(args) -> list[tuple[str, bool, bool, bool, bool]]:
    """The transports timed: (name, same device, checksums, control channel authenticated, payload MACs)."""
    ends = [("pdserve", False, False, True, True), ("same_device", True, False, True, True)]
    if args.kv_checksum:
        ends += [("pdserve_checksum", False, True, True, True), ("same_device_checksum", True, True, True, True)]
    if args.control_auth_off:
        ends += [("pdserve_noauth", False, False, False, False), ("same_device_noauth", True, False, False, False)]
    if args.payload_mac_off:
        ends += [("pdserve_nomac", False, False, True, False)]
    return ends


def enter_netns(name: str) -> None:
    """Moves this (single-threaded) process into the network namespace `name` (`ip netns`)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")


def receiver_main(conn, args) -> None:
    if args.receiver_netns:
        enter_netns(args.receiver_netns)
    torch.set_num_threads(1)
    store = dist.TCPStore(args.receiver_host, 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    pg = GlooChannel(dist.PrefixStore("raw/", store), RECEIVER, args.receiver_host, 120.0)
    max_tokens = max(args.tokens)
    num_blocks = 2 * max_tokens // BLOCK + 2
    cache = torch.zeros(args.layers, 2, num_blocks, BLOCK, args.kv_heads, args.head_dim, dtype=torch.bfloat16)
    ends = [TorchDistReceiver(_compat(args, checked), torch.zeros_like(cache), 0, host=args.receiver_host,
                              share_cache=same, control_auth=authed, payload_mac=mac)
            for _, same, checked, authed, mac in _ends(args)]
    conn.send([end.endpoint_address for end in ends])
    for layout, tokens in _cases(args):
        layer_bytes, request_bytes = _shape(args, tokens)
        buf = torch.empty(request_bytes, dtype=torch.uint8)
        blocks = torch.randperm(num_blocks - 1)[:tokens // BLOCK] + 1 if layout == "random" else \
            torch.arange(tokens // BLOCK) + 1 + torch.randint(num_blocks - tokens // BLOCK, ())
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        for rnd in range(args.rounds):
            for _ in range(args.reps * args.layers):  # raw, per layer
                pg.recv(buf[:layer_bytes], 120.0)
            for _ in range(args.reps):  # raw, one message
                pg.recv(buf, 120.0)
            pg.send(DONE, 120.0)
            for r in range(args.reps + 1):
                for end in ends:
                    end.expect(f"{layout}-{tokens}-{rnd}-{r}", slots, 1)
            conn.send("ready")
            got = 0
            while got < len(ends) * (args.reps + 1):
                for end in ends:
                    done, failed = end.poll()
                    assert not failed, failed
                    got += len(done)
                time.sleep(0.01)
    conn.send({name: end.stats for (name, *_), end in zip(_ends(args), ends)})
    conn.recv()
    os._exit(0)  # NOTE: skip interpreter teardown, which aborts on gloo's still-running threads


def _cases(args) -> list[tuple[str, int]]:
    return [(layout, tokens) for layout in args.slots for tokens in args.tokens]


def _time_raw(pg, args, tokens: int) -> tuple[float, float]:
    layer_bytes, request_bytes = _shape(args, tokens)
    layer = torch.randint(0, 255, (layer_bytes,), dtype=torch.uint8)
    whole = torch.randint(0, 255, (request_bytes,), dtype=torch.uint8)
    start = time.perf_counter()
    for _ in range(args.reps * args.layers):
        pg.send(layer, 120.0)
    mid = time.perf_counter()
    for _ in range(args.reps):
        pg.send(whole, 120.0)
    ack = torch.empty(1, dtype=torch.uint8)
    pg.recv(ack, 120.0)
    end = time.perf_counter()
    return mid - start, end - mid


def _time_pdserve(tx, dest, args, tokens: int, prefix: str) -> float:
    kv = [torch.randn(2, tokens, args.kv_heads, args.head_dim).to(torch.bfloat16) for _ in range(args.layers)]

    def one(rid: str):
        t = tx.begin(rid, dest, 0, args.kv_heads, tokens)
        for layer in range(args.layers):
            t.send_layer(layer, kv[layer])
        t.finish(Handover(1).pack())  # what a prefill hands over with a request (engine/core/request.py)
        return t

    one(f"{prefix}-{args.reps}").wait(60)  # warm-up: the first transfer of a size
    start = time.perf_counter()
    transfers = [one(f"{prefix}-{r}") for r in range(args.reps)]
    for t in transfers:
        t.wait(120)
    return time.perf_counter() - start


def _time_copy(args, tokens: int) -> float:
    """One copy of a request's bytes within this process, layer by layer: the same-device ceiling."""
    kv = [torch.randn(2, tokens, args.kv_heads, args.head_dim).to(torch.bfloat16) for _ in range(args.layers)]
    dst = [torch.empty_like(t) for t in kv]
    start = time.perf_counter()
    for _ in range(args.reps):
        for d, t in zip(dst, kv):
            d.copy_(t)
    return time.perf_counter() - start


def start_receiver(target, args):
    """`target(conn, args)` in a spawned process (the decode side); returns (this end's pipe, the
    process). This process then computes on one thread, as a rank does."""
    cluster_secret()  # made here if the environment has none: the receiver's process inherits it
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, args), daemon=True)
    proc.start()
    torch.set_num_threads(1)
    return parent, proc


def run(args) -> dict:
    parent, proc = start_receiver(receiver_main, args)
    store = dist.TCPStore(args.receiver_host, parent.recv(), is_master=False, wait_for_workers=False)
    pg = GlooChannel(dist.PrefixStore("raw/", store), SENDER, args.sender_host, 120.0)
    addresses = parent.recv()
    senders = {}
    for (name, same, checked, authed, mac), address in zip(_ends(args), addresses):
        tx = TorchDistSender(_compat(args, checked), f"bench-{name}", host=args.sender_host, same_device=same,
                             control_auth=authed, payload_mac=mac)
        senders[name] = (tx, KVEndpoint("bench", 0, *address))
    rows = []
    for layout, tokens in _cases(args):
        _, request_bytes = _shape(args, tokens)
        total = request_bytes * args.reps
        per_layer, whole, copy = [], [], []
        gbps = {name: [] for name in senders}
        for rnd in range(args.rounds):  # alternate the methods: drift on a shared machine hits both
            raw_layer_s, raw_whole_s = _time_raw(pg, args, tokens)
            assert parent.recv() == "ready"
            for name in senders if rnd % 2 == 0 else _variants_first(list(senders)):
                tx, dest = senders[name]
                gbps[name].append(total / _time_pdserve(tx, dest, args, tokens, f"{layout}-{tokens}-{rnd}") / 1e9)
            per_layer.append(total / raw_layer_s / 1e9)
            whole.append(total / raw_whole_s / 1e9)
            copy.append(total / _time_copy(args, tokens) / 1e9)
        med = statistics.median
        ours, same = gbps["pdserve"], gbps["same_device"]
        rows.append(_variant_columns(gbps) | {
                     "slots": layout, "tokens": tokens, "bytes_per_request": request_bytes, "rounds": args.rounds,
                     "raw_gloo_per_layer_GBps": med(per_layer), "raw_gloo_one_message_GBps": med(whole),
                     "pdserve_GBps": med(ours), "pdserve_ms_per_request": request_bytes / med(ours) / 1e6,
                     "pdserve_vs_raw_per_layer": med(o / r for o, r in zip(ours, per_layer)),
                     "pdserve_vs_raw_one_message": med(o / r for o, r in zip(ours, whole)),
                     "same_device_GBps": med(same), "same_device_ms_per_request": request_bytes / med(same) / 1e6,
                     "copy_GBps": med(copy), "same_device_vs_copy": med(o / c for o, c in zip(same, copy)),
                     "same_device_vs_pdserve": med(o / p for o, p in zip(same, ours))})
    rx_stats = parent.recv()
    parent.send("bye")
    proc.join(timeout=10)
    shared_connections = {name: tx.stats.get("shared_connections", 0) for name, (tx, _) in senders.items()}
    for tx, _ in senders.values():
        tx.close()
    return {"same_device_connections": shared_connections, "kv_checksum": args.kv_checksum,
            "control_auth_off": args.control_auth_off, "payload_mac_off": args.payload_mac_off,
            "layers": args.layers, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": "bfloat16",
            "reps": args.reps, "rows": rows, "receiver_stats": rx_stats}


def _variants_first(names: list[str]) -> list[str]:
    """The odd rounds' order: each transport's variants (VARIANTS) run before it, in reverse."""
    bases = [name for name in names if not name.endswith(VARIANTS)]
    return [n for base in bases for n in reversed([base, *(base + v for v in VARIANTS if base + v in names)])]


def _variant_columns(gbps: dict[str, list[float]]) -> dict:
    """With checksums: their GB/s, and per round the ratio to the same transport without (median).
    With the control channel unauthenticated: its GB/s, and per round authenticated / it (median).
    Without payload MACs (the data channel only): its GB/s, and per round with / without (median)."""
    out, med = {}, statistics.median
    for name in ("pdserve", "same_device"):
        if f"{name}_checksum" in gbps:
            checked = gbps[f"{name}_checksum"]
            out[f"{name}_checksum_GBps"] = med(checked)
            out[f"{name}_checksum_vs_plain"] = med(c / p for c, p in zip(checked, gbps[name]))
        if f"{name}_noauth" in gbps:
            plain = gbps[f"{name}_noauth"]
            out[f"{name}_noauth_GBps"] = med(plain)
            out[f"{name}_auth_vs_noauth"] = med(a / p for a, p in zip(gbps[name], plain))
        if f"{name}_nomac" in gbps:
            plain = gbps[f"{name}_nomac"]
            out[f"{name}_nomac_GBps"] = med(plain)
            out[f"{name}_mac_vs_nomac"] = med(a / p for a, p in zip(gbps[name], plain))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_transfer", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="requests per timed batch")
    p.add_argument("--rounds", type=int, default=5, help="alternating raw/pdserve rounds; medians are reported")
    p.add_argument("--slots", nargs="+", choices=["random", "contiguous"], default=["random", "contiguous"],
                   help="the receiving request's blocks: random (scattered into) or consecutive (received into)")
    p.add_argument("--kv-checksum", action="store_true",
                   help="also time both transports with KV checksums, in the same rounds (their ratio to without)")
    p.add_argument("--control-auth-off", action="store_true",
                   help="also time both transports with the control channel unauthenticated, in the same rounds "
                        "(the ratio authenticated / unauthenticated): the cost of the per-message MACs")
    p.add_argument("--payload-mac-off", action="store_true",
                   help="also time the data-channel transport without payload MACs, in the same rounds (the ratio "
                        "with / without): the cost of the keyed BLAKE3 over the KV bytes")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sender-host", default="127.0.0.1", help="the sender's address (its host's, across hosts)")
    p.add_argument("--receiver-host", default="127.0.0.1", help="the receiver's address")
    p.add_argument("--receiver-netns", default=None, help="run the receiver in this network namespace")
    args = p.parse_args(argv)
    if any(t % BLOCK for t in args.tokens):
        p.error(f"--tokens must be multiples of {BLOCK}")
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        _report(result, args)
    return 0


def _report(result: dict, args) -> None:
    """The result as text: a table of the transports, then the variants timed beside them."""
    print(f"KV of {args.layers} layers x {args.kv_heads} heads x {args.head_dim}, bf16; {args.reps} requests each")
    print(f"medians of {args.rounds} alternating rounds")
    print(f"{'slots':>10} {'tokens':>7} {'MB/req':>8} {'raw/layer':>10} {'raw/whole':>10} {'pdserve':>9} "
          f"{'vs layer':>9} {'vs whole':>9} {'ms/req':>7} {'same dev':>9} {'vs copy':>8} {'ms/req':>7}")
    for r in result["rows"]:
        print(f"{r['slots']:>10} {r['tokens']:>7} {r['bytes_per_request'] / 1e6:>8.1f} "
              f"{r['raw_gloo_per_layer_GBps']:>9.2f}G {r['raw_gloo_one_message_GBps']:>9.2f}G "
              f"{r['pdserve_GBps']:>8.2f}G {r['pdserve_vs_raw_per_layer']:>9.2f} "
              f"{r['pdserve_vs_raw_one_message']:>9.2f} {r['pdserve_ms_per_request']:>7.1f} "
              f"{r['same_device_GBps']:>8.2f}G {r['same_device_vs_copy']:>8.2f} "
              f"{r['same_device_ms_per_request']:>7.1f}")
    variants = [(args.kv_checksum, "--kv-checksum (GB/s; per-round ratio to the same transport without, median)",
                 "checksum_GBps", "checksum_vs_plain"),
                (args.control_auth_off, "--control-auth-off (GB/s unauthenticated; per-round ratio authenticated "
                 "/ unauthenticated, median)", "noauth_GBps", "auth_vs_noauth"),
                (args.payload_mac_off, "--payload-mac-off (GB/s without payload MACs; per-round ratio with / "
                 "without, median; data channel only)", "nomac_GBps", "mac_vs_nomac")]
    for on, title, rate, ratio in variants:
        if not on:
            continue
        print(f"with {title}")
        for r in result["rows"]:
            same = (f"   same device {r['same_device_' + rate]:.2f}G x{r['same_device_' + ratio]:.3f}"
                    if 'same_device_' + rate in r else "")
            print(f"{r['slots']:>10} {r['tokens']:>7}  data channel {r['pdserve_' + rate]:.2f}G "
                  f"x{r['pdserve_' + ratio]:.3f}{same}")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # NOTE: skip interpreter teardown, which may abort on gloo's still-running threads
