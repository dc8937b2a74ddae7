"""What the HTTP server needs, resolved once from `exspec.cli.settings.Settings`: names, the API key, the shutdown and
connection timeouts, and every limit a request is held to. A frozen dataclass: nothing changes it later."""

from __future__ import annotations

from dataclasses import dataclass

INT64_MAX = 2**63 - 1  # the largest integer the engine's tensors hold


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None  # None: the scheduler's model_name
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    shutdown_timeout: float = 30.0  # seconds running requests get to finish after the first SIGTERM/SIGINT
    # --- connections
    max_body_bytes: int = 2 * 1024 * 1024  # request bodies above this are answered 413
    body_read_timeout: float = 30.0  # seconds a client may take to send its whole body (else 408)
    keep_alive_timeout: float = 5.0  # seconds an idle connection (or one sending no full request) stays open
    # --- request fields
    max_n: int = 16  # choices per request (n, best_of)
    max_prompts: int = 64  # prompts in one /v1/completions request (a list of prompts)
    max_prompt_chars: int = 1_000_000  # characters per prompt string, and per chat request over all messages
    max_messages: int = 1024  # messages per chat request
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 1024  # characters per stop string
    max_stop_token_ids: int = 256  # stop_token_ids per request
    max_logit_bias: int = 300  # logit_bias entries per request
    retry_after_s: int = 1  # Retry-After sent with 429 (queue full)
    retry_after_unavailable_s: int = 5  # Retry-After sent with 503 (shutting down, step loop dead)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str, value: object) -> None:
            raise ValueError(f"{name} must be {rule}, got {value!r}")

        if self.shutdown_timeout < 0:
            bad("shutdown_timeout", ">= 0", self.shutdown_timeout)
        for name in ("body_read_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                bad(name, "> 0", getattr(self, name))
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_prompt_chars", "max_messages", "max_stop",
                     "max_stop_chars", "retry_after_s", "retry_after_unavailable_s"):
            if not 1 <= getattr(self, name) <= INT64_MAX:
                bad(name, f"in [1, {INT64_MAX}]", getattr(self, name))
        for name in ("max_stop_token_ids", "max_logit_bias"):
            if not 0 <= getattr(self, name) <= INT64_MAX:
                bad(name, f"in [0, {INT64_MAX}]", getattr(self, name))


# ServerConfig fields that are also exspec.cli.settings.Settings fields (same name, same meaning).
SETTINGS_FIELDS = (
    "served_model_name", "api_key", "shutdown_timeout", "max_body_bytes", "body_read_timeout",
    "keep_alive_timeout", "max_n", "max_prompts", "max_prompt_chars", "max_messages", "max_stop",
    "max_stop_chars", "max_stop_token_ids", "max_logit_bias",
)


def server_config(settings, **overrides) -> ServerConfig:
    """`exspec.cli.settings.Settings` (or anything with those attributes) -> ServerConfig; `overrides` win."""
    values = {name: getattr(settings, name) for name in SETTINGS_FIELDS if hasattr(settings, name)}
    values.update(overrides)
    return ServerConfig(**values)
