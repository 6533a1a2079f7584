"""Kernel selection by measurement: the fastest per batch-size range, cached per machine, failing
and unavailable kernels skipped with a log line. Timings are injected through `time_fn`."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.quant.integer import Int8LinearMethod
from engine.quant.base import BASELINE, KERNELS, ReferenceKernel, UnquantizedBaseline
from engine.quant.selection import BUCKETS, DROP_AFTER, ROUNDS, choose_kernels

CPU = torch.device("cpu")
SHAPES = [(96, 64), (64, 96)]
MEASURED = [m for _, m in BUCKETS]  # the M each range is measured at: 1, 4, 16, 64, 512


class Named(ReferenceKernel):
    """A correct kernel (the reference's arithmetic) under another name."""

    def __init__(self, name: str, why_unavailable: str | None = None):
        self.name, self.label, self.why = name, f"kernel {name}", why_unavailable

    def unavailable(self, device):
        return self.why


class Broken(Named):
    def run(self, state, x):
        raise RuntimeError("no kernel image for this CPU")


def fake_times(table: dict[str, dict[int, float]], calls: list | None = None):
    """A time_fn from {kernel: {M: ms per shape}}; records every call in `calls`."""
    def time_fn(name, shape, m):
        if calls is not None:
            calls.append((name, shape, m))
        return table[name][m]
    return time_fn


def _choose(tmp_path, kernels, time_fn, shapes=SHAPES):
    return choose_kernels(shapes, kernels, torch.float32, CPU, ReferenceKernel(), tmp_path / "kernels.json",
                          time_fn, baseline=UnquantizedBaseline())


def test_picks_the_fastest_per_range(tmp_path):
    """Per M range the kernel with the least measured time wins, the baseline is timed beside
    them but never chosen, and each choice records every kernel's time (summed over the shapes)."""
    table = {"a": {1: 1.0, 4: 1.0, 16: 1.0, 64: 5.0, 512: 40.0}, "b": {1: 2.0, 4: 2.0, 16: 2.0, 64: 4.0, 512: 20.0},
             BASELINE: {1: 0.5, 4: 0.5, 16: 0.5, 64: 6.0, 512: 30.0}}
    choices = _choose(tmp_path, [Named("a"), Named("b")], fake_times(table))
    assert [c.kernel for c in choices] == ["a", "a", "a", "b", "b"]
    assert [c.max_m for c in choices] == [m for m, _ in BUCKETS] and choices[-1].max_m is None
    assert choices[0].ms == {BASELINE: 1.0, "a": 2.0, "b": 4.0}
    assert "kernel b for M<=128 (8.00 ms vs 12.00 ms unquantized)" == choices[3].describe("kernel b")


def test_results_are_cached_per_machine_and_shapes(tmp_path):
    """A second load with the same processor, torch, threads, dtype and shapes reads the JSON
    cache and measures nothing; other shapes are measured again and cached beside."""
    table = {"a": dict.fromkeys(MEASURED, 1.0), "b": {**dict.fromkeys(MEASURED, 2.0), 512: 0.5},
             BASELINE: dict.fromkeys(MEASURED, 3)}
    first = _choose(tmp_path, [Named("a"), Named("b")], fake_times(table))
    calls = []
    again = _choose(tmp_path, [Named("a"), Named("b")], fake_times(table, calls))
    assert again == first and calls == []
    _choose(tmp_path, [Named("a"), Named("b")], fake_times(table, calls), shapes=[(32, 32)])
    assert calls and len(json.loads((tmp_path / "kernels.json").read_text())) == 2


def test_a_failing_kernel_is_skipped_with_a_log_line(tmp_path, caplog):
    """Measured for real on a layer: a kernel that raises is dropped with a warning naming it and
    the error, and the others are chosen; the layer then computes with them."""
    layer = ColumnParallelLinear(64, 96, linear_method=Int8LinearMethod(
        candidates=[Broken("broken"), Named("good")], cache_path=tmp_path / "kernels.json"))
    layer.weight.data.normal_()
    with caplog.at_level(logging.INFO, logger="engine.quant"):
        layer.linear_method.process_layers([layer])
    assert {c.kernel for c in layer.linear_method.choices} == {"good"}
    failed = [r for r in caplog.records if "broken failed" in r.getMessage()]
    assert failed and failed[0].levelno == logging.WARNING and "no kernel image" in failed[0].getMessage()
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), ReferenceKernel().run(layer.quant_state["good"], x))


def test_an_unavailable_kernel_is_skipped_with_a_log_line(tmp_path, caplog):
    """A kernel that says it cannot run on this device is never measured; a log line says why."""
    calls = []
    table = {"ok": dict.fromkeys(MEASURED, 1.0), BASELINE: dict.fromkeys(MEASURED, 1.0)}
    layer = RowParallelLinear(64, 96, linear_method=Int8LinearMethod(
        candidates=[Named("gpu_only", "needs CUDA"), Named("ok")], cache_path=tmp_path / "k.json",
        time_fn=fake_times(table, calls)))
    layer.weight.data.normal_()
    with caplog.at_level(logging.INFO, logger="engine.quant"):
        layer.linear_method.process_layers([layer])
    assert "gpu_only" not in {name for name, _, _ in calls}
    assert any("kernel gpu_only skipped: needs CUDA" in r.getMessage() for r in caplog.records)


