"""The sections of `bench/gpu_check.py`. Each runs in a process of its own (spawned) and returns a
JSON-able dict; it needs only what the GPU machine has (torch, transformers, numpy, msgpack): no
Ray, fastapi, pydantic, gguf or flash-attn.

    probe     CUDA, bf16, the device count, a CUDA tensor shared with a second process (each
              sub-check on its own: a failed one is recorded as `<name>_error` and the probe returns)
    engine    the engine in bf16 against transformers in bf16 on a tiny random Llama: greedy tokens
              equal up to the first near-tie (transformers' top-2 logit gap under 1e-2, or under
              two bf16 steps at that logit's size, which is all a bf16 logit resolves); and a tiny
              DeepSeek-V3 the same way in float32 (its latent attention's torch path; skipped, and
              said so, where the device's transformers has no DeepSeek-V3)
    decode    decode ms/step, CUDA graphs and eager, at several batch sizes on a random-weight ~8B-shaped Llama built
              on the device, against the step time its bytes take at the measured copy bandwidth;
              its KV pool sized from the device (gpu_memory_utilization 0.4), and what that took
    ipc_copy  copying scattered KV blocks out of another process's device tensor (CUDA IPC) against
              the same copy inside one process
    pd_one_gpu  (bench/gpu_pd.py) one prefill rank and one decode rank in processes of their own on
              the one device, the KV written straight into the decode's cache over CUDA IPC: greedy
              tokens equal to the colocated engine's, and the transfer's counters and times

A `Plan` says where and how big; `Plan.dry_run()` is the CPU stand-in CI runs.
"""
from __future__ import annotations

import queue as queue_module
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)
NEAR_TIE = 1e-2  # top-2 logit gap under which rounding may pick either token (and two bf16 steps)


@dataclass
class Plan:
    device: str = "cuda"
    big: dict = field(default_factory=lambda: dict(LLAMA_8B))
    batch_sizes: tuple[int, ...] = (1, 32, 128)
    prompt_len: int = 128
    output_len: int = 64
    gpu_memory_utilization: float = 0.4  # of 139 GiB: ~15 GiB of weights, the rest KV and activations
    kv_gib: float = 0.02  # the CPU stand-in's KV
    ipc_mib: int = 1024
    stand_ins: tuple[str, ...] = ()

    @classmethod
    def dry_run(cls) -> Plan:
        return cls(device="cpu", big=dict(TINY, num_hidden_layers=2), batch_sizes=(1, 4), prompt_len=16,
                   output_len=8, ipc_mib=8,
                   stand_ins=("cpu for cuda", "a 2-layer tiny Llama for the ~8B shape",
                              "shared memory for CUDA IPC", "batches 1 and 4, 8 tokens each"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- probe -------------------------------------------------------------------------------------
IPC_WAIT_S = 15.0  # the probe's CUDA IPC sub-check waits this long for the other process's tensor


def _share(queue, done, device: str) -> None:
    """Child: a device tensor to the parent (CUDA IPC on a GPU), kept alive until it has read it."""
    x = torch.arange(1 << 20, dtype=torch.float32, device=device) * 2
    queue.put(x)
    done.wait(IPC_WAIT_S)


def shared_sum(device: str, wait_s: float = IPC_WAIT_S, share=_share) -> float:
    """The sum of a tensor another process made on `device` and shared (`share` runs there);
    TimeoutError when none came within `wait_s`. The child is ended either way."""
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=share, args=(queue, done, device), daemon=True)
    child.start()
    try:
        try:
            x = queue.get(timeout=wait_s)
        except queue_module.Empty:
            raise TimeoutError(f"no tensor from the other process within {wait_s:.0f} s "
                               f"(its exit code: {child.exitcode})") from None
        return float(x.double().sum())
    finally:
        done.set()
        child.join(5)
        if child.is_alive():
            child.kill()


def _sub_check(info: dict, name: str, check) -> None:
    """Runs one of the probe's sub-checks: its keys into `info`, or `{name}_error` if it raised,
    so one failing sub-check (say CUDA IPC) leaves the probe's other findings standing."""
    try:
        info.update(check())
    except Exception as exc:  # noqa: BLE001 -- recorded; the sections that need it are skipped
        info[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        info.setdefault(f"{name}_ok", False)


def probe(plan: Plan) -> dict:
    import torch.distributed as dist

    from engine.attention import flash_attn_available
    cuda = plan.device.startswith("cuda")
    devices = torch.cuda.device_count() if cuda else 0
    info = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "nccl": bool(dist.is_available() and dist.is_nccl_available()),
            "flash_attn_importable": flash_attn_available(),
            "triton": _version("triton"), "transformers": _version("transformers"),
            "device_count": devices, "two_devices": devices >= 2 or not cuda}  # the dry run: two CPU processes
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, capability=list(torch.cuda.get_device_capability()),
                    total_memory_gib=props.total_memory / 2**30)
    _sub_check(info, "bf16", lambda: _bf16_matmul(plan.device))
    want = float(torch.arange(1 << 20, dtype=torch.float64).sum() * 2)
    info["ipc"] = "cuda_ipc" if cuda else "shared_memory"
    _sub_check(info, "ipc", lambda: {"ipc_ok": shared_sum(plan.device) == want})
    return info


