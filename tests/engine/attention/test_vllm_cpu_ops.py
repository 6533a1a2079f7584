"""vLLM-CPU's fused RMSNorm and rotary (engine/attention/vllm_cpu_ops.py) against the torch ops of
engine/layers/common.py: fp32 within a few ulps, bf16 rotary within its rounding, on views into the qkv
rows as the model passes them; the bf16 norm's truncation, which keeps it out of bf16 models;
and a model built with the backend's fused ops gives the unfused model's logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import vllm_cpu_ops
from engine.attention import AttentionMetadata
from engine.attention.vllm_cpu_backend import VllmCpuAttentionBackend, vllm_cpu_unavailable
from engine.core.kv_cache import allocate_kv_cache
from engine.layers.common import RMSNorm, RotaryEmbedding
from engine.models.llama import LlamaForCausalLM
from tests.helpers import make_hf_tiny_llama, model_config_of

WHY = vllm_cpu_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"vllm_cpu: {WHY}")
# largest difference in units of the result's magnitude: fp32 sums in another order; bf16 rounds
# once where the torch ops round after each op (8 bits of mantissa: 2^-8 relative, a few of them)
TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -6}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got.float() - want.float()).abs().max().item() <= TOL[want.dtype] * want.float().abs().max().item()


def test_fp32_rms_norm_with_and_without_the_residual():
    torch.manual_seed(0)
    norm, fused = RMSNorm(576, 1e-5), RMSNorm(576, 1e-5, fused=True)
    norm.weight.data = torch.randn(576)
    fused.weight.data = norm.weight.data.clone()
    x, residual = torch.randn(7, 576), torch.randn(7, 576)
    assert _close(fused(x), norm(x))
    want_out, want_sum = norm(x, residual)
    x2, r2 = x.clone(), residual.clone()
    got_out, got_sum = fused(x2, r2)
    assert got_out is x2 and got_sum is r2  # written in place
    assert _close(got_out, want_out) and _close(got_sum, want_sum)


def test_bf16_rms_norm_is_fused_only_where_it_rounds_to_nearest():
    """Against the exact result of the same bf16 inputs, the torch ops' roundings split evenly
    toward and away from zero. The build's must too for bf16 models to fuse the norm (the
    AVX-512-alone build's lean toward zero: a bias the residual stream would accumulate)."""
    torch.manual_seed(5)
    weight = (torch.rand(576) + 0.5).to(torch.bfloat16)
    x, residual = (torch.randn(64, 576) * 10).to(torch.bfloat16), (torch.randn(64, 576) * 10).to(torch.bfloat16)
    exact = weight.float() * F.rms_norm(x.float() + residual.float(), (576,), eps=1e-5)
    fused, _ = vllm_cpu_ops.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = weight
    ours, _ = norm(x, residual)

    def toward_zero(got):
        error = (got.float() - exact) * exact.sign()
        return (error < 0).sum().item() / (error != 0).sum().item()
    assert 0.4 < toward_zero(ours) < 0.6
    nearest = vllm_cpu_ops.bf16_rounds_to_nearest()
    assert (0.4 < toward_zero(fused) < 0.6) if nearest else toward_zero(fused) > 0.9
    assert VllmCpuAttentionBackend().fused_ops(torch.bfloat16) == ({"rotary", "rms_norm"} if nearest else {"rotary"})
    assert VllmCpuAttentionBackend().fused_ops(torch.float32) == {"rotary", "rms_norm"}
    if nearest:
        assert _close(fused, ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_on_views_into_the_qkv_rows(dtype, head_dim):
    torch.manual_seed(1)
    n, heads, kv_heads = 5, 9, 3
    rope = RotaryEmbedding(head_dim, 4096, 100000.0)
    positions = torch.tensor([0, 1, 17, 1000, 4095])
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    want = RotaryEmbedding.apply(qkv[:, :(heads + kv_heads) * head_dim].view(n, -1, head_dim),
                                 *rope.cos_sin(positions, dtype))
    got = qkv.clone()
    q, k, v = got.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    vllm_cpu_ops.rotary_(positions, q, k, head_dim, rope.cos_sin_table(dtype))
    assert _close(got[:, :(heads + kv_heads) * head_dim].view(n, -1, head_dim), want)
    assert torch.equal(v, qkv[:, (heads + kv_heads) * head_dim:])  # values untouched


def test_a_fused_model_gives_the_unfused_logits():
    hf = make_hf_tiny_llama(seed=3, hidden_size=128)
    cfg = model_config_of(hf)
    models = []
    backend = VllmCpuAttentionBackend()
    for fused in (frozenset(), backend.fused_ops(torch.float32)):
        m = LlamaForCausalLM(cfg, fused=fused).eval()
        m.load_weights(hf.state_dict().items())
        models.append(m)
    assert all(layer.self_attn.fused_rotary and layer.input_layernorm.fused for layer in models[1].layers)
    n, bs = 40, 32
    meta = AttentionMetadata(num_decodes=0, query_lens=[n], seq_lens_cpu=[n],
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
                             slot_mapping=torch.arange(bs, bs + n), block_size=bs)
    ids, positions = torch.randint(0, cfg.vocab_size, (n,)), torch.arange(n)
    logits = []
    with torch.inference_mode():
        for m in models:
            kv = allocate_kv_cache(cfg, cfg.num_kv_heads, 3, bs, torch.float32, torch.device("cpu"))
            backend.prepare(meta)
            logits.append(m.compute_logits(m(ids, positions, kv, meta, backend)))
    assert (logits[1] - logits[0]).abs().max().item() < 1e-4