def test_a_much_slower_kernel_is_dropped_early(tmp_path, caplog):
    """A kernel over 10x slower than the best after the first rounds is not measured further at
    that M; at the next M it runs one shape first and stops again if that, scaled to the layer, is
    still too slow; where it turns fast (a per-call dequantize amortized over many tokens) it is
    measured in full and chosen."""
    table = {"fast": {1: 1.0, 4: 1.0, 16: 1.0, 64: 2.0, 512: 8.0},
             "slow": {1: 20.0, 4: 20.0, 16: 20.0, 64: 1.0, 512: 1.0},
             BASELINE: dict.fromkeys(MEASURED, 1.0)}
    calls = []
    with caplog.at_level(logging.INFO, logger="engine.quant"):
        choices = _choose(tmp_path, [Named("fast"), Named("slow")], fake_times(table, calls))
    assert [c.kernel for c in choices] == ["fast", "fast", "fast", "slow", "slow"]
    slow_calls = {m: sum(1 for name, _, mm in calls if name == "slow" and mm == m) for m in MEASURED}
    full = ROUNDS * len(SHAPES) - (len(SHAPES) - 1)  # round 0 ran only the probe shape
    assert slow_calls == {1: DROP_AFTER * len(SHAPES), 4: 1, 16: 1, 64: full, 512: ROUNDS * len(SHAPES)}
    assert sum(1 for c in calls if c[0] == "fast" and c[2] == 1) == ROUNDS * len(SHAPES)
    assert sum("slow is over 10x slower" in r.getMessage() for r in caplog.records) == 3


def test_the_reference_is_the_fallback_when_nothing_runs(tmp_path):
    """When every candidate fails, every range falls back to the plain-torch reference."""
    table = {BASELINE: dict.fromkeys(MEASURED, 1.0)}
    choices = _choose(tmp_path, [Named("missing")], fake_times(table))  # KeyError: the kernel fails
    assert [c.kernel for c in choices] == ["reference"] * len(BUCKETS)


def test_apply_runs_the_kernel_chosen_for_the_batch_size(tmp_path):
    """The method runs the small-M choice for decode-sized batches and the large-M one for
    prefills, switching exactly at the range's bound; both give the reference's result."""
    calls = []

    class Recording(Named):
        def run(self, state, x):
            calls.append((self.name, x.shape[0]))
            return super().run(state, x)

    table = {"small": {1: 1.0, 4: 1.0, 16: 9.0, 64: 9.0, 512: 9.0}, "large": {1: 2.0, 4: 2.0, 16: 1.0, 64: 1.0,
                                                                                  512: 1.0},
             BASELINE: dict.fromkeys(MEASURED, 1.0)}
    method = Int8LinearMethod(candidates=[Recording("small"), Recording("large")], cache_path=tmp_path / "k.json",
                              time_fn=fake_times(table))
    layer = ColumnParallelLinear(64, 96, linear_method=method)
    layer.weight.data.normal_()
    method.process_layers([layer])
    calls.clear()
    small_max = BUCKETS[1][0]  # "small" wins the first two ranges
    for m in (1, small_max, small_max + 1, 300):
        x = torch.randn(m, 64)
        torch.testing.assert_close(layer(x), ReferenceKernel().run(layer.quant_state["small"], x))
    assert calls == [("small", 1), ("small", small_max), ("large", small_max + 1), ("large", 300)]


@pytest.mark.parametrize("kernel", ["fbgemm", "int8pack"])
def test_real_measurement_is_quick(tmp_path, kernel):
    """Measuring a real candidate against the baseline on a small model's shapes takes well
    under a second and yields one choice per range."""
    import time
    if KERNELS[kernel]().unavailable(CPU):
        pytest.skip(f"{kernel} unavailable here")
    start = time.perf_counter()
    choices = _choose(tmp_path, [KERNELS[kernel]()], None)
    assert time.perf_counter() - start < 5 and len(choices) == len(BUCKETS)


def test_past_the_bucket_budget_two_rounds_do(tmp_path, monkeypatch):
    """Samples that take long (bf16 without native support, an LM head at M=512) are few: once one M
    has taken BUCKET_S seconds, its rounds stop at MIN_ROUNDS; quick ones still take all ROUNDS."""
    import time

    from engine.quant import selection
    monkeypatch.setattr(selection, "BUCKET_S", 0.05)
    calls = []

    def time_fn(name, shape, m):
        calls.append((name, m))
        if m == 512:
            time.sleep(0.02)
        return {"a": 1.0, "b": 2.0, BASELINE: 3.0}[name]
    choices = _choose(tmp_path, [Named("a"), Named("b")], time_fn)
    assert [c.kernel for c in choices] == ["a"] * 5
    per_m = {m: sum(1 for _, got in calls if got == m) for m in MEASURED}
    assert per_m[512] == selection.MIN_ROUNDS * 3 * len(SHAPES) < ROUNDS * 3 * len(SHAPES) == per_m[1], per_m