def _bf16_matmul(device: str) -> dict:
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    err = ((a.bfloat16() @ b.bfloat16()).float() - a @ b).abs().max().item()
    return {"bf16_matmul_max_abs_err": err, "bf16_ok": err < 1.0}  # 256-term dot products of unit normals


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


# -- engine against transformers ---------------------------------------------------------------
def _hf_llama(shape: dict, seed: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return sharpened(LlamaForCausalLM(cfg).eval()).to(device, torch.bfloat16)


def sharpened(model):
    """`model` with its norms off 1 and sharper distributions than the default init: greedy
    choices far from ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if "norm" in name else p.mul_(2.5)
    return model


def model_config_of(cfg, name: str):
    from engine.core.config import ModelConfig
    return ModelConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                       num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                       rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                       tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=1, eos_token_id=2, name=name)


def engine_config(device: str, kv: dict, backend: str = "auto", max_num_seqs: int = 128,
                  max_num_batched_tokens: int = 4096):
    """The bf16 EngineConfig every section's engine runs with (bench/gpu_pd.py's ranks too)."""
    from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
    return EngineConfig(device=device, dtype="bfloat16", attention_backend=backend, cache=CacheConfig(**kv),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens))


def _llm(plan: Plan, model_config, weights, kv: dict, backend: str = "auto", max_num_seqs: int = 128,
         max_num_batched_tokens: int = 4096):
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.runner.model_runner import ModelRunner
    cfg = engine_config(plan.device, kv, backend, max_num_seqs, max_num_batched_tokens)
    runner = ModelRunner(cfg, model_config=model_config, weights=weights)
    return LLM(engine=ColocatedEngine(cfg, runner=runner)), runner


def _greedy(max_tokens: int):
    from engine.core.request import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _agreement(hf, prompt: list[int], tokens: list[int], device: str) -> dict:
    """Where transformers' greedy choice along the engine's tokens first differs, and whether
    that position is a near-tie."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1:-1].float()
    top2 = logits.topk(2, dim=-1)
    differ = (top2.indices[:, 0] != torch.tensor(tokens, device=device)).nonzero().flatten().tolist()
    first = differ[0] if differ else len(tokens)
    if not differ:
        return {"equal_prefix": first, "gap_at_first_difference": None, "near_tie_below": None, "ok": True}
    top = top2.values[first, 0].item()
    gap, tie = top - top2.values[first, 1].item(), max(NEAR_TIE, 2 * _bf16_step(top))
    return {"equal_prefix": first, "gap_at_first_difference": gap, "near_tie_below": tie, "ok": gap <= tie}


