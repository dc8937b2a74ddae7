"""The HTTP connection: uvicorn's h11 protocol with a timeout for connections that send no complete request."""

from __future__ import annotations

import asyncio

from h11 import ConnectionClosed
from uvicorn.protocols.http.h11_impl import H11Protocol


class IdleTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection with no request in progress (idle before its first
    request, or still sending a request's headers) is closed after `timeout_keep_alive` seconds, however
    slowly bytes trickle in. (uvicorn's own keep-alive timer starts only after a response, and any byte
    resets it.) Slow bodies are the edge middleware's job (--body-read-timeout)."""

    _idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_idle_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_idle_timer()

    def connection_lost(self, exc) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        super().connection_lost(exc)

    def _arm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request's headers arrived: it is being served
        if not self.transport.is_closing():
            try:
                self.conn.send(ConnectionClosed())
            except Exception:  # h11 refuses in some states; the transport closes anyway
                pass
            self.transport.close()
