"""GPU time of the worker's steps, and GPU idle time between them."""
from __future__ import annotations

import threading

import torch


class StepTimeline:
    """GPU time spent in steps, and GPU time idle between consecutive steps (waiting on the
    control plane), from CUDA events recorded around each step's work."""

    def __init__(self) -> None:
        # end() runs on the worker's launch thread, collect()/reset() on its event loop
        self._lock = threading.Lock()
        self._reset()

    def reset(self) -> None:
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._prev_stop: torch.cuda.Event | None = None
        self.busy_ms = self.idle_ms = 0.0
        self.num_steps = 0

    def begin(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def end(self) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        with self._lock:
            self.events.append((self._start, stop))
            if len(self.events) > 64:  # bound memory: fold in what has finished, no waiting
                self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        while self.events and (wait or self.events[0][1].query()):
            start, stop = self.events.pop(0)
            stop.synchronize()
            self.busy_ms += start.elapsed_time(stop)
            if self._prev_stop is not None:
                self.idle_ms += self._prev_stop.elapsed_time(start)
            self._prev_stop = stop
            self.num_steps += 1

    def collect(self) -> dict:
        """Fold in the steps recorded so far (waits for them to finish)."""
        with self._lock:
            self._fold(wait=True)
        return {"num_steps": self.num_steps, "gpu_busy_ms": self.busy_ms,
                "gpu_idle_between_steps_ms": self.idle_ms}
