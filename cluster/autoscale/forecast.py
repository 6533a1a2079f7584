"""Load forecasts for the planner: the arrival rate expected `horizon_s` from now, from recent history.

    Forecaster.observe(now, rate)     one interval's arrival rate (requests/s)
    Forecaster.predict(horizon_s)     the rate expected then (>= 0)

The planner asks for the rate one cold start ahead (capacity asked for now serves then). `MeanRate`
is the mean of the recent window (what the planner used before forecasts: it sees a ramp only once
it is there); `LinearTrend` fits a line through the window and follows it, so a ramp's instances
are asked for one cold start early. Another predictor is a class with these two methods, named in
FORECASTS (the spec's `autoscale_forecast` key).
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from cluster.spec import spec_registry


def fit_line(points: list[tuple[float, float]], allow_negative: bool = False) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x; slope 0 through the mean for one distinct x.
    The slope is floored at 0 unless `allow_negative` (a step never gets cheaper with more sequences)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    if not allow_negative:
        slope = max(slope, 0.0)
    return my - slope * mx, slope


class Forecaster(Protocol):
    def observe(self, now: float, rate: float) -> None:
        """Folds in the arrival rate of the interval that ended at `now` (seconds, monotonic)."""

    def predict(self, horizon_s: float) -> float:
        """The arrival rate expected `horizon_s` after the last observation (0 before any)."""


class MeanRate:
    """The mean rate of the last three intervals: no trend, the future is the recent past."""

    INTERVALS = 3

    def __init__(self, interval_s: float = 10.0):
        self.interval_s, self.window_s = interval_s, self.INTERVALS * interval_s
        self.points: deque[tuple[float, float]] = deque()

    def observe(self, now: float, rate: float) -> None:
        self.points.append((now, rate))
        while now - self.points[0][0] >= self.window_s:
            self.points.popleft()

    def predict(self, horizon_s: float) -> float:
        return self.mean()

    def mean(self) -> float:
        """The mean rate of the last three intervals (0 before any)."""
        if not self.points:
            return 0.0
        last = self.points[-1][0]
        recent = [r for t, r in self.points if last - t < MeanRate.INTERVALS * self.interval_s]
        return sum(recent) / len(recent)


SIGNIFICANT = 2.0  # a rising slope is followed when it is this many standard errors above 0


class LinearTrend(MeanRate):
    """A least-squares line through the last six intervals' rates, read `horizon_s` ahead, floored at 0.

    Only a rise that noise could hardly draw (the slope `SIGNIFICANT` standard errors above 0) is
    followed; else the forecast is MeanRate's (the last three intervals). A falling trend is not
    followed (shrinking early saves little and risks the SLO; the planner shrinks a pool on the peak
    of the last minutes anyway).
    """

    INTERVALS = 6

    def predict(self, horizon_s: float) -> float:
        if len(self.points) < 3:
            return self.mean()
        t0 = self.points[-1][0]
        points = [(t - t0, r) for t, r in self.points]
        intercept, slope = fit_line(points, allow_negative=True)
        if slope <= SIGNIFICANT * _slope_error(points, intercept, slope):
            return self.mean()  # no trend that noise could not draw
        return max(0.0, intercept + slope * horizon_s)


def _slope_error(points: list[tuple[float, float]], intercept: float, slope: float) -> float:
    """The standard error of a least-squares slope (inf for fewer than three points)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if n < 3 or sxx == 0:
        return float("inf")
    residual = sum((y - intercept - slope * x) ** 2 for x, y in points) / (n - 2)
    return (residual / sxx) ** 0.5


FORECASTS = spec_registry("autoscale_forecast", {"mean": MeanRate, "trend": LinearTrend})


def create_forecaster(name: str, interval_s: float) -> Forecaster:
    """The forecaster `name` names (the spec has checked it), fed one rate every `interval_s`."""
    return FORECASTS[name](interval_s)