def _bf16_step(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    x = torch.tensor(abs(x), dtype=torch.bfloat16)
    return (torch.nextafter(x, torch.tensor(float("inf"), dtype=torch.bfloat16)) - x).item()


def engine_vs_transformers(plan: Plan, num_tokens: int = 32) -> dict:
    hf = _hf_llama(TINY, seed=0, device=plan.device)
    prompts = [p for n in (7, 16, 100, 300) for p in _prompts(1, n, TINY["vocab_size"], seed=n)]
    out = {}
    for backend in ("auto", "torch"):
        llm, runner = _llm(plan, model_config_of(hf.config, "tiny"), hf.state_dict().items(),
                           dict(num_blocks=256, block_size=16), backend)
        outs = llm.generate(prompts, _greedy(num_tokens))
        rows = [_agreement(hf, p, o.token_ids, plan.device) for p, o in zip(prompts, outs)]
        out[backend] = {"backend": runner.backend.name, "block_size": runner.block_size, "prompts": rows,
                        "ok": all(r["ok"] for r in rows)}
        del llm, runner
    out["mla"] = mla_vs_transformers(plan, num_tokens)
    out["ok"] = out["auto"]["ok"] and out["torch"]["ok"] and out["mla"]["ok"]
    return out


# a tiny DeepSeek-V3: latent attention (engine/layers/mla.py), grouped sigmoid routing, a shared expert
MLA_TINY = dict(TINY, num_key_value_heads=TINY["num_attention_heads"], kv_lora_rank=64, q_lora_rank=96,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, n_group=4, topk_group=2, first_k_dense_replace=1,
                max_position_embeddings=1024)


def mla_vs_transformers(plan: Plan, num_tokens: int = 32) -> dict:
    """The engine's greedy tokens of a tiny DeepSeek-V3 in float32 against transformers' on the same
    device (the latent attention's torch path: SDPA for expanded prefills, einsums for absorbed
    decodes), loaded from the folder transformers saves. float32, not bf16: the absorbed form
    rounds other products than transformers' expanded one, and in bf16 that moves logits by more
    than the near-tie rule allows (seen on the CPU stand-in) and can flip a routing choice."""
    import tempfile
    from dataclasses import replace

    import transformers
    if not hasattr(transformers, "DeepseekV3Config"):
        return {"skipped": f"transformers {transformers.__version__} has no DeepseekV3Config", "ok": True}
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    from engine.runner.model_runner import ModelRunner
    torch.manual_seed(1)
    hf = sharpened(DeepseekV3ForCausalLM(DeepseekV3Config(**MLA_TINY)).eval()).to(plan.device)
    prompts = [p for n in (7, 100, 300) for p in _prompts(1, n, TINY["vocab_size"], seed=n)]
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, safe_serialization=True)
        cfg = replace(engine_config(plan.device, dict(num_blocks=256, block_size=16)), model=folder, dtype="float32")
        runner = ModelRunner(cfg)
        outs = LLM(engine=ColocatedEngine(cfg, runner=runner)).generate(prompts, _greedy(num_tokens))
    rows = [_agreement(hf, p, o.token_ids, plan.device) for p, o in zip(prompts, outs)]
    return {"backend": runner.backend.name, "prompts": rows, "ok": all(r["ok"] for r in rows)}


# -- decode against the bytes it moves ---------------------------------------------------------
def _random_weights(cfg, device: str):
    """(name, tensor) of a Llama of `cfg`'s shape, random, made on the device one at a time."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(cfg).state_dict().items()}
    for name, shape in shapes.items():
        if "norm" in name:
            yield name, torch.ones(shape, device=device, dtype=torch.bfloat16)
        else:
            yield name, torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02


def copy_gbps(device: str, num_bytes: int) -> float:
    """Device memory bandwidth: bytes read plus written per second by a plain copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _sync(device)
    return 2 * 5 * num_bytes / (time.perf_counter() - start) / 1e9


def decode_ms(llm, batch: int, plan: Plan, vocab: int) -> tuple[float, list[list[int]], float]:
    """Median ms per decode step of `batch` requests, their tokens, and the seconds the warm-up
    run before them took (what compiles or captures on first use)."""
    start = time.monotonic()
    llm.generate(_prompts(batch, plan.prompt_len, vocab, 1000 + batch), _greedy(4))
    warm_s = time.monotonic() - start
    outs = llm.generate(_prompts(batch, plan.prompt_len, vocab, 2000 + batch), _greedy(plan.output_len))
    ms = statistics.median((o.finished_s - o.first_token_s) / (len(o.token_ids) - 1) * 1e3 for o in outs)
    return ms, [o.token_ids for o in outs], warm_s


