"""A role flip in one process (cluster/control/flip.py): a prefill instance becomes a decode instance
while requests stream, keeping its model; no request is lost, each equals its greedy tokens from
before the flip, the flipped instance then decodes, and every block ends free."""
from __future__ import annotations

import threading
import time

import pytest

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_a_prefill_instance_flips_to_decode_under_load_and_loses_nothing(tiny_path):
    spec = ClusterSpec(model=tiny_path, dtype="float32", device="cpu", num_prefill=2, num_decode=1, num_kv_blocks=128,
                       block_size=8, max_num_seqs=16, max_num_batched_tokens=32, kv_transfer_timeout_s=10.0,
                       num_threads=1)
    prompts = random_prompts(24, [60, 90, 120], seed=5)  # chunked (32 a step): prefills take steps
    with Cluster(spec, use_ray=False) as cluster:
        want = [s.token_ids for s in cluster.generate(prompts, PARAMS, timeout_s=120)]
        runner = cluster.instances["prefill-1"].ranks[0].runner
        streams, flipped = [], {}

        def flip():
            deadline = time.monotonic() + 30
            while cluster.router.is_drained("prefill-1"):  # until a prompt is on it: the flip drains it
                assert time.monotonic() < deadline
                time.sleep(0.001)
            flipped.update(cluster.flip_instance("prefill-1", "decode", timeout_s=60))
        thread = threading.Thread(target=flip)
        thread.start()
        for i, p in enumerate(prompts):
            streams.append(cluster.submit(f"r{i}", p, PARAMS))
            time.sleep(0.02)
        thread.join(120)
        got = [s.result(120) for s in streams]
        assert [s.error for s in got] == [None] * len(prompts)
        assert [s.token_ids for s in got] == want
        inst = cluster.instances["prefill-1"]
        assert inst.role == "decode" and inst.ranks[0].runner is runner  # the same model, rebuilt around
        assert set(cluster.router.decode) == {"decode-0", "prefill-1"} and set(cluster.router.prefill) == {"prefill-0"}
        assert 0 < flipped["drain_s"] and flipped["total_s"] < 60
        assert cluster.router.snapshot()["retries"] == 0  # drained: nothing was cut and placed again
        again = cluster.generate(prompts[:16], PARAMS, timeout_s=120)  # now it decodes: both decode pools take some
        assert [s.token_ids for s in again] == want[:16]
        assert inst.client.load()["running"] == 0 and inst.ranks[0].worker.num_steps > 0
        cluster.assert_no_leaks()
        with pytest.raises(ValueError, match="is a decode instance already"):
            cluster.flip_instance("prefill-1", "decode")
        with pytest.raises(ValueError, match="no instance 'decode-9'"):
            cluster.flip_instance("decode-9", "prefill")


def test_an_instance_on_a_per_role_worker_pod_does_not_flip():
    """With ray_resources and per-role worker pods, an instance holds its pod's role resource: a flip
    is refused in one line before anything drains (worker_pods shared lets it flip)."""
    from types import SimpleNamespace

    from cluster.control.flip import flip_instance
    inst = SimpleNamespace(role="prefill", tp_size=1)
    ctl = SimpleNamespace(instances={"prefill-0": inst}, spec=ClusterSpec(ray_resources=True))
    with pytest.raises(ValueError, match="holds its worker pod's prefill Ray resource .* worker_pods shared"):
        flip_instance(ctl, "prefill-0", "decode")
