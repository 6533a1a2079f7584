"""The controller and stateless gateways as separate objects over one Ray and one Redis: the
instances are detached, named actors that a restarted controller adopts instead of starting new
ones; gateways (`Frontend`) find them in the cluster state, keep serving while no controller
runs, and follow replacements and drains. The autoscaler sums every gateway's counters."""
from __future__ import annotations

import secrets
import time
from dataclasses import replace

import pytest

from cluster.autoscale.actuators import PoolSizes
from cluster.autoscale.autoscale_loop import LoadWindow
from cluster.control.controller import Controller
from cluster.control.frontend import Frontend
from cluster.redis_state import RedisState
from cluster.spec import ClusterSpec
from cluster.state import MemoryState
from tests.cluster.control.test_ray_cluster import GREEDY, checked, colocated_tokens, spec_for
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)


def generate(gateway: Frontend, prompts) -> list:
    streams = [gateway.submit(f"g-{time.monotonic_ns()}-{i}", p, GREEDY) for i, p in enumerate(prompts)]
    return [s.result(timeout=120) for s in streams]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def pids(controller: Controller) -> dict[str, list[int]]:
    return {iid: [p.pid for p in inst.placements] for iid, inst in controller.instances.items()}


def check_endpoints(controller: Controller) -> None:
    """The controller's HTTP endpoints: not ready until started, then its instances, adopted, each
    with the engine its ranks chose at load (read back from the adopted ranks)."""
    from fastapi.testclient import TestClient

    from cluster.cli.controller_app import create_controller_app
    app, started = create_controller_app(controller)
    http = TestClient(app)
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 503
    started.set()
    assert http.get("/ready").json() == {"status": "ready", "instances": 2}
    assert {i["instance_id"]: i["adopted"] for i in http.get("/status").json()["instances"]} == \
        {"prefill-0": True, "decode-0": True}
    engines = [i["engine"] for i in http.get("/status").json()["instances"]]
    assert all(e["linear_layers"] and e["dtype"] in ("float32", "bfloat16") and e["attention"]
               for e in engines), engines
    text = http.get("/metrics").text
    assert 'pdserve_controller_instances{health="healthy",role="decode"} 1.0' in text, text


def check_readmitted(gateway: Frontend, iid: str, prompts, want) -> None:
    """The gateway alone finds `iid` dead (a partition between the two): it attaches it again
    once the controller has heartbeated it for a TTL since, and serves through it."""
    gateway.router.mark_dead(iid, RuntimeError("a call timed out"))
    assert not gateway.instances[iid].client.info.healthy
    # meanwhile the gateway may drop it from its table before it attaches it again
    wait_for(lambda: (inst := gateway.instances.get(iid)) is not None and inst.client.info.healthy, 20,
             f"the gateway attaches {iid} again")
    assert checked(generate(gateway, prompts)) == want


def test_restarted_controller_adopts_and_gateways_follow(ray_session, tiny_path, redis_url):
    """1P1D under a controller, two gateways: both serve the colocated tokens; with the controller
    gone they still do; a new controller adopts both instances (same processes, nothing started);
    an instance killed is replaced under a new id and the gateways move to it; a drained one
    leaves both gateways; every allocator ends empty; the cluster state emptied (Redis restarted)
    is filled again by the controller while the gateways keep their instances; an instance one
    gateway alone found dead is attached again there."""
    spec = spec_for(tiny_path, ray_address="auto", redis_url=redis_url, heartbeat_ttl_s=1.0,
                    cluster_name=f"test-{secrets.token_hex(3)}")
    prompts = random_prompts(6, [7, 30], seed=31)
    want = colocated_tokens(tiny_path, prompts)
    controller = Controller(spec).start()
    gateways: list[Frontend] = []
    try:
        gateways = [Frontend(spec).start() for _ in range(2)]
        assert all(g.wait_ready(30) for g in gateways)
        assert [checked(generate(g, prompts)) for g in gateways] == [want, want]
        before = pids(controller)
        assert sorted(before) == ["decode-0", "prefill-0"]

        controller.shutdown(stop_instances=False)
        assert checked(generate(gateways[0], prompts)) == want  # no controller: serving goes on
        controller = Controller(spec).start()
        assert sorted(controller.adopted) == sorted(before) and pids(controller) == before
        check_endpoints(controller)

        controller.kill_instance("decode-0")
        for g in gateways:
            wait_for(lambda g=g: sorted(g.instances) == ["decode-1", "prefill-0"] and g.ready(), 60,
                     "the gateway moves from the dead decode-0 to its replacement")
        assert [checked(generate(g, prompts)) for g in gateways] == [want, want]

        assert controller.add_instance("prefill") == "prefill-1"
        for g in gateways:
            wait_for(lambda g=g: "prefill-1" in g.instances, 10, "the gateway sees the added prefill-1")
        assert controller.drain_instance("prefill-0", timeout_s=30)
        for g in gateways:
            wait_for(lambda g=g: "prefill-0" not in g.instances, 10, "the gateway drops the drained prefill-0")
        assert [checked(generate(g, prompts)) for g in gateways] == [want, want]
        controller.assert_no_leaks()

        state = RedisState(redis_url, namespace=spec.cluster_name)
        for record in state.list_instances():  # a Redis restarted empty
            state.remove(record.instance_id)
        assert checked(generate(gateways[0], prompts)) == want
        wait_for(lambda: sorted(r.instance_id for r in state.list_instances(healthy_only=True))
                 == sorted(controller.instances), 10, "the controller registers its instances again")
        assert all(sorted(g.instances) == sorted(controller.instances) for g in gateways)
        state.close()
        check_readmitted(gateways[0], "prefill-1", prompts, want)
    finally:
        for g in gateways:
            g.shutdown()
        controller.shutdown(stop_instances=True)


