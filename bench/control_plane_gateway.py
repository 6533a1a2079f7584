"""One gateway of the control-plane benchmark (bench/control_plane.py starts G of these): the real
gateway app and router (cluster/control/frontend.py Frontend) over the cluster state's instances,
found on the simulated hosts (bench/sim_instances.py) instead of as rank actors by name. Adds
`GET /bench/stats`: the instances attached (id -> healthy) and the router's decision times since
the last call (`Router._plan`: the policy's picks under the router's lock).

    python -m bench.control_plane_gateway --spec spec.json --num-hosts K --port P
"""
from __future__ import annotations

import argparse
import json
import time
from collections import deque

from bench.sim_instances import MemberHandle, host_name
from cluster.cli.serve import gateway_tokenizer
from cluster.control.frontend import Frontend
from cluster.spec import ClusterSpec
from gateway.app import create_app


class SimFrontend(Frontend):
    """A Frontend whose instances live on SimHosts."""

    def __init__(self, spec: ClusterSpec, num_hosts: int):
        super().__init__(spec)
        self.num_hosts = num_hosts
        self.plan_s: deque[float] = deque(maxlen=100_000)

    def rank0_actor(self, instance_id: str):
        import ray
        return MemberHandle(ray.get_actor(host_name(instance_id, self.num_hosts), namespace=self.spec.cluster_name),
                            instance_id)

    def start(self) -> SimFrontend:
        super().start()
        plan = self.router._plan

        def timed(tracked):
            start = time.perf_counter()
            try:
                return plan(tracked)
            finally:
                self.plan_s.append(time.perf_counter() - start)

        self.router._plan = timed
        return self

    def bench_stats(self) -> dict:
        taken, self.plan_s = list(self.plan_s), deque(maxlen=100_000)
        return {"instances": {iid: inst.client.info.healthy for iid, inst in list(self.instances.items())},
                "plan_s": taken, "router": self.router.snapshot()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="a JSON file of ClusterSpec keys")
    ap.add_argument("--num-hosts", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    spec = ClusterSpec(**json.loads(open(args.spec).read()))
    frontend = SimFrontend(spec, args.num_hosts).start()
    app = create_app(frontend, gateway_tokenizer(spec), spec.model, None)
    app.get("/bench/stats")(frontend.bench_stats)
    import uvicorn
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        frontend.shutdown()


if __name__ == "__main__":
    main()
