"""Explicit control over when an engine step may run, so tests never race generation against the clock.

In-process servers: `gated(engine.step, event)` blocks every step until the test sets the event.
Server processes: `python -m tests.support.gated_serve HOLD_FILE <exspec args>` runs the ordinary CLI with
every speculative step held while HOLD_FILE exists (test code only; exspec itself has no hook).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path


def gated(fn: Callable, gate: threading.Event, timeout: float = 120.0) -> Callable:
    """`fn`, but each call first waits until `gate` is set (a test that forgets to open it fails loudly)."""

    def call(*args, **kwargs):
        if not gate.wait(timeout):
            raise RuntimeError("the test never opened the engine's gate")
        return fn(*args, **kwargs)

    return call


def signalling(fn: Callable, event: threading.Event) -> Callable:
    """`fn`, setting `event` after each call returns (to wait until something was asked, not for a time)."""

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            event.set()

    return call


def held_while_exists(fn: Callable, hold: Path, timeout: float = 120.0) -> Callable:
    """`fn`, but each call first waits while the file `hold` exists (a gate across processes)."""

    def call(*args, **kwargs):
        deadline = time.monotonic() + timeout
        while hold.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test never removed {hold}")
            time.sleep(0.005)
        return fn(*args, **kwargs)

    return call


def decode_held_while_exists(step: Callable, hold: Path, timeout: float = 300.0) -> Callable:
    """`SchedulerCore.step`, but while the file `hold` exists (a gate across processes) no decode step runs: a
    call prefills if a prompt waits, else does nothing for 5 ms (the loop calls again). Every request sent while
    held gets its prompt's token and no more, however fast or slow the machine, until the file is removed."""

    def call(self):
        if not hold.exists():
            self._test_held_since = None
            return step(self)
        held_since = getattr(self, "_test_held_since", None) or time.monotonic()
        if time.monotonic() - held_since > timeout:
            raise RuntimeError(f"the test never removed {hold}")
        self._test_held_since = held_since
        self._prefill_credit = max(self._prefill_credit, 0.0)  # a waiting prompt is prefilled at once

        def skip(running, t0):
            time.sleep(0.005)
            return [], []

        self._decode_step = skip
        try:
            return step(self)
        finally:
            del self._decode_step  # the class's method again

    return call


def wait_until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `cond` with a generous deadline: only for states that nothing announces (a log line, a counter)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
