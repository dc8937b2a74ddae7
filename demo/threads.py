"""Torch intra-op threads while the demo pair trains: two when the cores are free, one when they are not.

On a shared machine, threads that wait for each other on oversubscribed cores cost far more than one
thread alone: a training step that takes 0.2 s with two threads on quiet cores was seen taking 10-18 s
once other processes took the cores. So the choice is made at the start from the load average and
revisited during training. The weights do not depend on it (tests/demo checks 1 vs 2 threads): CPU
matmuls here split work over output blocks, not over the reduced dimension.
"""

from __future__ import annotations

import contextlib
import os
import time

RECHECK_STEPS = 10  # steps between two looks at the load average
SLOW_FACTOR = 3.0  # a step this many times slower than the fastest one at the same thread count: oversubscribed
HOLD_STEPS = 60  # after such a step, stay at one thread at least this many steps


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask, else all)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]  # 1-minute average of runnable tasks, ours included
    except OSError:
        return None


def build_threads(limit: int) -> int:
    """Threads to start with: up to `limit`, but 1 when other processes already keep half the cores busy."""
    cores = _cores()
    load = _load()
    busy = load is not None and load > cores / 2
    return 1 if busy else max(1, min(limit, cores))


class ThreadTuner:
    """Sets torch's thread count around each training step (`with tuner.step(): ...`).

    Starts at `build_threads(limit)`. Every RECHECK_STEPS steps it compares the load average without our
    own threads with half the cores; and a step SLOW_FACTOR times slower than the fastest one seen at more
    than one thread drops it to one thread at once (the load average lags by a minute). `used` counts the
    steps run at each thread count.
    """

    def __init__(self, limit: int):
        self.limit = max(1, min(limit, _cores()))
        self.current = build_threads(self.limit)
        self.used: dict[int, int] = {}
        self._steps = 0
        self._hold_until = 0
        self._fastest: dict[int, float] = {}

    @contextlib.contextmanager
    def step(self):
        import torch

        if torch.get_num_threads() != self.current:
            torch.set_num_threads(self.current)
        t0 = time.perf_counter()
        yield
        self.record(time.perf_counter() - t0)

    def record(self, seconds: float) -> None:
        """Count one step of `seconds` at the current thread count; choose the count for the next one."""
        self.used[self.current] = self.used.get(self.current, 0) + 1
        self._steps += 1
        if self.limit == 1:
            return
        n = self.current
        fastest = self._fastest.get(n, seconds)
        self._fastest[n] = min(fastest, seconds)
        if n > 1 and seconds > SLOW_FACTOR * fastest:
            self.current, self._hold_until = 1, self._steps + HOLD_STEPS
            return
        if self._steps % RECHECK_STEPS or self._steps < self._hold_until:
            return
        load = _load()
        if load is None:
            return
        others = max(0.0, load - n)
        self.current = self.limit if others < _cores() / 2 else 1
