"""Choosing a linear method's kernel per batch-size range by measuring it on the machine at hand.

Which kernel is fastest depends on the CPU (ISA, cache sizes), the torch build, the thread count,
the shapes and the number of tokens M in the matmul: decode steps (M = a few sequences) are
bound by reading the weights, prefills (M = hundreds of tokens) by arithmetic. So at load the
method times each candidate on the model's own shapes at one M per range and keeps the fastest
per range; results are cached in a small JSON file keyed by all of the above.

    M:   1             | 2 ..... 8     | 9 ...... 32    | 33 ...... 128  | 129 ..........
         measured at 1 | measured at 4 | measured at 16 | measured at 64 | measured at 512

Batch-1 decode has its own range: weight-only kernels that win there (reading 1 byte per weight
instead of 2 or 4) often lose already at a few tokens.

Timings are taken with the weights cold, as in the model, whose weights per step (hundreds of MB)
never fit in the CPU's last-level cache: each (kernel, shape) rotates through enough prepared
copies to cover COLD_FACTOR x that cache. Measured hot (one copy, resident in a 32 MB L3), the
dequantized bf16 weights looked as fast as int4 at 8 tokens (15.2 vs 15.8 ms for 30 layers);
cold, int4 is 1.6x faster there (14.1 vs 21.9 ms) and 3.4x at batch 1.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine.core.config import cache_dir
from engine.quant.base import BASELINE, quantize_per_channel

logger = logging.getLogger(__name__)

BUCKETS = ((1, 1), (8, 4), (32, 16), (128, 64), (None, 512))  # (largest M of the range; None = no limit, M measured)
SLOW_FACTOR = 10.0  # a kernel this much slower than the best is not measured further at that M
ROUNDS = 7  # samples per kernel and shape; the least counts
MIN_ROUNDS = 2  # ...but past BUCKET_S seconds at one M, this many do: samples that long barely vary
BUCKET_S = 2.0  # (bf16 on a CPU without it natively: an LM head's 7 rounds at M=512 took 18 s, 2 take 5)
DROP_AFTER = 3  # rounds before a slow kernel may be dropped (one noisy round must not drop a good one)
SAMPLE_MS = 0.2  # calls per sample: enough to last this long (short samples are rarely preempted)
COLD_FACTOR = 1.5  # prepared copies per (kernel, shape) cover this many times the last-level cache (CPU)
MAX_COPIES = 64

TimeFn = Callable[[str, tuple[int, int], int], float]  # (kernel name, (out, in), M) -> ms


@dataclass(frozen=True)
class KernelChoice:
    """The kernel for batches of up to `max_m` tokens (None: any larger batch)."""

    max_m: int | None
    kernel: str
    ms: dict[str, float] = field(default_factory=dict)  # one decoder layer's linears at the measured M

    def describe(self, label: str) -> str:
        where = "every M" if not self.ms and self.max_m is None else \
            f"M<={self.max_m}" if self.max_m is not None else "larger M"
        mine, base = self.ms.get(self.kernel), self.ms.get(BASELINE)
        if mine is None:
            return f"{label} for {where}"
        vs = "" if base is None else f" vs {base:.2f} ms {BASELINE}"
        return f"{label} for {where} ({mine:.2f} ms{vs})"


def default_cache_path() -> Path:
    """`$PDSERVE_LINEAR_KERNELS_CACHE`, else linear_kernels.json in `$PDSERVE_CACHE_DIR` (~/.cache/pdserve)."""
    explicit = os.environ.get("PDSERVE_LINEAR_KERNELS_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    return cache_dir() / "linear_kernels.json"


def processor_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or platform.processor() or platform.machine()


def cache_key(shapes, kernels, dtype: torch.dtype, device: torch.device) -> str:
    return json.dumps({"processor": processor_name(device), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "device": device.type, "dtype": str(dtype),
                       "shapes": [list(s) for s in shapes], "kernels": [k.name for k in kernels],
                       "buckets": BUCKETS, "cold_bytes": cold_bytes(device)}, sort_keys=True)


def cold_bytes(device: torch.device) -> int:
    """Bytes of prepared weights a timing rotates through: COLD_FACTOR x the CPU's last-level cache
    (32 MB when the OS does not say); 0 on GPUs (weights are timed as one copy)."""
    return int(COLD_FACTOR * (_last_level_cache_bytes() or 32 << 20)) if device.type == "cpu" else 0


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest cache sysfs lists for CPU 0 (0 where it lists none)."""
    llc = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()  # "32768K"
            llc = max(llc, int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0))
        except (OSError, ValueError):
            continue
    return llc


