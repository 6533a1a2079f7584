"""engine/core/threads.py: a thread beside the step thread that runs serially starts no OpenMP team,
and the step thread keeps its own team size."""
from __future__ import annotations

import collections
import os
import threading
import time

import pytest
import torch

from engine.core.threads import DEFAULT_NUM_THREADS, run_serially, use_intraop_threads

pytestmark = pytest.mark.skipif(DEFAULT_NUM_THREADS < 2 or not os.path.isdir("/proc/self/task"),
                                reason="needs 2+ torch threads and Linux's /proc")


def _threads_while_copying(serial: bool) -> int:
    """Threads this process gained while a side thread, having copied a KV-sized tensor (a
    receive's scatter), still lives: the thread itself, and any OpenMP team it started. The most
    common count of five tries (each after the last one's threads are gone): other tests' background
    threads (a transport's, Ray's) may start or end during one."""
    def once() -> int:
        copied, release = threading.Event(), threading.Event()

        def side():
            if serial:
                run_serially()
            cache = torch.zeros(2, 4096, 3, 64)
            cache.index_copy_(1, torch.arange(256), torch.ones(2, 256, 3, 64))  # parallel if it may be
            copied.set()
            release.wait()

        before = len(os.listdir("/proc/self/task"))
        t = threading.Thread(target=side)
        t.start()
        copied.wait()
        during = len(os.listdir("/proc/self/task"))
        release.set()
        t.join()
        deadline = time.monotonic() + 5  # its threads leave /proc a moment after join(): the next try waits
        while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        return during - before

    return collections.Counter(once() for _ in range(5)).most_common(1)[0][0]


def test_a_serial_side_thread_starts_no_team():
    main_threads = torch.get_num_threads()
    try:
        use_intraop_threads(2)
        assert _threads_while_copying(serial=False) == 2  # the thread and its team's worker
        assert _threads_while_copying(serial=True) == 1  # the thread alone
    finally:
        torch.set_num_threads(main_threads)


def test_the_step_thread_keeps_its_team_size():
    seen = {}
    main_threads = torch.get_num_threads()
    step_set, side_done = threading.Event(), threading.Event()

    def step():
        use_intraop_threads(2)
        step_set.set()
        side_done.wait()
        seen["step"] = torch.get_num_threads()

    def side():
        run_serially()
        seen["side"] = torch.get_num_threads()

    try:
        s = threading.Thread(target=step)
        s.start()
        step_set.wait()
        t = threading.Thread(target=side)
        t.start()
        t.join()
        side_done.set()
        s.join()
    finally:
        torch.set_num_threads(main_threads)
    assert seen == {"step": 2, "side": 1}
    assert use_intraop_threads(None) == DEFAULT_NUM_THREADS == torch.get_num_threads()
    torch.set_num_threads(main_threads)


class _Host:
    """A clock and the two counters TeamSizer reads, moved by hand: seconds, the cores' busy
    seconds, this process's CPU seconds."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        """`seconds` pass; other processes keep `others` cores busy, this one `own`."""
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own


def _sizer(max_threads: int, host: _Host) -> "TeamSizer":
    from engine.core.threads import TeamSizer
    sizer = TeamSizer(max_threads, clock=lambda: host.now, read_busy=lambda cpus: host.busy, read_own=lambda: host.own)
    sizer.cpus = frozenset(range(2))  # a 2-core host, whatever runs the test
    return sizer


def test_team_shrinks_beside_a_busy_process_and_grows_back():
    """On 2 cores: a busy neighbour (others ~0.7 of a core while the team spins on both) shrinks a
    team of 2 to 1 after two windows that agree, on the calling thread; the neighbour gone, it grows
    back to 2; light load beside it (a gateway's ~0.2 core) keeps 2."""
    main_threads = torch.get_num_threads()
    try:
        host = _Host()
        use_intraop_threads(2)
        sizer = _sizer(2, host)
        for _ in range(3):
            host.advance(0.6, others=0.2, own=1.8)
            assert sizer.maybe_resize() == 2
        host.advance(0.6, others=0.7, own=1.3)
        assert sizer.maybe_resize() == 2  # one window is not enough
        host.advance(0.6, others=0.7, own=1.3)
        assert sizer.maybe_resize() == 1 and torch.get_num_threads() == 1
        host.advance(0.6, others=1.0, own=1.0)
        assert sizer.maybe_resize() == 1
        host.advance(0.6, others=0.05, own=1.0)
        assert sizer.maybe_resize() == 1
        host.advance(0.6, others=0.05, own=1.0)
        assert sizer.maybe_resize() == 2 and torch.get_num_threads() == 2 and sizer.num_resizes == 2
    finally:
        torch.set_num_threads(main_threads)


def test_team_reads_the_host_at_most_once_an_interval_and_never_past_its_most():
    """Within interval_s nothing is read or changed; a window where a burst asked for another size
    and the next did not leaves the size; no size goes below 1 or above max_threads."""
    host = _Host()
    sizer = _sizer(1, host)
    host.advance(0.1, others=2.0, own=0.0)
    assert sizer.maybe_resize() == 1 and sizer._last[0] == 0.0
    for others in (2.0, 2.0, 0.0, 0.0):
        host.advance(0.6, others=others, own=1.0)
        assert sizer.maybe_resize() == 1
    main_threads = torch.get_num_threads()
    try:
        use_intraop_threads(2)
        sizer = _sizer(2, host)
        host.advance(0.6, others=0.9, own=1.1)
        sizer.maybe_resize()
        host.advance(0.6, others=0.1, own=1.9)
        assert sizer.maybe_resize() == 2 and sizer.num_resizes == 0
    finally:
        torch.set_num_threads(main_threads)


def test_cpu_busy_counts_only_the_given_cpus(tmp_path):
    """The busy time of /proc/stat's per-CPU lines, all fields but idle and iowait, of the given CPUs only."""
    from engine.core.threads import read_cpu_busy_s
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\n"
                    "cpu0 4 1 2 50 3 1 1 1 0 0\n"
                    "cpu1 6 0 8 50 2 0 0 0 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert read_cpu_busy_s(frozenset({0}), str(stat)) == pytest.approx(10 / hz)
    assert read_cpu_busy_s(frozenset({0, 1}), str(stat)) == pytest.approx(24 / hz)
    assert read_cpu_busy_s(frozenset({0}), "/proc/stat") > 0
