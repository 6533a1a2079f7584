"""Executes one scheduled batch: builds the flat inputs, runs the model, samples.

    SchedulerOutput -> prepare_inputs() -> ModelInput -> forward -> logits -> Sampler -> RunnerOutput

`ModelInput` (engine/parallel/step.py) is plain tensors plus the attention metadata: all that the
other ranks of a tensor-parallel instance need to run the same step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata, create_attention_backend
from engine.core.request import NewRequestData, RunnerOutput, SamplingParams, SchedulerOutput, TokenHistory
from engine.core.config import EngineConfig, ModelConfig, cpu_has_native_bf16, resolve_dtype, resolve_kv_cache_dtype
from engine.core.kv_cache import allocate_kv_cache, kv_block_bytes, num_blocks_for
from engine.loading.loader import load_model_config, resolve_model_path
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes, graph_backend
from engine.runner.device_memory import DeviceMemory, MemorySnapshot, TorchDeviceMemory
from engine.runner.host_arena import HostArena
from engine.runner.kv_budget import MemoryBudget, blocks_from_device
from engine.runner.model_loading import load_model
from engine.layers.moe import expert_counts, expert_load_figures, reset_expert_counts
from engine.parallel.layers import TPGroup
from engine.parallel.step import ModelInput
from engine.core.threads import TeamSizer, use_intraop_threads
from engine.sample.sampling import Sampler, make_generator
from engine.speculative import load_proposer_model, measure_verify, split_rows, verify

if TYPE_CHECKING:  # llguidance is imported with the first structured request (not on every machine)
    import llguidance

    from engine.sample.structured_output import GrammarState

logger = logging.getLogger(__name__)


def select_device(name: str) -> torch.device:
    """`auto`: CUDA where a device is visible, else the CPU. A CUDA device always carries its index
    (`cuda` alone: this process's current device, the one Ray's CUDA_VISIBLE_DEVICES leaves it):
    torch.cuda.set_device and init_process_group(device_id=...) refuse a device without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class _RequestState:
    block_ids: list[list[int]]  # per KV group
    sampling_params: SamplingParams
    generator: torch.Generator | None
    history: TokenHistory | None = None  # grows by each token sampled here
    grammar: GrammarState | None = None  # structured output: advanced by each token sampled here


