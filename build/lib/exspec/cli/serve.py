"""`exspec serve`: load a target/draft pair (the built-in demo pair by default) and serve it over HTTP.

Every flag can also come from its EXSPEC_* environment variable; a flag wins over the variable.
SIGTERM (or Ctrl+C) drains: new requests get 503, running ones finish within --shutdown-timeout (then
are aborted), and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import signal

from exspec.cli.flags import FLAGS, add_settings_arguments, resolve_models, settings_from_args
from exspec.config import Settings, resolve

logger = logging.getLogger("exspec.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, tuple(FLAGS))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, tuple(FLAGS))  # ConfigError: exit 2 with the message
    level = settings.log_level.upper()
    logging.basicConfig(level=logging.DEBUG if level == "TRACE" else level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(settings)
    server.run()
    return 0 if server.started else 1


def build_server(settings: Settings):
    """Load the pair, build the scheduler and the app; return a uvicorn.Server ready to run (its signal
    handling replaced by the drain, see _drain_on_signal)."""
    import uvicorn

    from exspec.engine import SpecEngine
    from exspec.scheduler import AsyncScheduler
    from exspec.server.app import build_app

    if settings.model is None:
        logger.info("no --model: serving the built-in demo pair (built on first use, then cached)")
    target, draft, name = resolve_models(settings)
    cfg = resolve(settings, target, draft)
    logger.info("loading target %s, draft %s on %s (%s)", target, cfg.engine.draft_model or "none (no speculation)",
                cfg.engine.device, cfg.engine.dtype)
    engine = SpecEngine(cfg.engine)
    scheduler = AsyncScheduler(engine, cfg.scheduler)
    app = build_app(scheduler, settings.model_copy(update={"served_model_name": name}))
    logger.info(
        "serving %r (k=%d %s, B=%d, W=%d, max_model_len=%d) on http://%s:%d/v1%s",
        app.state.model_name, cfg.engine.max_num_speculative_tokens if cfg.engine.draft_model else 0,
        cfg.scheduler.speculation, cfg.scheduler.max_batch_size, cfg.scheduler.pool_size, cfg.engine.max_model_len,
        settings.host, settings.port, " (API key required)" if settings.api_key else "",
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,  # after the drain; only slow readers are left by then
    )
    server = uvicorn.Server(config)
    _drain_on_signal(server, app.state.lifecycle)
    return server


def _drain_on_signal(server, lifecycle) -> None:
    """Replace uvicorn's signal handling: the first SIGTERM/SIGINT drains the scheduler (503 to new
    requests while running ones finish), then stops uvicorn; a second signal stops at once. (uvicorn's own
    handler would also re-raise the signal after serving, ending the process with -15 instead of 0.)"""
    signals = []

    def handle_exit(sig: int, frame) -> None:
        signals.append(sig)
        if len(signals) == 1:
            logger.info("got %s: draining", signal.Signals(sig).name)
            if lifecycle.drain_threadsafe(on_done=lambda: setattr(server, "should_exit", True)):
                return
        server.should_exit = True
        if len(signals) > 1 and sig == signal.SIGINT or len(signals) > 2:
            server.force_exit = True

    server.handle_exit = handle_exit
