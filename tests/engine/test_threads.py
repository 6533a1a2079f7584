"""engine/threads.py: a thread beside the step thread that runs serially starts no OpenMP team,
and the step thread keeps its own team size."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.threads import DEFAULT_NUM_THREADS, run_serially, use_intraop_threads

pytestmark = pytest.mark.skipif(DEFAULT_NUM_THREADS < 2 or not os.path.isdir("/proc/self/task"),
                                reason="needs 2+ torch threads and Linux's /proc")


def _threads_while_copying(serial: bool) -> int:
    """Threads in this process while a side thread, having copied a KV-sized tensor (a receive's
    scatter), still lives."""
    copied, release, counted = threading.Event(), threading.Event(), []

    def side():
        if serial:
            run_serially()
        cache = torch.zeros(2, 4096, 3, 64)
        cache.index_copy_(1, torch.arange(256), torch.ones(2, 256, 3, 64))  # parallel if it may be
        copied.set()
        release.wait()

    t = threading.Thread(target=side)
    t.start()
    copied.wait()
    counted.append(len(os.listdir("/proc/self/task")))
    release.set()
    t.join()
    return counted[0]


def test_a_serial_side_thread_starts_no_team():
    main_threads = torch.get_num_threads()
    try:
        use_intraop_threads(2)
        before = len(os.listdir("/proc/self/task"))
        assert _threads_while_copying(serial=False) == before + 2  # the thread and its team's worker
        assert _threads_while_copying(serial=True) == before + 1  # the thread alone
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
