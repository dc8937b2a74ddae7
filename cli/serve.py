"""`exspec serve`: load a target/draft pair (the built-in demo pair by default) and serve it over HTTP.

Every flag can also come from its EXSPEC_* environment variable; a flag wins over the variable.
SIGTERM (or Ctrl+C) drains: new requests get 503, running ones finish within --shutdown-timeout (then
are aborted), and the process exits 0. A second signal ends every open stream with an error event and
[DONE] and exits 128 + the signal number (see exspec.server.lifecycle).
"""

from __future__ import annotations

import argparse
import logging

from exspec.cli.flags import FLAGS, add_settings_arguments, resolve_models, settings_from_args
from exspec.cli.settings import Settings, resolve

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
    return server.exit_status


def build_server(settings: Settings):
    """Load the pair, build the scheduler and the app; return a uvicorn.Server ready to run (signals: see
    exspec.server.lifecycle)."""
    from exspec.engine import SpecEngine
    from exspec.scheduler import AsyncScheduler
    from exspec.server.app import build_app
    from exspec.server.config import server_config
    from exspec.server.lifecycle import make_server

    if settings.model is None:
        logger.info("no --model: serving the built-in demo pair (built on first use, then cached)")
    target, draft, name = resolve_models(settings)
    cfg = resolve(settings, target, draft)
    logger.info("loading target %s, draft %s on %s (%s)", target, cfg.engine.drafter,
                cfg.engine.device, cfg.engine.dtype)
    engine = SpecEngine(cfg.engine)
    scheduler = AsyncScheduler(engine, cfg.scheduler)
    if settings.calibrate:
        _calibrate(scheduler, engine.tokenizer, cfg.scheduler.max_batch_size, cfg.engine.max_model_len)
    app = build_app(scheduler, server_config(settings, served_model_name=name))
    logger.info(
        "serving %r (k=%d %s, B=%d, W=%d, max_model_len=%d) on http://%s:%d/v1%s",
        app.state.model_name, cfg.engine.max_num_speculative_tokens if cfg.engine.speculates else 0,
        cfg.scheduler.speculation, cfg.scheduler.max_batch_size, cfg.scheduler.pool_size, cfg.engine.max_model_len,
        settings.host, settings.port, " (API key required)" if settings.api_key else "",
    )
    return make_server(app, settings.host, settings.port, settings.log_level)


def _calibrate(scheduler, tokenizer, rows: int, max_model_len: int) -> None:
    """The speculation policy's calibration steps on the first SpecBench questions (`exspec.data.calibration_prompts`).
    A failure costs only the calibration: the policy then starts unmeasured."""
    import time

    from exspec.data import calibration_prompts

    t0 = time.perf_counter()
    try:
        prompts = calibration_prompts(tokenizer, rows, max_model_len)
        best = scheduler.calibrate(prompts)
    except Exception:
        logger.warning("calibrating the speculation policy failed; it starts unmeasured", exc_info=True)
        return
    if best:
        logger.info("calibrated the speculation policy in %.1f s: k %s at batch sizes %s", time.perf_counter() - t0,
                    "/".join(map(str, best.values())), "/".join(map(str, best)))
