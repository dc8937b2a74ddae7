"""Helpers for server tests: a real uvicorn serving `build_app` over tiny models, in a background thread
with its own event loop, on a port the OS picked."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    app: object
    scheduler: object  # scheduler.AsyncScheduler
    engine: object  # engine.SpecEngine
    server: object  # uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def model_name(self) -> str:
        return self.app.state.model_name

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no request runs or waits and every KV slot is free again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.scheduler
            if s.num_running == 0 and s.num_waiting == 0 and self.engine.allocator.num_used == 0:
                return True
            time.sleep(0.02)
        return False


@contextmanager
def serve_in_thread(app, startup_timeout: float = 60.0):
    """Run uvicorn on `app` (with exspec's connection handling, `make_server`) in a daemon thread; yield
    (base_url, uvicorn.Server, thread); stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    from exspec.server.lifecycle import make_server

    server = make_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def running_server(target: Path, draft: Path | None, *, max_model_len: int = 128, max_batch_size: int = 4,
                   pool_size: int = 8, max_waiting: int = 64, num_speculative_tokens: int = 3, **settings):
    """Load the pair into a SpecEngine, wrap it in an AsyncScheduler and serve it through build_app;
    `settings` are ServerConfig fields."""
    from exspec.engine import EngineConfig, SpecEngine
    from exspec.scheduler import AsyncScheduler, SchedulerConfig
    from exspec.server.app import build_app
    from exspec.server.config import ServerConfig

    engine = SpecEngine(
        EngineConfig(model=target, draft_model=draft, max_num_seqs=pool_size, max_model_len=max_model_len,
                     max_num_speculative_tokens=num_speculative_tokens)
    )
    scheduler = AsyncScheduler(
        engine,
        # A fixed k: these servers test speculation's paths and metrics, which `auto` (starting at k = 0) may skip.
        SchedulerConfig(max_batch_size=max_batch_size, pool_size=pool_size, max_waiting=max_waiting,
                        num_speculative_tokens=num_speculative_tokens, speculation="fixed"),
    )
    app = build_app(scheduler, ServerConfig(**settings))
    with serve_in_thread(app) as (base_url, server, thread):
        yield RunningServer(base_url, app, scheduler, engine, server, thread)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float = 120.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy")