def test_incomplete_instance_is_not_adopted(ray_session, tiny_path, redis_url):
    """A rank actor left by a controller that died before the instance was complete is killed,
    and a new instance started in its place (with an id after it)."""
    import ray

    from cluster.ranks.actor import RankActor
    spec = spec_for(tiny_path, ray_address="auto", redis_url=redis_url, mode="colocated",
                    cluster_name=f"test-{secrets.token_hex(3)}")
    stray = RankActor.options(name="colocated-4.rank0", namespace=spec.cluster_name, lifetime="detached",
                              num_cpus=0).remote(spec.engine_config("colocated"), "colocated", "colocated-4", 0, 1,
                                                 10.0, "WARNING")
    ray.get(stray.placement.remote())  # up, never set up: not ready
    with Controller(spec) as controller:
        assert controller.adopted == [] and sorted(controller.instances) == ["colocated-5"]
        with pytest.raises(ValueError):
            ray.get_actor("colocated-4.rank0", namespace=spec.cluster_name)


def test_instance_of_another_spec_is_replaced_not_adopted(ray_session, tiny_path, redis_url):
    """A controller restarted with a changed engine spec stops the old instance and starts its own."""
    import ray
    spec = spec_for(tiny_path, ray_address="auto", redis_url=redis_url, mode="colocated",
                    cluster_name=f"test-{secrets.token_hex(3)}")
    first = Controller(spec).start()
    old = first.instances["colocated-0"].ranks[0]
    first.shutdown(stop_instances=False)
    with Controller(replace(spec, num_kv_blocks=96)) as controller:
        assert controller.adopted == [] and sorted(controller.instances) == ["colocated-1"]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(old.load.remote(), timeout=30)


def test_no_room_yet_is_owed_not_fatal(ray_session, tiny_path, redis_url):
    """`pdserve controller` starts before any worker node carries the role resources: its
    instances are owed (retried by the supervisor), not a failed start; a plain start fails."""
    spec = spec_for(tiny_path, ray_address="auto", redis_url=redis_url, ray_resources=True,
                    cluster_name=f"test-{secrets.token_hex(3)}")
    with Controller(spec, wait_for_room=True) as controller:
        assert controller.owed == ["prefill", "decode"] and controller.instances == {}
    with pytest.raises(ValueError, match="no Ray node has room for a prefill instance"):
        Controller(spec).start()


def test_load_window_sums_every_router():
    """Two gateways' published counters add up; one that appears counts from zero, one that
    went away stops counting (no negative rates)."""
    state = MemoryState()

    class Owner:  # what LoadWindow reads of a controller (router/view.py ClusterView)
        def instance_infos(self):
            return []

        def router_stats(self):
            return state.router_stats()

    state.publish_router("a", {"submitted": 10, "prompt_tokens": 100, "pending": 1}, ttl_s=60)
    window = LoadWindow(Owner())
    state.publish_router("a", {"submitted": 14, "prompt_tokens": 140, "pending": 2}, ttl_s=60)
    state.publish_router("b", {"submitted": 4, "prompt_tokens": 80, "pending": 3}, ttl_s=60)
    obs = window.observe(PoolSizes(1, 1))
    assert obs.arrival_rate > 0 and obs.mean_prompt_tokens == (40 + 80) / 8 and obs.decode_waiting == 5
    state.publish_router("a", {"submitted": 14, "prompt_tokens": 140}, ttl_s=1e-3)  # a is gone
    time.sleep(0.01)
    state.publish_router("b", {"submitted": 6, "prompt_tokens": 120}, ttl_s=60)
    obs = window.observe(PoolSizes(1, 1))
    assert obs.mean_prompt_tokens == 20 and obs.arrival_rate > 0


@pytest.mark.parametrize("device", ["cuda:1", "cuda:7"])
def test_a_cuda_index_under_ray_is_refused_before_anything_starts(device):
    """Under Ray each actor sees its one GPU as cuda:0, so `cuda:N` (N >= 1) would fail in every
    rank: refused in one line naming the flag, before Ray or any state starts; in-process it is kept."""
    spec = ClusterSpec(model="smollm2", device=device)
    with pytest.raises(ValueError, match=f"--device {device}: under Ray each rank's actor sees only the GPU"):
        Controller(spec, use_ray=True)
    assert Controller(spec, use_ray=False).spec.device == device
    assert Controller(replace(spec, device="cuda:0"), use_ray=True).spec.device == "cuda:0"


def test_most_instances_silent_at_once_are_spared_until_it_persists():
    """Five of six instances silent in one probe says more of the controller's view than of them: not
    dead until three probes in a row find it so; one silent alone, or an answer that says dead (an
    actor gone), is dead at once."""
    ctl = Controller(ClusterSpec(model="smollm2", device="cpu"), use_ray=False)

    def probe(silent: int, gone: int = 0) -> dict:
        answers = {f"d{k}": TimeoutError("silent") for k in range(silent)}
        answers.update({f"g{k}": RuntimeError("actor died") for k in range(gone)})
        answers.update({f"ok{k}": {"running": 0.0} for k in range(6 - silent - gone)})
        ctl._spare_the_silent(answers)
        return answers

    assert sorted(probe(5)) == ["ok0"] and sorted(probe(4, gone=1)) == ["g0", "ok0"]
    assert len(probe(5)) == 6  # the third in a row: declared dead
    assert len(probe(1)) == 6 and ctl.mass_silences == 0  # one silent instance: dead as ever
    assert len(probe(2)) == 6  # (fewer than three)