def bytes_bound_ms(weight_bytes: int, batch: int, context: float, kv_per_token: int, gbps: float) -> float:
    """The step time its bytes take at `gbps`: every weight, and each row's KV, read once."""
    return (weight_bytes + batch * context * kv_per_token) / (gbps * 1e9) * 1e3


def decode(plan: Plan) -> dict:
    from transformers import LlamaConfig
    cfg = LlamaConfig(**plan.big, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    mc = model_config_of(cfg, "random-8b-shape")
    kv = dict(memory_gib=plan.kv_gib, gpu_memory_utilization=plan.gpu_memory_utilization, block_size=16)
    llm, runner = _llm(plan, mc, _random_weights(cfg, plan.device), kv,
                       max_num_seqs=max(plan.batch_sizes),
                       max_num_batched_tokens=max(4096, max(plan.batch_sizes) * plan.prompt_len))
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    bw = copy_gbps(plan.device, min(2 << 30, weight_bytes))
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    graphs = runner.graphs
    out = {"shape": plan.big, "weight_gib": weight_bytes / 2**30, "copy_GBps": bw, "backend": runner.backend.name,
           "cuda_graphs": graphs is not None, "kv_blocks": runner.num_blocks, "kv_block_size": runner.block_size,
           "kv_gib": runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30, "batches": {}}
    if plan.device.startswith("cuda"):  # KV sized from the device: this process must stay within its fraction
        out.update(gpu_memory_utilization=plan.gpu_memory_utilization,
                   reserved_gib=torch.cuda.memory_reserved() / 2**30,
                   total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    for batch in plan.batch_sizes:
        runner.graphs = graphs
        ms, tokens, _ = decode_ms(llm, batch, plan, mc.vocab_size)
        runner.graphs = None
        eager_ms, eager_tokens, _ = decode_ms(llm, batch, plan, mc.vocab_size)
        ideal_ms = bytes_bound_ms(weight_bytes, batch, plan.prompt_len + plan.output_len / 2, kv_per_token, bw)
        out["batches"][str(batch)] = {"ms_per_step": ms, "eager_ms_per_step": eager_ms, "bytes_bound_ms": ideal_ms,
                                      "of_bound": ideal_ms / ms, "tok_s": batch / ms * 1e3,
                                      # graphs off: two eager runs, a repeat's tokens
                                      "tokens_equal_eager" if graphs is not None else "tokens_equal_repeat":
                                          tokens == eager_tokens}
    runner.graphs = graphs
    from bench.gpu_spec import verify_profile
    out["speculative_profile"] = verify_profile(runner)  # where speculation pays at this shape
    return out


# -- copying KV blocks out of another process --------------------------------------------------
def _serve_cache(queue, done, device: str, num_blocks: int, block_bytes: int) -> None:
    cache = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    queue.put(cache)
    done.wait(60)  # the parent sets it as soon as it is done (or ends this process)


def _gather_gbps(src: torch.Tensor, ids: torch.Tensor, device: str) -> float:
    dst = torch.empty((ids.numel(), src.shape[1]), dtype=src.dtype, device=device)
    torch.index_select(src, 0, ids, out=dst)
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        torch.index_select(src, 0, ids, out=dst)
    _sync(device)
    return 5 * dst.numel() / (time.perf_counter() - start) / 1e9


def ipc_copy(plan: Plan, block_bytes: int = 256 << 10) -> dict:
    num_blocks = plan.ipc_mib * (1 << 20) // block_bytes
    ids = torch.randperm(num_blocks)[:num_blocks // 2].to(plan.device)
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve_cache, args=(queue, done, plan.device, num_blocks, block_bytes), daemon=True)
    child.start()
    try:
        remote = queue.get(timeout=IPC_WAIT_S)
        local = torch.randint(0, 255, remote.shape, dtype=torch.uint8, device=plan.device)
        out = {"ipc": "cuda_ipc" if plan.device.startswith("cuda") else "shared_memory",
               "block_kib": block_bytes >> 10, "blocks_copied": ids.numel(),
               "from_other_process_GBps": _gather_gbps(remote, ids, plan.device),
               "within_process_GBps": _gather_gbps(local, ids, plan.device)}
        out["ratio"] = out["from_other_process_GBps"] / out["within_process_GBps"]
        del remote
        return out
    finally:
        done.set()
        child.join(5)
        if child.is_alive():
            child.kill()
