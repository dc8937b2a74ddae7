"""`exspec serve`: load a target/draft pair (the built-in demo pair by default) and serve it over HTTP.

Every flag can also come from its EXSPEC_* environment variable; a flag wins over the variable.
SIGTERM (or Ctrl+C) drains: new requests get 503, running ones finish within --shutdown-timeout (then
are aborted), and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from exspec.server.settings import DTYPES, ServeSettings

logger = logging.getLogger("exspec.server")

# settings field -> (metavar, help); the flag is --field-with-dashes, the variable EXSPEC_FIELD_UPPER
FLAGS = {
    "model": ("DIR", "target model directory (Hugging Face format); default: the built-in demo pair"),
    "draft_model": ("DIR", "draft model directory; with --model and no draft, decoding is plain (no speculation)"),
    "served_model_name": ("NAME", "model name clients pass; default: the target directory's name "
                                  "('exspec-demo' for the demo pair)"),
    "host": ("HOST", "address to listen on (default 127.0.0.1)"),
    "port": ("PORT", "port to listen on (default 8000)"),
    "num_speculative_tokens": ("K", "draft tokens per step (the largest k with --speculation adaptive; default 4)"),
    "max_batch_size": ("B", "sequences per speculative step (default 8)"),
    "pool_size": ("W", "live sequences (KV slots) the pool holds, W >= B (default 4 x B)"),
    "max_waiting": ("N", "requests queued beyond the pool before the server answers 429 (default 256)"),
    "max_model_len": ("L", "prompt + generated tokens per sequence (default min(2048, the model's limit))"),
    "device": ("DEVICE", "auto | cpu | cuda | cuda:N (default auto: cuda when available)"),
    "dtype": ("DTYPE", f"one of {', '.join(DTYPES)} (default auto: bfloat16 on CUDA, float32 on CPU)"),
    "api_key": ("KEY", "require 'Authorization: Bearer KEY' on /v1/* (default: no key)"),
    "speculation": ("MODE", "fixed | adaptive: how k is chosen per step (default fixed)"),
    "shutdown_timeout": ("SECONDS", "on SIGTERM, how long running requests get to finish before they are aborted "
                                    "(default 30)"),
    "log_level": ("LEVEL", "critical | error | warning | info | debug (default info)"),
}


class SettingsError(Exception):
    """Flags or EXSPEC_* variables are invalid (exit status 2). Not an ExspecError: that would import torch."""


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for field, (metavar, help_text) in FLAGS.items():
        env = "EXSPEC_" + field.upper()
        # No defaults here: an absent flag leaves the field to its environment variable, then the default.
        parser.add_argument(_flag(field), dest=field, default=None, metavar=metavar, help=f"{help_text} [env {env}]")


def load_settings(args: argparse.Namespace) -> ServeSettings:
    """Flags over EXSPEC_* variables over defaults. Raises SettingsError with a CLI-ready message."""
    from pydantic import ValidationError

    given = {f: getattr(args, f) for f in FLAGS if getattr(args, f, None) is not None}
    try:
        return ServeSettings(**given)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = [str(x) for x in err.get("loc", ())]
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            if loc:
                field = loc[0]
                lines.append(f"{_flag(field)} / EXSPEC_{field.upper()}: {msg} (got {err.get('input')!r})")
            else:
                lines.append(msg)
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None


def _model_position_limit(model_dir: Path) -> int | None:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader reports a missing or broken config clearly
    cfg = cfg.get("text_config", cfg)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args)
    except SettingsError as e:
        print(f"exspec serve: error: {e}", file=sys.stderr)
        return 2
    level = settings.log_level.upper()
    logging.basicConfig(level=logging.DEBUG if level == "TRACE" else level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(settings)
    server.run()
    return 0 if server.started else 1


def build_server(settings: ServeSettings):
    """Load the pair, build the scheduler and the app; return a uvicorn.Server ready to run (its signal
    handling replaced by the drain, see _drain_on_signal)."""
    import torch
    import uvicorn

    from exspec.engine import EngineConfig, ExspecError, SpecEngine
    from exspec.scheduler import AsyncScheduler, SchedulerConfig
    from exspec.server.app import build_app

    target, draft, name = settings.model, settings.draft_model, settings.served_model_name
    if target is None:
        from exspec.demo import ensure_demo_pair

        logger.info("no --model: serving the built-in demo pair (built on first use, then cached)")
        target, draft = ensure_demo_pair(progress=True)
        name = name or "exspec-demo"
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    limit = _model_position_limit(Path(target))
    max_len = settings.max_model_len
    if max_len is None:
        # Leave room for a verify step's k + 1 positions past the last token.
        max_len = min(2048, limit - settings.num_speculative_tokens - 1) if limit else 2048
    elif limit is not None and max_len > limit:
        raise ExspecError(f"--max-model-len {max_len} exceeds the model's position limit ({limit}) in {target}")
    engine_config = EngineConfig(
        model=Path(target),
        draft_model=Path(draft) if draft is not None else None,
        device=device,
        dtype=dtype,
        max_num_seqs=settings.resolved_pool_size,
        max_model_len=max_len,
        max_num_speculative_tokens=settings.num_speculative_tokens,
    )
    scheduler_config = SchedulerConfig(
        max_batch_size=settings.max_batch_size,
        pool_size=settings.resolved_pool_size,
        max_waiting=settings.max_waiting,
        num_speculative_tokens=settings.num_speculative_tokens,
        speculation=settings.speculation,
    )
    logger.info("loading target %s, draft %s on %s (%s)", target, draft or "none (no speculation)", device, dtype)
    engine = SpecEngine(engine_config)
    scheduler = AsyncScheduler(engine, scheduler_config)
    app = build_app(scheduler, settings.model_copy(update={"served_model_name": name}))
    logger.info(
        "serving %r (k=%d %s, B=%d, W=%d, max_model_len=%d) on http://%s:%d/v1%s",
        app.state.model_name, settings.num_speculative_tokens if draft else 0, settings.speculation,
        settings.max_batch_size, settings.resolved_pool_size, max_len, settings.host, settings.port,
        " (API key required)" if settings.api_key else "",
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
