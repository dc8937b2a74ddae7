"""`exspec serve` settings: each from a flag or an `EXSPEC_*` environment variable (flags win), validated once.

Kept free of torch so that `exspec --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

INT64_MAX = 2**63 - 1
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


class ServeSettings(BaseSettings):
    """What `exspec serve` runs. Field `x_y` is flag `--x-y` and variable `EXSPEC_X_Y`."""

    model_config = SettingsConfigDict(env_prefix="EXSPEC_", env_ignore_empty=True, extra="ignore")

    model: Path | None = None  # target model directory; None: the built-in demo pair
    draft_model: Path | None = None  # draft model directory; None with --model: plain decoding
    served_model_name: str | None = None  # default: the target directory's name ("exspec-demo" for the demo)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    num_speculative_tokens: int = Field(default=4, ge=0, le=32)  # k (the largest k with adaptive speculation)
    max_batch_size: int = Field(default=8, ge=1)  # B: sequences per speculative step
    pool_size: int | None = Field(default=None, ge=1)  # W: live sequences (KV slots); default 4 x B
    max_waiting: int = Field(default=256, ge=1)  # queued requests beyond which the server answers 429
    max_model_len: int | None = Field(default=None, ge=2)  # default: min(2048, the model's position limit)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) or one of DTYPES
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    speculation: str = "fixed"  # fixed | adaptive
    shutdown_timeout: float = Field(default=30.0, ge=0)  # seconds running requests get to finish on SIGTERM
    # Limits of the HTTP server (server/config.py ServerConfig; docs/SERVER.md lists them all).
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1, le=INT64_MAX)  # larger bodies: 413
    body_read_timeout: float = Field(default=30.0, gt=0)  # seconds to send a whole body, else 408
    keep_alive_timeout: float = Field(default=5.0, gt=0)  # idle connection (or unfinished headers): closed
    max_n: int = Field(default=16, ge=1, le=INT64_MAX)  # choices per request (n, best_of)
    max_prompts: int = Field(default=64, ge=1, le=INT64_MAX)  # prompts in one completions request
    max_prompt_chars: int = Field(default=1_000_000, ge=1, le=INT64_MAX)  # per prompt / per chat request
    max_messages: int = Field(default=1024, ge=1, le=INT64_MAX)  # messages per chat request
    max_stop: int = Field(default=16, ge=1, le=INT64_MAX)  # stop strings per request
    max_stop_chars: int = Field(default=1024, ge=1, le=INT64_MAX)  # characters per stop string
    max_stop_token_ids: int = Field(default=256, ge=0, le=INT64_MAX)  # stop_token_ids per request
    log_level: str = "info"

    @model_validator(mode="after")
    def _check(self) -> ServeSettings:
        if self.pool_size is not None and self.pool_size < self.max_batch_size:
            raise ValueError(f"pool_size must be >= max_batch_size ({self.max_batch_size}), got {self.pool_size}")
        cuda_n = self.device.startswith("cuda:") and self.device[5:].isdigit()
        if not (self.device in ("auto", "cpu", "cuda") or cuda_n):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.speculation not in ("fixed", "adaptive"):
            raise ValueError(f"speculation must be fixed or adaptive, got {self.speculation!r}")
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(
                f"log_level must be critical, error, warning, info, debug or trace, got {self.log_level!r}"
            )
        if self.draft_model is not None and self.model is None:
            raise ValueError("draft_model needs model (without --model the built-in demo pair is served)")
        return self

    @property
    def resolved_pool_size(self) -> int:
        return self.pool_size if self.pool_size is not None else 4 * self.max_batch_size
