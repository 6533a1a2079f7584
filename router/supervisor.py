"""Router threads that cannot die silently.

Every router thread (placement, one collector per instance, load refresh) runs its loop under a
`ThreadSupervisor`. The loops guard their handlers themselves (an exception there fails only the
request it concerns: router/failures.py); what escapes a loop anyway is caught here:

    target(*args) returns         ->  the thread ends for good (stop set, or its instance died)
    target(*args) raises          ->  logged with its traceback, counted in `restarts[name]`,
                                      target called again after a back-off (doubling, at most
                                      MAX_BACKOFF_S; reset after a run of HEALTHY_RUN_S)
    stop set                      ->  no restart

A restart calls the loop again on the same thread: a loop keeps its state in the router (queue,
tables), never in its own frame, so nothing is lost but the work in hand when it raised, and the
loop that raised puts that back itself (`Router._place_pending`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)
MAX_BACKOFF_S = 5.0
HEALTHY_RUN_S = 60.0  # a loop that ran this long before raising starts its back-off again from the bottom


class ThreadSupervisor:
    """Starts named daemon threads and restarts a target that raises; counts the restarts."""

    def __init__(self, stop: threading.Event, backoff_s: float):
        assert backoff_s > 0, backoff_s
        self.stop, self.backoff_s = stop, backoff_s
        self.threads: list[threading.Thread] = []
        self._restarts: dict[str, int] = {}
        self._lock = threading.Lock()

    def spawn(self, name: str, target: Callable, *args) -> threading.Thread:
        """Runs `target(*args)` on a new daemon thread `router-<name>`, restarted while it raises.

        Args:
            name: the thread's kind, the label its restarts are counted under (several threads
                may share one: a collector per instance).
        """
        with self._lock:
            self._restarts.setdefault(name, 0)
        t = threading.Thread(target=self._run, args=(name, target, args), daemon=True, name=f"router-{name}")
        self.threads.append(t)
        t.start()
        return t

    @property
    def restarts(self) -> dict[str, int]:
        """Thread kind -> restarts since start (every kind spawned is present, from 0)."""
        with self._lock:
            return dict(self._restarts)

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)

    def _run(self, name: str, target: Callable, args: tuple) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                target(*args)
                return
            except BaseException:  # noqa: BLE001 (a thread has no caller: nothing else would see it)
                if self.stop.is_set():
                    return
                with self._lock:
                    self._restarts[name] += 1
                logger.exception("router thread %s died; restarting it", name)
            failures = 1 if time.monotonic() - started >= HEALTHY_RUN_S else failures + 1
            if self.stop.wait(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (failures - 1))):
                return
