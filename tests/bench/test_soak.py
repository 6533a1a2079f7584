"""The soak, sized for CI: 300 requests (tiny model, 1P1D in this process) with 30% aborted at a
random moment; nothing errors, every allocator ends full, RSS does not grow. In fp32 and bf16:
each dtype's CPU kernels (oneDNN's among them, which keep a JIT-built kernel per input shape)
must keep memory bounded under the engine's ever-changing batch shapes."""
from __future__ import annotations

import pytest

from bench.soak import soak
from cluster.spec import ClusterSpec
from tests.helpers import save_tiny_llama

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_soak_with_random_aborts_leaks_nothing(tmp_path, dtype):
    model = str(save_tiny_llama(tmp_path / "llama"))
    spec = ClusterSpec(model=model, dtype=dtype, device="cpu", num_kv_blocks=256, block_size=8,
                       max_num_seqs=64, max_num_batched_tokens=512, num_threads=1)
    r = soak(spec, num_requests=300, concurrency=50, abort_fraction=0.3)  # raises if a block leaked
    assert r["error"] == 0 and r["finished"] + r["aborted"] == 300
    assert r["aborted"] >= 30 and r["finished"] >= 150
    assert r["rss_after_mib"] - r["rss_before_mib"] < 64, r
