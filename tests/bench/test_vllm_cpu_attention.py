"""bench/vllm_cpu_attention.py: the torch side attends what the harness wrote (vLLM's side needs
its wheel, which CI has not got), and a missing vLLM venv is one clear error."""
from __future__ import annotations

import pytest
import torch

from bench.vllm_cpu_attention import HEAD_DIM, HEADS, KV_HEADS, _exact, load_vllm_ops, torch_backend


@pytest.mark.parametrize("dtype,batch,ctx", [(torch.float32, 1, 40), (torch.float32, 3, 33), (torch.bfloat16, 8, 100)])
def test_torch_side_matches_exact_attention(dtype, batch, ctx):
    gen = torch.Generator().manual_seed(batch + ctx)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in
               ((batch, HEADS, HEAD_DIM), (batch, ctx, KV_HEADS, HEAD_DIM), (batch, ctx, KV_HEADS, HEAD_DIM)))
    out, us = torch_backend(q, k, v, HEAD_DIM ** -0.5, rounds=1)
    assert us > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), _exact(q, k, v, HEAD_DIM ** -0.5), atol=tol, rtol=tol)


def test_missing_vllm_venv_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no vllm package under"):
        load_vllm_ops(tmp_path)
