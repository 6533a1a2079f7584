"""A rank builds and runs its model on one thread of its own (cluster/ranks/rank.py)."""
from __future__ import annotations

import threading

import pytest

from cluster.ranks.rank import RankHost
import cluster.ranks.rank as rank_module
from cluster.spec import ClusterSpec
from engine.core.request import RequestMessage, SamplingParams
from engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(120)


class ThreadRecordingRunner(ModelRunner):
    """The real runner, noting which threads build it and run its steps."""

    threads: dict[str, set[int]] = {"built": set(), "ran": set()}

    def __init__(self, *args, **kwargs):
        self.threads["built"].add(threading.get_ident())
        super().__init__(*args, **kwargs)

    def execute_model(self, inp, after_layer=None):
        self.threads["ran"].add(threading.get_ident())
        return super().execute_model(inp, after_layer)


def _config(model: str):
    return ClusterSpec(model=model, dtype="float32", device="cpu", num_kv_blocks=32, block_size=8, max_num_seqs=4,
                       max_num_batched_tokens=64, num_threads=1, mode="colocated").engine_config("colocated")


def test_model_loads_and_runs_on_the_step_thread(tiny_path, monkeypatch):
    """The model's load and every step run on the rank's loop thread, never the caller's: an
    OpenMP team started on the caller's thread would outlive the load and slow every step."""
    monkeypatch.setattr(rank_module, "ModelRunner", ThreadRecordingRunner)
    ThreadRecordingRunner.threads = {"built": set(), "ran": set()}
    host = RankHost(_config(tiny_path), "colocated", "colocated-0")
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        host.worker.add_request(RequestMessage("r0", [1, 2, 3, 4, 5], params))
        outputs = []
        while not any(o.finished for o in outputs):
            outputs += host.worker.poll_outputs(timeout=10.0)
        assert sum(len(o.new_token_ids) for o in outputs) == 4
    finally:
        host.shutdown()
    assert ThreadRecordingRunner.threads == {"built": {host._thread.ident}, "ran": {host._thread.ident}}
    assert host._thread.ident != threading.get_ident()


def test_a_failed_build_raises_in_the_caller(tmp_path):
    """A model that cannot load fails the RankHost constructor itself (a Ray actor's setup call),
    with the loader's error, and leaves no loop behind."""
    before = threading.active_count()
    with pytest.raises((ValueError, FileNotFoundError)):
        RankHost(_config(str(tmp_path / "no-such-model")), "colocated", "colocated-0")
    assert threading.active_count() == before


def test_an_unknown_role_is_refused_before_any_load(tmp_path):
    """A role outside cluster/ranks/roles.py ROLES is refused with one line naming it and the roles,
    before a model (here none exists) is read; each role in ROLES builds its own KV end."""
    from cluster.ranks.roles import ROLES
    with pytest.raises(ValueError, match="unknown instance role 'router': one of prefill, decode, colocated"):
        RankHost(_config(str(tmp_path / "no-such-model")), "router", "router-0")
    assert {name: role.moves_kv for name, role in ROLES.items()} == {"prefill": True, "decode": True,
                                                                      "colocated": False}


def test_a_cuda_rank_joins_its_tp_group_on_an_indexed_device(monkeypatch):
    """On a GPU host `auto` names this process's current device with its index: torch's own
    set_device (its index check runs; only the driver call is faked) and init_process_group's
    `device_id` refuse a bare `cuda`. CPU runs take the gloo branch, so only fakes show it here."""
    import torch
    import torch.distributed as dist
    from engine.runner.model_runner import select_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    calls = {}
    monkeypatch.setattr(torch._C, "_cuda_setDevice", lambda index: calls.setdefault("set_device", index), raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.setdefault("init", (backend, kw)))
    monkeypatch.setattr(dist, "new_group", lambda **kw: "control")
    monkeypatch.setattr(rank_module, "tp_store", lambda *a, **kw: "store")

    tp = rank_module.join_tp_group(select_device("auto"), 0, 2, "127.0.0.1:1")

    backend, kw = calls["init"]
    assert (calls["set_device"], backend, kw["device_id"]) == (3, "nccl", torch.device("cuda", 3))
    assert tp.device == torch.device("cuda", 3)
    assert select_device("cuda:1") == torch.device("cuda", 1) and select_device("cpu") == torch.device("cpu")


def test_a_backend_with_its_own_kv_layout_says_why_the_same_device_path_is_off(tiny_path, monkeypatch, caplog):
    """A decode rank asked for the same-device transport whose attention backend lays out its own
    KV blocks (vllm_cpu's; faked here on the torch backend) does not take it, and says why: in its
    log, in `kv_same_device_off`, and to a sender on its device in the welcome."""
    import logging
    from engine.attention.torch_backend import TorchAttentionBackend
    monkeypatch.setattr(TorchAttentionBackend, "own_kv_layout", True)
    config = ClusterSpec(model=tiny_path, dtype="float32", device="cpu", num_kv_blocks=32, block_size=8,
                         max_num_seqs=4, max_num_batched_tokens=64, num_threads=1).engine_config("decode")
    with caplog.at_level(logging.WARNING, logger="cluster.ranks.rank"):
        host = RankHost(config, "decode", "decode-0", kv_same_device=True)
    try:
        assert "torch attention backend lays out its own KV blocks" in host.kv_same_device_off
        assert host.kv_same_device_off in caplog.text
        assert host.receiver.shared_cache is None and host.receiver.no_cache_reason
    finally:
        host.shutdown()
