"""The KV connector: what the workers see of KV transfer, in two roles (after vLLM v1's).

Prefill instance                                  Decode instance
  scheduler side (rank 0):                          scheduler side (rank 0):
    add(request, where its KV goes)                   reserve(request, slots) -> every rank expects it
    shipments(step) -> what this step ships            admit(per-rank polls) -> ready / failed requests
    take_delivered() -> acked or failed: free blocks   cancel(request) -> every rank forgets it
  worker side (every rank):                         worker side (every rank):
    start(shipments), save_layer(i) after layer i      expect(...), poll()
    finish(request, trailer)

Transport details stay below it (`KVSender` / `KVReceiver`): the router sees request outcomes,
a prefill result or a decode output with `kv_load_failed`. What the KV comes with (the instance
layer's trailer, engine/core/request.py) rides on the part from prefill rank 0 to decode rank 0 of KV
group 0, and stays on decode rank 0: the ranks' polls, which cross the TP group every step,
carry request ids only.

A model whose layers form several KV groups (ModelConfig.kv_layout: Gemma 2's sliding and global
layers) ships each group as a transfer of its own, `transfer_id(request, group)`, carrying that
group's tokens (a sliding group: only those its window still reads) into its block table; the
transport's layer i is the group's slab i. The request is ready once every group's transfer is.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from engine.core.config import KVLayout, window_start
from kvtransfer.base import CompletedTransfer, KVReceiver, KVSender, Transfer
from kvtransfer.params import KVTransferParams, expected_parts, kv_heads_of_rank, plan_head_slices
from kvtransfer.scatter import as_bytes, gather_tokens

logger = logging.getLogger(__name__)


@dataclass
class Shipment:
    """The KV of one KV group a step must ship for a request whose prompt completes in that step."""
    request_id: str
    params: KVTransferParams
    num_tokens: int  # shipped: the prompt's last tokens a decode step can still read (all, without a window)
    slots: torch.Tensor  # (num_tokens,) this instance's slots of those tokens, logical order
    group: int = 0  # the KV group whose layers it carries
    transfer_id: str = ""  # what the transport calls it: transfer_id(request_id, group, ...)

    def __post_init__(self):
        self.transfer_id = self.transfer_id or self.request_id


def transfer_id(request_id: str, group: int, num_groups: int) -> str:
    """The transport's id of a request's KV group: the request id itself with one group."""
    return request_id if num_groups == 1 else f"{request_id}#kv{group}"


def prompt_slots(block_ids: list[int], block_size: int, num_tokens: int, device=None, start: int = 0) -> torch.Tensor:
    """The cache slots of tokens [start, num_tokens) of a request holding `block_ids`."""
    return torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in range(start, num_tokens)],
                        dtype=torch.int64, device=device)


class PrefillConnector:
    def __init__(self, sender: KVSender, num_kv_heads: int, tp_rank: int, tp_size: int, lease_s: float,
                 kv_views=None, kv_layout: KVLayout | None = None):
        """`lease_s`: how long a finished prompt's blocks wait for the decode side's ack before
        they are freed anyway (and the request reported failed). `kv_views`: the attention
        backend's, where the cache is not in the torch layout (None: it is). `kv_layout`: the
        model's (None: one group of full-attention layers)."""
        self.sender, self.num_kv_heads, self.tp_rank, self.tp_size = sender, num_kv_heads, tp_rank, tp_size
        self.kv_layout = kv_layout
        self.kv_views = kv_views
        self.lease_s = lease_s
        self.my_heads = kv_heads_of_rank(num_kv_heads, tp_size, tp_rank)
        self._params: dict[str, KVTransferParams] = {}
        self._step: list[tuple[Shipment, list[tuple[int, int, Transfer]]]] = []
        self._open: dict[str, list[Transfer]] = {}  # request id -> its transfers, until finish()
        self._to_rank0: dict[str, Transfer] = {}  # request id -> its KV group 0's part to decode rank 0 (here)
        self._watch: queue.Queue = queue.Queue()
        self._delivered: queue.Queue[tuple[str, str | None]] = queue.Queue()
        threading.Thread(target=self._watch_transfers, daemon=True, name="kv-ack").start()

    # -- scheduler side (rank 0) ---------------------------------------------------------------------
    def add(self, request_id: str, params: KVTransferParams) -> None:
        self._params[request_id] = params

    def drop(self, request_id: str) -> None:
        """The request ended before shipping (aborted, refused)."""
        self._params.pop(request_id, None)

    def shipments(self, sched, block_ids_of, block_size: int, device) -> list[Shipment]:
        """The requests whose prompt completes in step `sched` (they sample: their KV is whole),
        one shipment per KV group, each with the prompt tokens from its `window_start` on, or from
        the first the decode instance's cache lacks (`decode_cached_tokens`, after the window's
        start: the decode side takes its hits only then). `block_ids_of(request_id)`: the request's
        block table per group."""
        windows = (None,) if self.kv_layout is None else self.kv_layout.windows
        out = []
        for r in sched.new_requests + sched.cached_requests:
            if r.sample:
                n = r.num_computed_tokens + len(r.token_ids)
                params = self._params[r.request_id]
                assert params.decode_cached_tokens < n, (r.request_id, params.decode_cached_tokens, n)
                for group, (window, table) in enumerate(zip(windows, block_ids_of(r.request_id))):
                    start = max(window_start(n, window), params.decode_cached_tokens)
                    slots = prompt_slots(table, block_size, n, device, start)
                    out.append(Shipment(r.request_id, params, n - start, slots, group,
                                        transfer_id(r.request_id, group, len(windows))))
        return out

    # -- worker side (every rank) ------------------------------------------------------------------
    def start(self, shipments: list[Shipment]) -> None:
        """Opens this step's transfers: one per decode rank that needs heads this rank holds."""
        self._step = []
        for s in shipments:
            parts = []
            for hs in plan_head_slices(self.num_kv_heads, self.tp_size, s.params.decode_tp_size):
                if hs.prefill_rank == self.tp_rank:
                    dest = s.params.endpoints[hs.decode_rank]
                    parts.append((hs.head_start, hs.head_end, self.sender.begin(
                        s.transfer_id, dest, hs.head_start, hs.head_end, s.num_tokens, s.slots,
                        s.params.trace_context)))
                    if hs.decode_rank == 0 and s.group == 0:
                        self._to_rank0[s.request_id] = parts[-1][2]
            self._step.append((s, parts))
            self._open.setdefault(s.request_id, []).extend(t for *_, t in parts)

    def save_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Layer `layer` of the model is computed: its KV of this step's shipments leaves (a copy,
        sent in the background), or, for a sender that `pulls`, its receivers may read it there.
        kv_cache: the pool (num_slabs, 2, num_blocks, block_size, local kv heads, head_dim); the
        layer is its group's slab, and the transport's layer number."""
        group, slab = (0, layer) if self.kv_layout is None else self.kv_layout.place[layer]
        if self.sender.pulls:  # the receivers read the layer where it lies
            for s, parts in self._step:
                for *_, transfer in parts if s.group == group else ():
                    transfer.layer_ready(slab)
            return
        kv_layer = kv_cache[slab]
        flat = kv_layer.view(2, -1, *kv_layer.shape[-2:])
        views = None if self.kv_views is None else self.kv_views(kv_layer)
        for s, parts in self._step:
            if s.group != group:
                continue
            if views is None:
                gathered = as_bytes(flat).index_select(1, s.slots).view(flat.dtype)  # (2, num_tokens, local heads, hd)
            else:
                gathered = gather_tokens(views, s.slots, kv_layer.shape[2])
            for head_start, head_end, transfer in parts:
                lo = head_start - self.my_heads.start
                transfer.send_layer(slab, gathered[:, :, lo:lo + head_end - head_start].contiguous())

    def finish(self, request_id: str, trailer: bytes = b"") -> None:
        """All layers are queued; `trailer` (rank 0; b"" elsewhere) goes with the part to decode
        rank 0. The request's blocks stay leased until every part is acknowledged, or the lease ends."""
        transfers = self._open.pop(request_id, [])
        to_rank0 = self._to_rank0.pop(request_id, None)
        for t in transfers:
            t.finish(trailer if t is to_rank0 else b"")
        self._params.pop(request_id, None)
        self._watch.put((request_id, transfers, time.monotonic() + self.lease_s))

    def take_delivered(self) -> list[tuple[str, str | None]]:
        """(request id, error or None) of the requests whose transfers ended since the last call."""
        out = []
        while True:
            try:
                out.append(self._delivered.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Stops watching (the sender is closed by its owner)."""
        self._watch.put(None)

    def _watch_transfers(self) -> None:
        while (item := self._watch.get()) is not None:
            request_id, transfers, lease_end = item
            error = None
            for t in transfers:
                try:
                    t.wait(timeout=max(0.0, lease_end - time.monotonic()))
                except Exception as exc:  # TransferError (lease over), peer death: the router retries elsewhere
                    error = f"KV transfer failed: {exc}"
            self._delivered.put((request_id, error))


class DecodeConnector:
    def __init__(self, receiver: KVReceiver | None, num_kv_heads: int, tp_rank: int, tp_size: int,
                 num_groups: int = 1):
        """`num_groups`: the model's KV groups (ModelConfig.kv_layout), a transfer each."""
        self.receiver, self.num_kv_heads, self.tp_rank, self.tp_size = receiver, num_kv_heads, tp_rank, tp_size
        self.num_groups = num_groups
        self._followers = None
        # request id -> per KV group, per rank: its KV is complete there
        self._complete: dict[str, list[list[bool]]] = {}
        self._trailers: dict[str, CompletedTransfer] = {}  # rank 0: transfer id -> how it completed, until admitted

    def _ids(self, request_id: str) -> list[str]:
        return [transfer_id(request_id, g, self.num_groups) for g in range(self.num_groups)]

    # -- worker side (every rank) ------------------------------------------------------------------
    def expect(self, request_id: str, slots: list[torch.Tensor], prefill_tp: int) -> None:
        """`slots`: per KV group, where its shipped tokens go."""
        assert len(slots) == self.num_groups, (len(slots), self.num_groups)
        parts = expected_parts(self.num_kv_heads, prefill_tp, self.tp_size, self.tp_rank)
        for tid, group_slots in zip(self._ids(request_id), slots):
            self.receiver.expect(tid, group_slots, parts)

    def forget(self, request_id: str) -> None:
        """Once this returns, no more KV of `request_id` is written on this rank."""
        if self.receiver is not None:
            for tid in self._ids(request_id):
                self.receiver.cancel(tid)

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """(transfer ids completed here, failed [(transfer id, why)]) since the last call: what this
        rank contributes to `admit`. Rank 0 keeps the trailers."""
        if self.receiver is None:
            return [], []
        done, failed = self.receiver.poll()
        if self.tp_rank == 0:
            self._trailers.update((c.request_id, c) for c in done)
        return [c.request_id for c in done], failed

    # -- scheduler side (rank 0) ---------------------------------------------------------------------
    def set_followers(self, followers) -> None:
        """Rank 0 of tp > 1: the other ranks, with `expect(request_id, slots, prefill_tp)` and
        `forget(request_id)`, each returning once that rank has done it."""
        self._followers = followers

    @property
    def awaiting(self) -> bool:
        """Some reserved request's KV is still arriving (the ranks' polls are needed)."""
        return bool(self._complete)

    def reserve(self, request_id: str, slots: list[torch.Tensor], prefill_tp: int) -> None:
        """The request's blocks are allocated (`slots` per KV group): every rank expects its KV
        before this returns (the router tells the prefill instance only then)."""
        self._complete[request_id] = [[False] * self.tp_size for _ in range(self.num_groups)]
        self.expect(request_id, slots, prefill_tp)
        if self._followers is not None:
            self._followers.expect(request_id, slots, prefill_tp)

    def cancel(self, request_id: str) -> bool:
        """Forgets a reserved request on every rank (before its blocks can go to another);
        False if it was not awaiting KV."""
        if self._complete.pop(request_id, None) is None:
            return False
        for tid in self._ids(request_id):
            self._trailers.pop(tid, None)
        self.forget(request_id)
        if self._followers is not None:
            self._followers.forget(request_id)
        return True

    def admit(self, polls: list) -> tuple[list[CompletedTransfer], dict[str, str]]:
        """From every rank's poll: the requests whose KV is complete on all ranks, in every group,
        each with the trailer of its group 0 on rank 0 (b"" if none came), and the failed ones with
        why. Both are forgotten here."""
        request_of = {tid: (rid, g) for rid in self._complete for g, tid in enumerate(self._ids(rid))}
        failed = {}
        for rank, (done, errors) in enumerate(polls):
            for tid in done:
                if tid in request_of:
                    rid, g = request_of[tid]
                    self._complete[rid][g][rank] = True
            for tid, reason in errors:
                rid = request_of.get(tid, (tid,))[0]
                failed[rid] = f"KV transfer to rank {rank} failed: {reason}"
        ready = []
        for request_id, groups in list(self._complete.items()):
            if request_id not in failed and all(all(ranks) for ranks in groups):
                del self._complete[request_id]
                first = [self._trailers.pop(tid, None) for tid in self._ids(request_id)][0] or CompletedTransfer("")
                ready.append(first._replace(request_id=request_id))
        failed = {rid: why for rid, why in failed.items() if self.cancel(rid)}
        return ready, failed
