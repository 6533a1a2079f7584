"""The controller's HTTP endpoints (probes and operators; no inference):

    GET /health   200 while the process runs (the port opens before the instances start)
    GET /ready    200 once every instance the spec asks for is adopted or started, else 503
    GET /status   its instances: id, role, tp, health, load, ranks, adopted, engine
    GET /metrics  the autoscaler's families (when on) and instances per role and health
"""
from __future__ import annotations

import threading

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Families:
    """Instances per role and health, and the autoscaler's families once it runs."""

    def __init__(self, controller):
        self.controller = controller

    def collect(self):
        gauge = GaugeMetricFamily("pdserve_controller_instances", "instances the controller owns",
                                  labels=["role", "health"])
        counts: dict[tuple[str, str], int] = {}
        for info in self.controller.instance_infos():
            health = "healthy" if info.healthy else "dead"
            key = (info.role, "draining" if info.draining else health)
            counts[key] = counts.get(key, 0) + 1
        for (role, health), n in sorted(counts.items()):
            gauge.add_metric([role, health], n)
        yield gauge
        yield CounterMetricFamily("pdserve_controller_supervise_errors", "faults the instance supervisor survived "
                                  "(logged with their traceback)", value=self.controller.supervise_errors)
        if self.controller.autoscaler is not None:
            yield from self.controller.autoscaler.collect()

    def describe(self):
        return []


def create_controller_app(controller) -> tuple[FastAPI, threading.Event]:
    """The app, and the event to set once `controller.start()` (and its autoscaler) returned."""
    app = FastAPI(title="pdserve controller", version="0.1.0")
    started = threading.Event()
    registry = CollectorRegistry()
    registry.register(_Families(controller))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not started.is_set() or controller.owed:
            waiting = f"waiting for room for {', '.join(controller.owed)}" if started.is_set() else "starting instances"
            return JSONResponse({"status": waiting}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ready", "instances": len(controller.instances)}

    @app.get("/status")
    async def status():
        return {"instances": controller.instance_status()}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app, started
