"""What planning is doing, on stderr, once it has taken long enough for a person to wonder.

The planner calls its `on_phase` callback as each phase starts, with a note on what the phase
before found:

    on_phase("capture")                            tracing the model
    on_phase("strategies")                         sharding options and their costs
    on_phase("solve", "1768 decisions")            the ILP
    on_phase("done", "HiGHS: optimal")             the solver's status (`solver.solve.status_words`)

`PhaseProgress` is such a callback. It stays silent for the first `DELAY_S` seconds (a quick
plan prints nothing); after that it says which phase is running, and as each phase ends how long
it took and what it found. A phase that is already running at the delay is announced by a timer
thread; use it as a context manager so that the thread ends with planning.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

DELAY_S = 2.0     # planning quicker than this prints nothing


class PhaseProgress:
    def __init__(self, stream: TextIO | None = None, delay_s: float | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self.t0 = self.t_phase = time.perf_counter()
        self.phase: str | None = None
        self.announced = False
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def __enter__(self) -> PhaseProgress:
        threading.Thread(target=self._wake_at_delay, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()

    def _late(self) -> bool:
        return time.perf_counter() - self.t0 >= self.delay_s

    def _say(self, text: str) -> None:
        print(f"autopar: {text}", file=self.stream, flush=True)

    def _wake_at_delay(self) -> None:
        if self.stop.wait(self.delay_s):
            return
        with self.lock:
            if self.phase and self.phase != "done" and not self.announced:
                self._say(f"{self.phase} ...")
                self.announced = True

    def __call__(self, phase: str, note: str = "") -> None:
        with self.lock:
            now = time.perf_counter()
            if self.phase is not None and self._late():
                found = f" ({note})" if note else ""
                self._say(f"{self.phase} took {now - self.t_phase:.1f} s{found}")
            self.phase, self.t_phase, self.announced = phase, now, False
            if phase == "done":
                if self._late():
                    self._say(f"planned in {now - self.t0:.1f} s")
                self.stop.set()
            elif self._late():
                self._say(f"{phase} ...")
                self.announced = True
