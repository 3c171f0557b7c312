"""The smoke notebook's memory meter: the peak memory of this process and its children
(browsers, environment workers) over a run, sampled in a background thread."""
from __future__ import annotations

import os
import threading


class MemoryMonitor:
    """Samples the memory of this process and all its children (browsers, workers).

    Sums PSS (proportional set size): browser processes share most of their pages, and summing
    RSS would count those many times over."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        me = psutil.Process(os.getpid())
        total = 0
        for proc in [me] + me.children(recursive=True):
            try:
                total += proc.memory_full_info().pss
            except (psutil.Error, AttributeError):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self._stop.wait(self.interval_s)

    def start(self) -> "MemoryMonitor":
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stop sampling; returns the peak in GB."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_bytes / 1e9

