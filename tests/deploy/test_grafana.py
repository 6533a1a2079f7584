"""The Grafana dashboard (deploy/grafana/pdserve-dashboard.json) against the metrics the gateway
actually exports: every metric has a panel, and no panel queries a metric that does not exist."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.metrics import REQUEST_PHASES, GatewayMetrics

pytestmark = pytest.mark.timeout(300)

DASHBOARD = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json")
                       .read_text())
# The autoscaler's metrics (cluster/autoscale/autoscale_loop.py `Autoscaler.collect`), on the gateway's /metrics.
AUTOSCALER_SERIES = {"pdserve_autoscaler_desired_instances", "pdserve_autoscaler_current_instances",
                     "pdserve_autoscaler_decisions_total", "pdserve_autoscaler_predicted_ttft_seconds",
                     "pdserve_autoscaler_arrival_rate", "pdserve_autoscaler_errors_total",
                     "pdserve_autoscaler_moves_total", "pdserve_autoscaler_standby_instances",
                     "pdserve_autoscaler_start_seconds"}
HISTOGRAMS = ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
              "pdserve_e2e_request_latency_seconds")


def gateway_series() -> set[str]:
    """The series names a query uses for each metric family of a gateway with no instances yet:
    `_total` for counters, `_bucket` for histograms, the name itself for gauges."""
    metrics = GatewayMetrics(SimpleNamespace(router=None, instance_infos=list))
    suffix = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
    return {family.name + suffix[family.type] for family in metrics.registry.collect()}


def panels() -> list[dict]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_every_exported_metric_has_a_panel():
    """Each gateway and autoscaler series appears in at least one query."""
    queried = " ".join(exprs())
    expected = gateway_series() | AUTOSCALER_SERIES
    assert len(expected) > 20
    missing = sorted(name for name in expected if not re.search(rf"\b{name}\b", queried))
    assert not missing, missing


def test_no_panel_queries_an_unknown_metric():
    """A misspelled metric name in a query would draw an empty panel forever."""
    known = gateway_series() | AUTOSCALER_SERIES
    used = set(re.findall(r"\bpdserve_[a-z0-9_]+", " ".join(exprs())))
    assert used and used <= known, sorted(used - known)


@pytest.mark.parametrize("histogram", HISTOGRAMS)
def test_latency_histograms_show_p50_and_p99(histogram):
    """Latency panels compute quantiles from the `_bucket` series, aggregated by `le`."""
    for quantile in ("0.5", "0.99"):
        wanted = f"histogram_quantile({quantile}, sum by (le) (rate({histogram}_bucket[$__rate_interval])))"
        assert wanted in exprs(), wanted


def test_datasource_is_a_variable():
    """The dashboard names no concrete data source: every panel uses `${DS_PROMETHEUS}`, a
    Prometheus data-source variable, so it imports into any Grafana."""
    (variable,) = [v for v in DASHBOARD["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
    assert 36 <= DASHBOARD["schemaVersion"] <= 41


def test_layout_is_well_formed():
    """Panel ids are unique and every panel fits the 24-column grid without overlapping another."""
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, panel["title"]
        cells |= area


@pytest.mark.parametrize("phase", REQUEST_PHASES)
def test_each_request_phase_has_a_panel_with_exemplars(phase):
    """A panel per request phase (gateway/metrics.py REQUEST_PHASES): p50 and p99 of its histogram, with
    exemplars (a traced request's trace id: docs/observability.md) shown."""
    series = f'pdserve_request_phase_seconds_bucket{{phase="{phase}"}}'
    panel, = [p for p in panels() if any(series in t["expr"] for t in p["targets"])]
    for quantile in ("0.5", "0.99"):
        wanted = f"histogram_quantile({quantile}, sum by (le) (rate({series}[$__rate_interval])))"
        target, = [t for t in panel["targets"] if t["expr"] == wanted]
        assert target["exemplar"] is True, (phase, quantile)
