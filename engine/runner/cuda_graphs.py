"""CUDA graphs for decode steps (issue 13): a step where every scheduled request computes one new
token is replayed from a graph captured for a padded batch size and a bucket of context blocks,
instead of launching every kernel from Python.

    captured (batch B, blocks M): static input_ids, positions, slot_mapping (B,), seq_lens (B,),
    block_tables (B, M) -> logits (B, vocab)

A step of n requests whose longest context needs m blocks runs in the graph of the smallest
B >= n and M >= m, among the pairs whose B x M x block_size context tokens stay within
`max_context_tokens` (the torch backend gathers every row's M blocks, so the pair's memory grows
with that product); a longer step runs eagerly. Padded rows compute token 0 at position 0 into
slot 0: block 0 is the null block, which no real request reads with any weight (positions past a
row's length get -inf), so their writes there are harmless and their logits are dropped. The
graphs run the torch attention backend's static decode (`graph_backend`): the main backend's own
where it is torch, else the torch backend over the same blocks, where the main backend keeps
torch's block layout (flex, flash_attn: their pure-decode steps replay from graphs too, issue 50;
their prefills and mixed steps stay theirs); a backend with its own layout (vllm_cpu) has none.
One rank only (no collective inside a graph); a step that does not fit runs eagerly. The graphs' own memory (the largest pair's activations, and every graph's logits)
is reserved by the KV budget before the pool is sized (engine/runner/kv_budget.py: an eager step of the
largest pair is profiled), and what capture took is logged beside it. With
`capture=False` (any device) the same static step runs eagerly: the CPU tests check it against the
plain path.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata, BaseAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MAX_CONTEXT_TOKENS = 1 << 18  # per captured graph: batch x context blocks x block size


def block_buckets(max_blocks: int, smallest: int = 4) -> list[int]:
    """Context buckets, in blocks: powers of two from `smallest`, the last one `max_blocks`."""
    out, m = [], smallest
    while m < max_blocks:
        out.append(m)
        m *= 2
    return out + [max_blocks]


def batch_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes graphs are captured for: BATCH_SIZES below `max_batch`, then it."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


def capture_sizes(max_batch: int, max_blocks: int, block_size: int,
                  max_context_tokens: int = MAX_CONTEXT_TOKENS) -> set[tuple[int, int]]:
    """The (batch, context blocks) pairs DecodeGraphs captures: those within `max_context_tokens`.
    The KV budget (engine/runner/kv_budget.py) reads them before the pool exists, to reserve the graphs'
    memory."""
    return {(b, m) for b in batch_sizes(max_batch) for m in block_buckets(max_blocks)
            if b * m * block_size <= max_context_tokens}


def graph_backend(backend: BaseAttentionBackend) -> BaseAttentionBackend | None:
    """The backend whose static decode step the graphs capture: `backend` if it has one (torch),
    else a torch backend over the same blocks where `backend` keeps torch's layout; None where its
    blocks are laid out for its own kernels."""
    if backend.has_static_decode:
        return backend
    return None if backend.own_kv_layout else TorchAttentionBackend()


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_blocks: int, capture: bool = True,
                 max_context_tokens: int = MAX_CONTEXT_TOKENS):
        self.runner, self.capture = runner, capture
        self.backend = graph_backend(runner.backend)
        assert self.backend is not None, f"the {runner.backend.name} backend's blocks are its own: no decode graphs"
        self.batch_sizes = batch_sizes(max_batch)
        self.buckets = block_buckets(max_blocks)
        self.sizes = capture_sizes(max_batch, max_blocks, runner.block_size, max_context_tokens)
        dev, b, m = runner.device, self.batch_sizes[-1], self.buckets[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(b, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(b, m, dtype=torch.int32, device=dev)
        self.starts = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def size_for(self, inp) -> tuple[int, int] | None:
        """The (batch, blocks) graph for a pure decode step (one token per request, every one
        sampled), or None: it runs eagerly."""
        meta = inp.meta
        n = meta.num_seqs
        if not meta.num_decodes == n == inp.input_ids.numel() == len(inp.sample_req_ids):
            return None
        need = -(-max(meta.seq_lens_cpu) // meta.block_size)
        b = next((x for x in self.batch_sizes if x >= n), None)
        m = next((x for x in self.buckets if x >= need), None)
        return (b, m) if (b, m) in self.sizes else None

    def run(self, inp, size: tuple[int, int]) -> torch.Tensor:
        """Logits (n, vocab) of a step, in the graph `size_for` gave."""
        n, (b, m) = inp.meta.num_seqs, size
        self._load(inp, n, b, m)
        if self.capture:
            graph, logits = self.graphs[(b, m)]
            graph.replay()
        else:
            logits = self._step(b, m)
        return logits[:n]

    def _load(self, inp, n: int, b: int, m: int) -> None:
        meta = inp.meta
        width = min(meta.block_tables.shape[1], m)
        for dst, src, pad in ((self.input_ids, inp.input_ids, 0), (self.positions, inp.positions, 0),
                              (self.slots, meta.slot_mapping, 0), (self.seq_lens, meta.seq_lens, 1)):
            dst[:n].copy_(src, non_blocking=True)
            dst[n:b].fill_(pad)
        self.tables[:b, :m].zero_()
        self.tables[:n, :width].copy_(meta.block_tables[:, :width], non_blocking=True)

    def _step(self, b: int, m: int) -> torch.Tensor:
        """The decode step on the static buffers' first b rows and m blocks: tensor work only."""
        r = self.runner
        meta = AttentionMetadata(num_decodes=b, query_lens=[1] * b, seq_lens_cpu=[m * r.block_size] * b,
                                 query_start_loc=self.starts[:b + 1], seq_lens=self.seq_lens[:b],
                                 block_tables=self.tables[:b, :m], slot_mapping=self.slots[:b], block_size=r.block_size)
        self.backend.prepare_static_decode(meta, m)
        hidden = r.model(self.input_ids[:b], self.positions[:b], r.kv_cache, meta, self.backend)
        return r.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        start, pool = time.monotonic(), torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        for b, m in sorted(self.sizes, reverse=True):  # largest first: the smaller ones reuse its memory
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy init and autotuning stay out of the graph
                    self._step(b, m)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(b, m)
            self.graphs[(b, m)] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("CUDA graphs: %d decode graphs (batch %s x context blocks %s, at most %d context tokens "
                    "each, %s attention%s) captured in %.1f s", len(self.graphs), self.batch_sizes, self.buckets,
                    max(b * m for b, m in self.sizes) * self.runner.block_size, self.backend.name,
                    "" if self.backend is self.runner.backend else
                    f" over the {self.runner.backend.name} backend's blocks; its prefills and mixed steps stay its own",
                    time.monotonic() - start)
