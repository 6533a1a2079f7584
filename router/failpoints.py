"""Failpoints: a fault injected into a running gateway's router on purpose, to prove that its
guards fail one request and nothing else (the chaos run's `router_fault`, bench/chaos_faults.py).

    PDSERVE_FAILPOINTS=sigusr2     at start: SIGUSR2 arms the router's failpoint; the next event a
                                   router handler takes (placing a request, a prefill result, a
                                   decode output) raises InjectedFault inside that handler, once
                                   per signal

Unset (the default), nothing is installed and `check` is one integer test. Armed, it is logged at
start; every fault it fires is logged and counted by the guard it hits (handler_errors).
"""
from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)
ENV = "PDSERVE_FAILPOINTS"


class InjectedFault(RuntimeError):
    """Raised by an armed failpoint."""


class Failpoints:
    def __init__(self):
        self.armed = 0  # faults still to fire
        self.fired = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Failpoints:
        """Installs the SIGUSR2 trigger when ENV asks for it (from the main thread: elsewhere
        Python refuses a signal handler, and this says so)."""
        points = cls()
        mode = os.environ.get(ENV, "")
        if mode == "sigusr2":
            try:
                signal.signal(signal.SIGUSR2, lambda *_: points.arm())
                logger.warning("%s=sigusr2: SIGUSR2 makes the next router handler raise (fault injection)", ENV)
            except ValueError:  # not the main thread
                logger.warning("%s=sigusr2 ignored: the router was not built on the main thread", ENV)
        elif mode:
            raise ValueError(f"{ENV}={mode!r}: the one mode is 'sigusr2'")
        return points

    def arm(self, times: int = 1) -> None:
        with self._lock:
            self.armed += times

    def check(self, where: str) -> None:
        """Raises InjectedFault once per arming; nothing when unarmed."""
        if not self.armed:
            return
        with self._lock:
            if not self.armed:
                return
            self.armed -= 1
            self.fired += 1
        logger.warning("failpoint fired in router handler %s", where)
        raise InjectedFault(f"injected fault in {where}")
