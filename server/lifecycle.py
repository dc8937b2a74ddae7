"""Start, drain and stop: the scheduler's lifetime under the app, and what SIGTERM / SIGINT do.

- First signal: drain. New requests get 503 (Retry-After), running and queued ones finish within
  `shutdown_timeout` seconds (then are aborted), then the server stops. Exit status 0.
- Second signal: stop now, cleanly. Every open stream gets a final error event and `data: [DONE]`,
  every non-streamed request waiting for its answer gets a 503, every request is aborted; the server
  stops as soon as those answers are written (at most `KILL_FLUSH_S`). Exit status 128 + the signal's
  number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process ended by that signal.
- Third signal: uvicorn's force exit (no more waiting for connections).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

from exspec.server.connection import IdleTimeoutH11Protocol

logger = logging.getLogger("exspec.server")

KILL_FLUSH_S = 2.0  # after a second signal: how long open streams get to write their final events


class ServerKilled(Exception):
    """Raised into a request's handling when a second signal stops the server."""


class Lifecycle:
    """Starts the scheduler with the app and drains it exactly once, whoever asks first (a signal or the
    ASGI lifespan's shutdown); `kill()` ends every open request at once."""

    def __init__(self, scheduler, timeout: float) -> None:
        self.scheduler = scheduler
        self.timeout = timeout
        self._drain: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.killed: asyncio.Event | None = None  # set by kill(); created on the loop
        self.open_requests = 0  # generation requests being answered (streams and non-streamed)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.killed = asyncio.Event()
        await self.scheduler.start()

    # ----------------------------------------------------------------- drain (first signal)

    def drain_threadsafe(self, on_done: Callable[[], None]) -> bool:
        """From a signal handler or another thread: begin draining, call on_done() on the loop when done.
        False if the app has not started (nothing to drain)."""
        return self._call_threadsafe(lambda: self.begin_drain().add_done_callback(lambda _: on_done()))

    def begin_drain(self) -> asyncio.Task:
        """Stop admitting (new requests get 503), let running ones finish within the timeout, then abort
        them. Call on the event loop; returns the drain's task (the same one on every call)."""
        if self._drain is None:
            logger.info("draining: no new requests; running ones get %.0f s to finish", self.timeout)
            self._drain = asyncio.get_running_loop().create_task(self.scheduler.shutdown(self.timeout))
        return self._drain

    async def drain(self) -> None:
        """The lifespan's shutdown: drain (after a kill, wait for the drain only KILL_FLUSH_S more)."""
        task = asyncio.shield(self.begin_drain())
        if self.killed is not None and self.killed.is_set():
            try:
                await asyncio.wait_for(task, KILL_FLUSH_S)
            except TimeoutError:
                logger.warning("the scheduler did not stop within %.0f s of the second signal", KILL_FLUSH_S)
            return
        await task

    # ----------------------------------------------------------------- kill (second signal)

    def kill_threadsafe(self, on_done: Callable[[], None]) -> bool:
        """From a signal handler: end every open request now (final error event + [DONE] for streams),
        then call on_done() on the loop once they are answered (or after KILL_FLUSH_S)."""
        return self._call_threadsafe(lambda: self._loop.create_task(self._kill(on_done)))

    async def _kill(self, on_done: Callable[[], None]) -> None:
        logger.warning("second signal: ending %d open request(s) now", self.open_requests)
        self.begin_drain()
        self.killed.set()
        deadline = self._loop.time() + KILL_FLUSH_S
        while self.open_requests and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        on_done()

    def _call_threadsafe(self, fn: Callable[[], object]) -> bool:
        if self._loop is None or self._loop.is_closed():
            return False
        self._loop.call_soon_threadsafe(fn)
        return True

    # ----------------------------------------------------------------- for request handlers

    async def until_killed(self, source: AsyncIterator) -> AsyncIterator:
        """`source`'s items until it ends, or ServerKilled as soon as the server is killed. Closes `source`
        however it ends. When the consumer is cancelled (a client disconnect) while a read of `source` is
        pending, that read is cancelled and `source` is closed once it has left its await: closing it under
        the pending read would fail ('asynchronous generator is already running')."""
        killed = asyncio.ensure_future(self.killed.wait())
        step = None
        try:
            while True:
                step = asyncio.ensure_future(anext(source))
                await asyncio.wait({step, killed}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()  # and wait until `source` has left its await: then it can be closed
                    await asyncio.wait({step})
                    raise ServerKilled()
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            killed.cancel()
            if step is not None and not step.done():
                step.cancel()
                step.add_done_callback(lambda t: _close_soon(source, t))
            else:
                await source.aclose()


_closing: set[asyncio.Task] = set()  # closes scheduled by until_killed, referenced until done


def _close_soon(source, read: asyncio.Future) -> None:
    """After the cancelled `read` of `source` is done: close `source` from a task of its own (nothing awaits
    it; errors are logged, not raised)."""
    if not read.cancelled():
        read.exception()  # retrieved: the read ended on its own (an item, the end, an error) before the cancel
    task = asyncio.ensure_future(source.aclose())
    _closing.add(task)

    def done(t: asyncio.Task) -> None:
        _closing.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.warning("closing a stream's deltas failed: %r", t.exception())

    task.add_done_callback(done)


def make_server(app, host: str, port: int, log_level: str = "info"):
    """A uvicorn server for an app from `build_app`, with exspec's connection timeouts and signal handling
    (see the module docstring). Run it with `.run()`; then `.exit_status` is the process's exit status."""
    import uvicorn

    class ExspecServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
            super().__init__(config)
            self.lifecycle = lifecycle
            self.signals: list[int] = []

        def handle_exit(self, sig: int, frame) -> None:
            # uvicorn's handler would re-raise the signal after serving (exit -15 instead of 0): not kept.
            self.signals.append(sig)
            name = signal.Signals(sig).name
            stop = lambda: setattr(self, "should_exit", True)  # noqa: E731
            if len(self.signals) == 1:
                logger.info("got %s: draining (a second signal stops at once)", name)
                if self.lifecycle.drain_threadsafe(on_done=stop):
                    return
            elif len(self.signals) == 2:
                logger.warning("got %s again: ending every open request now", name)
                if self.lifecycle.kill_threadsafe(on_done=stop):
                    return
            else:
                self.force_exit = True
            self.should_exit = True

        @property
        def exit_status(self) -> int:
            if not self.started:
                return 1
            return 128 + self.signals[1] if len(self.signals) >= 2 else 0

    cfg = app.state.config
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        http=IdleTimeoutH11Protocol,
        timeout_keep_alive=cfg.keep_alive_timeout,
        timeout_graceful_shutdown=5,  # after the drain; only slow readers are left by then
    )
    return ExspecServer(config, app.state.lifecycle)