class RunnerGrammars:
    """The structured-output grammars the runner starts its requests with (engine/sample/structured_output.py
    runs them): llguidance's tokenizer for the model, built for the first structured request, and each
    new request's grammar state."""

    def __init__(self, model: str, model_config: ModelConfig, device: torch.device):
        self.model, self.model_config, self.device = model, model_config, device
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def grammar_for(self, r: NewRequestData, old: GrammarState | None) -> GrammarState | None:
        """A new request's grammar state, fed the tokens it has output so far (a remote prefill's first
        token, a retry's); a resumed one (preempted: `old`, its state before) keeps its own."""
        if r.sampling_params.structured_output is None:
            return None
        output = r.history.output if r.history is not None else []
        if old is not None and old.num_tokens == len(output):
            return old
        from engine.sample.structured_output import GrammarState
        kind, spec = r.sampling_params.structured_output
        return GrammarState(kind, spec, self.tokenizer(), output, r.request_id)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer for this model (`engine.sample.structured_output.ll_tokenizer`), from the
        model's own tokenizer, over the logits' width, with the model's EOS ids; built once."""
        if self._ll_tokenizer is None:
            from engine.sample.structured_output import ll_tokenizer
            from engine.text.tokenizer import Tokenizer
            mc = self.model_config
            logger.info("structured output: first request; grammar tokenizer from %s, masks unpacked on %s",
                        self.model, "the CPU with numpy" if self.device.type == "cpu" else self.device)
            self._ll_tokenizer = ll_tokenizer(Tokenizer.from_path(self.model), mc.vocab_size,
                                              tuple(sorted(mc.eos_token_ids)))
        return self._ll_tokenizer


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = TPGroup(), model_config: ModelConfig | None = None,
                 weights=None, device_memory: DeviceMemory | None = None):
        """Loads the model named by `config.model` (or the given config and float weights under HF
        names, for tests and benchmarks: int4 then quantizes them at load, as for any float checkpoint).
        `device_memory`: what the KV budget reads (engine/runner/kv_budget.py); torch.cuda's on a GPU, a
        stand-in given here sizes a CPU runner's pool the same way (tests, dry runs)."""
        self.config, self.tp = config, tp
        self.device = select_device(config.device)
        self.device_memory = device_memory = device_memory if device_memory is not None else (
            TorchDeviceMemory(self.device) if self.device.type == "cuda" else None)
        # before the weights: what the process adds outside torch from here on is its own
        self.memory_at_start = MemorySnapshot.of(device_memory) if device_memory is not None else None
        self.memory_budget: MemoryBudget | None = None  # set when the pool is sized from the device
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.dtype == "auto":
            logger.info("dtype auto -> %s on %s (native bf16 on this CPU: %s)", self.dtype, self.device.type,
                        cpu_has_native_bf16())
        # this thread's own team, whatever other threads set (engine/core/threads.py); on a GPU the CPU
        # ops are bookkeeping, and one thread per rank keeps the ranks of a host off each other's cores
        self.intraop_threads = use_intraop_threads(config.num_threads or (1 if self.device.type == "cuda" else None))
        self.team = TeamSizer(self.intraop_threads) if config.adapt_threads and self.device.type == "cpu" and \
            self.intraop_threads > 1 else None
        path = None
        if model_config is None:
            path = resolve_model_path(config.model)
            model_config = load_model_config(path)
        self.model_config = model_config
        self.model_path = path  # None: weights given in memory (the disk tier names its blocks by the files)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)  # the pool's element type
        # one per KV group: a backend keeps the step's plan (block tables) that its layers reuse
        self.backends = [create_attention_backend(config.attention_backend, self.device, self.dtype, self.kv_dtype,
                                                  model_config.head_dim, config.batch_invariant,
                                                  model_config.attention_sinks, model_config.mla is not None)
                         for _ in range(model_config.kv_layout.num_groups)]
        self.backend = self.backends[0]
        self.backend.check_head_dim(model_config.head_dim)
        self.model, self.linear_layers = load_model(config, model_config, self.tp, self.device, self.dtype,
                                                    self.backend.fused_ops(self.dtype), path, weights)
        self.block_size = self.backend.block_size_for(config.cache.block_size)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.sampler = Sampler()
        self.grammars = RunnerGrammars(config.model, model_config, self.device)  # structured output
        self.requests: dict[str, _RequestState] = {}
        self.graphs: DecodeGraphs | None = None  # set once the KV pool is there (graphs capture its address)
        self.draft = self._proposer_model()
        self.num_blocks = self._num_blocks()
        self.kv_cache = allocate_kv_cache(model_config, self.num_kv_heads, self.num_blocks, self.block_size,
                                          self.kv_dtype, self.device)
        if self.draft is not None:
            self.draft.give_pool(self.num_blocks)
        self.host_arena = HostArena.for_runner(self)
        self.graphs = self._decode_graphs()
        # where speculation pays: every rank profiles, in step (engine/speculative)
        spec = config.speculative
        self.spec_profile = measure_verify(self, spec.num_speculative_tokens) if spec and not spec.max_batch_size \
            else None
        reset_expert_counts(self.model)  # the profiling and capture steps routed nothing real
        logger.info("model runner: %s on %s, dtype %s, KV %s, attention %s, fused %s ops, %d KV blocks of %d "
                    "tokens", model_config.name, self.device, self.dtype, self.kv_dtype, self.backend.name,
                    " and ".join(sorted(self.model.fused)) or "no", self.num_blocks, self.block_size)

    def _proposer_model(self):
        """What speculative decoding runs beside the target on rank 0, loaded before the KV pool is
        sized so that the budget counts it: a decode instance's draft model or head, or a prefill
        instance's recorder of what it ships of each prompt (engine/speculative/rows.py); else None."""
        return load_proposer_model(self)

    def _num_blocks(self) -> int:
        """KV blocks of `self.block_size` tokens: fixed, from the device's memory after profiling
        (engine/runner/kv_budget.py; the least over the TP ranks), or from the CPU budget."""
        cache, mc = self.config.cache, self.model_config
        draft_bytes = self.draft.block_bytes() if self.draft is not None else 0  # the draft's pool: its share
        block_bytes = kv_block_bytes(mc, self.num_kv_heads, self.block_size, self.kv_dtype) + draft_bytes
        if self.device_memory is not None and cache.num_blocks is None:
            n, self.memory_budget = blocks_from_device(self, block_bytes)
        else:
            n = num_blocks_for(cache, mc, self.num_kv_heads, self.block_size, self.kv_dtype, draft_bytes)
        if self.block_size != cache.block_size:
            logger.info("KV blocks are %d tokens (block size %d rounded up by the %s backend)%s: %d blocks hold "
                        "%d tokens", self.block_size, cache.block_size, self.backend.name,
                        f"; num_kv_blocks {cache.num_blocks} of {cache.block_size} tokens" if cache.num_blocks else "",
                        n, (n - 1) * self.block_size)
        logger.info("KV cache: %d blocks x %d tokens = %.2f GiB", n, self.block_size, n * block_bytes / 2**30)
        return n

    def _graphs_off(self) -> str | None:
        """Why decode steps run without CUDA graphs (None: they run in them)."""
        head = getattr(self, "draft", None) is not None and self.draft.reads_target_hidden
        return ("--enforce-eager" if self.config.enforce_eager else
                "--batch-invariant (its attention is one call per sequence)" if self.config.batch_invariant else
                f"device {self.device.type}" if self.device.type != "cuda" else
                f"the {self.backend.name} attention backend lays out its own KV blocks"
                if graph_backend(self.backend) is None else
                "tensor-parallel ranks (a collective cannot be captured)" if self.tp is not None and self.tp.size > 1
                else "latent attention (engine/layers/mla.py reads the context lengths on the host)"
                if self.model_config.mla is not None
                else "mixture of experts (its grouped expert path reads the routing on the host)"
                if self.model_config.moe is not None
                else f"{len(self.backends)} KV groups" if len(self.backends) > 1
                else "a speculative head reads each step's hidden states" if head else None)

    def graph_sizes(self) -> set[tuple[int, int]]:
        """The (batch, context blocks) pairs `_decode_graphs` will capture; empty when it captures none."""
        if self._graphs_off() is not None:
            return set()
        return capture_sizes(self.config.scheduler.max_num_seqs, -(-self.configured_max_model_len // self.block_size),
                             self.block_size)

    def graph_gather_bytes(self, batch: int, blocks: int) -> int:
        """What a decode graph of `batch` x `blocks` holds beyond an eager step of the main backend
        (the KV budget profiles that): with the torch backend over another backend's blocks
        (cuda_graphs.graph_backend), one layer's keys and values of every row's context, gathered."""
        if graph_backend(self.backend) in (None, self.backend):
            return 0
        return 2 * batch * blocks * self.block_size * self.num_kv_heads * self.model_config.head_dim * self.dtype.itemsize

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps where they can run; says which path runs and why, and what
        they took against what the KV budget reserved for them."""
        if (why := self._graphs_off()) is not None:
            logger.info("CUDA graphs: off (%s); decode steps run eagerly", why)
            return None
        before = self.device_memory.reserved()
        graphs = DecodeGraphs(self, self.config.scheduler.max_num_seqs, -(-self.max_model_len // self.block_size))
        if self.memory_budget is not None:
            logger.info("CUDA graphs took %.2f GiB of device memory; the KV budget reserved %.2f GiB for them",
                        (self.device_memory.reserved() - before) / 2**30, self.memory_budget.graphs / 2**30)
        return graphs

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) this runner serves: the config's limit, the model's
        positions and what the KV pool holds (block 0 is the null block), whichever is least. The one
        definition: both schedulers, the workers' reports and the CUDA graphs read it."""
        return min(self.configured_max_model_len, (self.num_blocks - 1) * self.block_size)

    @property
    def configured_max_model_len(self) -> int:
        """The config's limit or the model's positions, whichever is less: what the KV budget
        profiles and must hold one request of (before the pool exists)."""
        mc = self.model_config
        return min(self.config.scheduler.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)

    def profile_step(self, num_seqs: int, num_tokens: int, context_len: int, num_draft_tokens: int = 0) -> None:
        """One step of `num_seqs` sequences, each computing the last `num_tokens` of `context_len`
        tokens (clamped to the model's positions; 1 token: a decode), sampled: the activations of a
        step of that shape (the KV budget's profile, engine/runner/kv_budget.py). Through a scratch pool of
        the null block and one block per KV group, which every table entry points at: attention
        reads and writes each row's whole context as a real step does, over a pool of a few blocks
        (what it reads there is garbage). The runner's own pool, if it has one, is put back.
        `num_draft_tokens`: the last of each sequence's tokens are drafts, verified (speculation's profile)."""
        context_len = min(context_len, self.model_config.max_position_embeddings)
        num_tokens = min(num_tokens, context_len)
        groups, n = len(self.backends), -(-context_len // self.block_size)
        pool = getattr(self, "kv_cache", None)
        self.kv_cache = allocate_kv_cache(self.model_config, self.num_kv_heads, 1 + groups, self.block_size,
                                          self.kv_dtype, self.device)
        reqs = [NewRequestData(f"profile-{i}", [1] * num_tokens, context_len - num_tokens,
                               tuple([1 + g] * n for g in range(groups)), SamplingParams(max_tokens=1, temperature=0.0),
                               True, num_draft_tokens=num_draft_tokens) for i in range(num_seqs)]
        try:
            self.execute(SchedulerOutput(new_requests=reqs))
        finally:
            self.update_states(SchedulerOutput(finished_req_ids=[r.request_id for r in reqs]))
            self.kv_cache = pool

    def scratch_tables(self, num_tokens: int) -> tuple[list[int], ...]:
        """Block tables for `num_tokens` tokens over blocks 1.. of the pool, a run of them per KV
        group: for a probe that writes the cache directly (the engine that owns it must be idle)."""
        n = -(-num_tokens // self.block_size)
        return tuple(list(range(1 + g * n, 1 + (g + 1) * n)) for g in range(len(self.backends)))

    def expert_counts(self) -> dict[int, list[int]]:
        """A mixture's tokens per expert per sparse layer since start ({}: a dense model)."""
        return expert_counts(self.model)

    def expert_load_figures(self) -> dict[str, float]:
        """The load report's expert figures (engine/layers/moe.py expert_load_figures; {}: a dense model,
        whose layers the 10 Hz load poll then does not walk)."""
        return {} if self.model_config.moe is None else expert_load_figures(self.model)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, after_layer=None) -> RunnerOutput:
        """One step on a single rank (tp=1, or rank 0 after broadcasting `prepare_inputs`)."""
        self.update_states(sched)
        if sched.is_empty:
            return RunnerOutput()
        inp = self.prepare_inputs(sched)
        logits = self.execute_model(inp, after_layer)
        return self.sample(inp, logits)

    def poll_tier(self, wait_s: float = 0.0) -> list[tuple[int, str]]:
        """This rank's disk tier reads that ended since the last poll (engine/runner/host_arena.py)."""
        return [] if self.host_arena is None else self.host_arena.poll_disk(wait_s)

    def update_states(self, sched: SchedulerOutput) -> None:
        """Applies a schedule's bookkeeping (finished, new, grown requests) to this rank's request
        table; `execute` does it itself, a worker that broadcasts inputs calls it on rank 0."""
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        for r in sched.new_requests:
            old = self.requests.get(r.request_id)  # resumed after preemption: keep its RNG stream
            gen = old.generator if old else make_generator(r.sampling_params.seed, self.device)
            # r.history is this NewRequestData's own (history_of builds it afresh): the runner grows it
            self.requests[r.request_id] = _RequestState([list(t) for t in r.block_ids], r.sampling_params, gen,
                                                        r.history,
                                                        self.grammars.grammar_for(r, old.grammar if old else None))
        for r in sched.cached_requests:
            tables = self.requests[r.request_id].block_ids
            for g, table in enumerate(tables):
                if r.num_null_blocks:
                    table[:r.num_null_blocks[g]] = [0] * r.num_null_blocks[g]
                if r.new_block_ids:
                    table.extend(r.new_block_ids[g])

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer for this model (RunnerGrammars)."""
        return self.grammars.tokenizer()

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput:
        """Packs the scheduled requests flat, decodes (one new token) first."""
        reqs = sorted(sched.new_requests + sched.cached_requests, key=lambda r: len(r.token_ids) != 1)
        input_ids, positions, query_lens, seq_lens = [], [], [], []
        groups = range(len(self.backends))
        slots, tables = [[] for _ in groups], [[] for _ in groups]  # per KV group
        sample_indices, sample_req_ids, drafts, spans = [], [], {}, []
        bs = self.block_size
        for r in reqs:
            start, n = r.num_computed_tokens, len(r.token_ids)
            input_ids += r.token_ids
            positions += range(start, start + n)
            for g, blocks in enumerate(self.requests[r.request_id].block_ids):
                slots[g] += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
                tables[g].append(blocks)
            query_lens.append(n)
            seq_lens.append(start + n)
            spans.append((r.request_id, start, n))
            if r.sample:
                num_drafts = r.num_draft_tokens
                sample_indices += range(len(input_ids) - 1 - num_drafts, len(input_ids))
                sample_req_ids.append(r.request_id)
                if num_drafts:
                    drafts[r.request_id] = (start, r.token_ids[n - num_drafts:])
        inp = self.model_input(input_ids, positions, slots, query_lens, seq_lens, tables,
                                   sample_indices, sample_req_ids)
        inp.block_copies, inp.drafts, inp.spans = list(sched.block_copies), drafts, spans
        inp.kv_tier = sched.kv_tier
        return inp

    def model_input(self, input_ids, positions, slots, query_lens, seq_lens, tables,
                    sample_indices, sample_req_ids) -> ModelInput:
        """A step's inputs on this runner's device (a speculative head builds its own steps with it);
        `slots` and `tables`: per KV group, decodes first."""
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        query_start_loc, seq_lens_t = self._upload(cu, torch.int32), self._upload(seq_lens, torch.int32)
        num_decodes = sum(1 for q in query_lens if q == 1)
        metas = []
        for group_slots, group_tables in zip(slots, tables):
            width = max(len(t) for t in group_tables)
            metas.append(AttentionMetadata(
                num_decodes=num_decodes, query_lens=query_lens, seq_lens_cpu=seq_lens,
                query_start_loc=query_start_loc, seq_lens=seq_lens_t,
                block_tables=self._upload([t + [0] * (width - len(t)) for t in group_tables], torch.int32),
                slot_mapping=self._upload(group_slots, torch.int64),
                block_size=self.block_size))
        return ModelInput(self._upload(input_ids, torch.int64), self._upload(positions, torch.int64), tuple(metas),
                          self._upload(sample_indices, torch.int64), sample_req_ids)

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A step input on the device. On CUDA through pinned host memory, copied without making
        the host wait (the host allocator keeps the pinned buffer until the copy has run)."""
        t = torch.tensor(values, dtype=dtype)
        return t if self.device.type != "cuda" else t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput, after_layer=None) -> torch.Tensor | None:
        """Runs the forward on this rank; returns logits (num_sampled, vocab) on rank 0, else None."""
        if self.team is not None:
            self.intraop_threads = self.team.maybe_resize()
        if inp.kv_tier is not None:  # the tiers' copies (engine/core/tier_copies.py), first
            self.host_arena.apply(inp.kv_tier)
        if inp.block_copies:
            self._copy_blocks(inp.block_copies)
        if self.graphs is not None and after_layer is None and (size := self.graphs.size_for(inp)) is not None:
            return self.graphs.run(inp, size)
        hidden = self.hidden_states(inp, after_layer)
        if self.draft is not None:
            self.draft.observe(inp, hidden)
        if not inp.sample_req_ids:
            return None
        return self.model.compute_logits(hidden[inp.sample_indices])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Forked choices' partial prompt blocks (copy on write), in every slab, through the backend's
        `kv_views` (a backend may lay a block's bytes out its own way)."""
        src, dst = (torch.tensor(ids, device=self.kv_cache.device) for ids in zip(*copies))
        for slab in self.kv_cache:
            for view in self.backend.kv_views(slab):
                view = view.view(torch.uint8) if view.dtype == torch.float8_e4m3fn else view  # no fp8 index_put
                view[dst] = view[src]

    @torch.inference_mode()
    def hidden_states(self, inp: ModelInput, after_layer=None) -> torch.Tensor:
        """The model's final hidden states of every token of a step (eagerly), (num_tokens, hidden)."""
        for backend, meta in zip(self.backends, inp.metas):
            backend.prepare(meta)
        return self.model(inp.input_ids, inp.positions, self.kv_cache, inp.metas, self.backends, after_layer)

    def sample(self, inp: ModelInput, logits: torch.Tensor | None) -> RunnerOutput:
        """One token per sampled row; a request with n > 1 (its prompt's last step) gets one per choice
        from the same logits, choice i seeded `seed + i` (RunnerOutput.choices)."""
        out = RunnerOutput()
        if logits is None:
            return out
        req_ids = inp.sample_req_ids
        if inp.drafts:  # speculative decoding: verifying requests have a row per position
            rows, req_ids, verifying = split_rows(inp)
            verify(self, logits, verifying, out)
            if not req_ids:
                return out
            logits = logits[torch.tensor(rows, device=logits.device)]
        states = [self.requests[rid] for rid in req_ids]
        rows = [i for i, s in enumerate(states) for _ in range(s.sampling_params.n)]
        params, generators = [], []
        for i, s in enumerate(states):
            params.append(s.sampling_params)
            generators.append(s.generator)
            for c in range(1, s.sampling_params.n):
                params.append(s.sampling_params.choice(c))
                generators.append(make_generator(params[-1].seed, self.device))
        if len(rows) > len(states):
            logits = logits[torch.tensor(rows, device=logits.device)]
        grammars = [states[i].grammar for i in rows]
        sampled = self.sampler(logits, params, generators, [states[i].history for i in rows],
                               grammars if any(g is not None for g in grammars) else None)
        first = 0
        for i, rid in enumerate(req_ids):
            token, state = sampled.token_ids[first], states[i]
            out.sampled_token_ids[rid] = token
            if state.history is not None:
                state.history.output.append(token)
            if state.grammar is not None:
                state.grammar.accept(token)
            if sampled.extras[first] is not None:
                out.extras[rid] = sampled.extras[first]
            n = state.sampling_params.n
            if n > 1:
                out.choices[rid] = list(zip(sampled.token_ids[first:first + n], sampled.extras[first:first + n]))
            first += n
        return out