def _nbytes(state: Any) -> int:
    """Bytes of the tensors in a kernel's prepared state (tensors, tuples, lists, objects' attributes)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, (tuple, list)):
        return sum(_nbytes(s) for s in state)
    if hasattr(state, "__dict__"):
        return sum(_nbytes(s) for s in vars(state).values())
    return 0


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, choices: list[KernelChoice]) -> None:
    """Adds one entry, written atomically (TP ranks on one host may write at once)."""
    data = _read_cache(path)
    data[key] = [asdict(c) for c in choices]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("linear kernels: cannot write the cache %s (%s); measuring again next load", path, exc)


def _time_sample(fn: Callable[[], Any], inner: int, device: torch.device) -> float:
    """Milliseconds per call over `inner` back-to-back calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - start) / inner * 1e3


def random_int8(shape: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_channel(torch.randn(shape, device=device))


def measuring_time_fn(kernels, dtype: torch.dtype, device: torch.device, random_weights=random_int8) -> TimeFn:
    """A `TimeFn` that runs a kernel on `random_weights(shape, device)`, prepared once per shape in
    as many copies as cover `cold_bytes` (each call takes the next: the weights come from memory,
    as in the model): one sample of enough calls to last about SAMPLE_MS (the first call of each
    case warms up and sets that count)."""
    by_name, states, inputs, inner, turn = {k.name: k for k in kernels}, {}, {}, {}, {}
    budget = cold_bytes(device)

    def time_fn(name: str, shape: tuple[int, int], m: int) -> float:
        kernel = by_name[name]
        if (name, shape) not in states:
            first = kernel.prepare(*random_weights(shape, device), dtype)
            copies = min(MAX_COPIES, max(1, math.ceil(budget / max(_nbytes(first), 1))))
            states[name, shape] = [first] + [kernel.prepare(*random_weights(shape, device), dtype)
                                             for _ in range(copies - 1)]
            turn[name, shape] = 0
        if (shape, m) not in inputs:
            inputs[shape, m] = torch.randn(m, shape[1], device=device, dtype=dtype)
        x, copies = inputs[shape, m], states[name, shape]

        def call():
            turn[name, shape] = (turn[name, shape] + 1) % len(copies)
            return kernel.run(copies[turn[name, shape]], x)
        with torch.inference_mode():
            if (name, shape, m) not in inner:
                warm = _time_sample(call, 1, device)
                inner[name, shape, m] = max(1, min(50, int(SAMPLE_MS / max(warm, 1e-4))))
            return _time_sample(call, inner[name, shape, m], device)
    return time_fn


def _sample(name: str, shape: tuple, m: int, time_fn: TimeFn, failed: set[str]) -> float | None:
    try:
        return time_fn(name, shape, m)
    except Exception as exc:  # a kernel that cannot run here is skipped, never silently
        failed.add(name)
        logger.warning("linear kernels: %s failed at M=%d on shape %s (%s: %s); skipped", name, m, shape,
                       type(exc).__name__, exc)
        return None


def _measure_bucket(names: list[str], shapes, m: int, time_fn: TimeFn, failed: set[str],
                    was_slow: set[str]) -> tuple[dict[str, float], set[str]]:
    """One decoder layer's linears at M = m (the sum over `shapes`) per kernel.

    Samples are interleaved across kernels, ROUNDS times (MIN_ROUNDS once the M has taken BUCKET_S
    seconds), and each kernel keeps its least per shape: load from other processes only ever adds
    time, and interleaving spreads it over all kernels alike. A kernel that raises joins `failed`. One SLOW_FACTOR slower than the best candidate
    after DROP_AFTER rounds is not measured further here; one that was so at the previous M first
    runs only the smallest shape, and stops if that, scaled to the whole layer, is too slow again
    (a kernel that dequantizes per call is slow at small M and may win at large M).
    Returns:
        ms per kernel that ran every shape (the baseline too), and the kernels too slow here."""
    shapes = [tuple(s) for s in shapes]
    probe = min(shapes, key=lambda s: s[0] * s[1])
    best: dict[tuple[str, tuple], float] = {}
    slow: set[str] = set()
    start = time.perf_counter()
    for round_ in range(ROUNDS):
        if round_ >= MIN_ROUNDS and time.perf_counter() - start > BUCKET_S:
            break
        for shape in shapes:
            for name in names:
                if name in failed or name in slow or (round_ == 0 and name in was_slow and shape != probe):
                    continue
                sample = _sample(name, shape, m, time_fn, failed)
                if sample is not None:
                    best[name, shape] = min(best.get((name, shape), math.inf), sample)
        if round_ == 0:
            scale = sum(a * b for a, b in shapes) / (probe[0] * probe[1])
            slow |= _too_slow({n: best[n, probe] * scale for n in was_slow if (n, probe) in best}, best, shapes, m)
        if round_ == DROP_AFTER - 1:
            totals = {n: sum(best[n, s] for s in shapes) for n in names
                      if n not in slow and all((n, s) in best for s in shapes)}
            slow |= _too_slow(totals, best, shapes, m)
    return {n: sum(best[n, s] for s in shapes) for n in names if all((n, s) in best for s in shapes)}, slow


def _too_slow(estimates: dict[str, float], best: dict, shapes, m: int) -> set[str]:
    """The candidates among `estimates` (ms for the whole layer) over SLOW_FACTOR times the fastest
    candidate measured on every shape; the baseline is only ever compared against."""
    measured = {n for n, s in best if n != BASELINE and all((n, t) in best for t in shapes)}
    fastest = min((sum(best[n, s] for s in shapes) for n in measured), default=math.inf)
    slow = {n for n, t in estimates.items() if n != BASELINE and t > SLOW_FACTOR * fastest}
    for name in sorted(slow):
        logger.info("linear kernels: %s is over %.0fx slower than the best at M=%d (%.2f ms vs %.2f ms); "
                    "not measured further at this M", name, SLOW_FACTOR, m, estimates[name], fastest)
    return slow


def choose_kernels(shapes, kernels, dtype: torch.dtype, device: torch.device, fallback,
                   cache_path: str | os.PathLike | None = None, time_fn: TimeFn | None = None,
                   baseline=None, random_weights=random_int8) -> list[KernelChoice]:
    """The fastest of `kernels` per range of M (BUCKETS), measured on `shapes` or read from the cache.

    Args:
        shapes: the (out, in) of the model's linears on this rank (unique).
        kernels: candidates with `.name`, `.prepare(*weights, dtype)` and `.run(state, x)`.
        fallback: the kernel used where no candidate ran (never measured).
        time_fn: replaces measuring (tests); its results are cached like measured ones.
        baseline: an unquantized kernel timed alongside, for the log only (default: none).
        random_weights: `(shape, device) -> weights` in the kernels' format, to time them on.
    Returns:
        One `KernelChoice` per bucket, in increasing M; the last has max_m None.
    """
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = cache_key(shapes, kernels, dtype, device)
    cached = _read_cache(path).get(key)
    if cached is not None:
        choices = [KernelChoice(**c) for c in cached]
        logger.info("linear kernels: measured before on this machine (%s)", path)
        return choices
    everyone = ([baseline] if baseline is not None else []) + list(kernels)
    time_fn = time_fn or measuring_time_fn(everyone, dtype, device, random_weights)
    start, failed, slow, choices = time.perf_counter(), set(), set(), []
    for max_m, m in BUCKETS:
        ms, slow = _measure_bucket([k.name for k in everyone], shapes, m, time_fn, failed, slow)
        ranked = sorted((t, n) for n, t in ms.items() if n != BASELINE and n not in failed | slow)
        choices.append(KernelChoice(max_m, ranked[0][1] if ranked else fallback.name, ms))
    logger.info("linear kernels: measured %d kernels on %d shapes in %.2f s", len(everyone), len(shapes),
                time.perf_counter() - start)
    _write_cache(path, key, choices)
    return choices
