"""The planner's load forecasts (cluster/autoscale/forecast.py) on hand-made rate series: the mean of the
last intervals, and a trend followed only when it rises clearly above the noise."""
from __future__ import annotations

import pytest

from cluster.autoscale.forecast import FORECASTS, LinearTrend, MeanRate, create_forecaster
from cluster.spec import CHOICES


def fed(forecaster, rates, interval_s=10.0):
    for k, rate in enumerate(rates):
        forecaster.observe(k * interval_s, rate)
    return forecaster


def test_mean_rate_is_the_last_three_intervals():
    assert MeanRate(10.0).predict(60) == 0.0  # nothing seen yet
    assert fed(MeanRate(10.0), [9.0, 1.0, 2.0, 3.0]).predict(60) == pytest.approx(2.0)


def test_linear_trend_follows_a_steady_ramp_one_horizon_ahead():
    """Rates 1, 2, ... 6 over six intervals: 30 s ahead of the last (6/s at +1 per 10 s) is 9/s."""
    ramp = fed(LinearTrend(10.0), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert ramp.predict(30.0) == pytest.approx(9.0)
    assert ramp.predict(0.0) == pytest.approx(6.0)


def test_linear_trend_ignores_noise_and_falls():
    """No clear rise (noise around 5, a slope within two standard errors) or a fall: MeanRate's mean,
    never an extrapolation downwards."""
    noisy = fed(LinearTrend(10.0), [5.0, 3.0, 7.0, 4.0, 6.0, 5.5])
    assert noisy.predict(60.0) == pytest.approx((4.0 + 6.0 + 5.5) / 3)
    falling = fed(LinearTrend(10.0), [6.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    assert falling.predict(60.0) == pytest.approx(2.0)
    assert fed(LinearTrend(10.0), [1.0, 5.0]).predict(60.0) == pytest.approx(3.0)  # two points: no line


def test_the_window_slides():
    """Six intervals kept: an old burst leaves the line."""
    trend = fed(LinearTrend(10.0), [50.0] + [2.0] * 8)
    assert len(trend.points) == 6 and trend.predict(30.0) == pytest.approx(2.0)


def test_registry_is_the_specs_choices():
    assert set(FORECASTS) == set(CHOICES["autoscale_forecast"])
    assert isinstance(create_forecaster("trend", 5.0), LinearTrend) and create_forecaster("mean", 5.0).window_s == 15
