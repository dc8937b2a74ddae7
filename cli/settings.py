"""The command line's settings, resolved once: `Settings` (flags and `EXSPEC_*` variables, pydantic at the edge)
and `resolve`, which derives the engine's and the scheduler's frozen configs from them and from the models' own
configs. `exspec serve`, `exspec generate`, `exspec bench` and `exspec demo-models` all go through here, so they
share every flag, variable and check. Defaults and ranges are written once, in the layer that owns them (the
engine's limits in exspec.engine.config, the scheduler's defaults in SchedulerConfig, the demo pairs in
exspec.demo.recipe), and read from there.

Kept free of torch at import time (so are the modules it reads them from), so that `exspec --help` stays fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from exspec.demo.recipe import DEFAULT_DEMO, DEMO_PAIRS, DEMO_SPECULATIVE_METHOD
from exspec.engine.config import (
    COMPILE_MODES, DEFAULT_MAX_MODEL_LEN, GEMM_MODES, MAX_SPECULATIVE_TOKENS, PROMPT_LOOKUP_LIMIT, PROMPT_LOOKUP_MAX,
    PROMPT_LOOKUP_MIN, SPECULATIVE_METHODS, position_limit_of,
)
from exspec.engine.config import DTYPES as ENGINE_DTYPES
from exspec.scheduler.types import SchedulerConfig, default_pool_size
from exspec.server.config import INT64_MAX, ServerConfig

from exspec.errors import ConfigError
from exspec.registry import listed

if TYPE_CHECKING:
    from exspec.engine.config import EngineConfig

DTYPES = ("auto", *ENGINE_DTYPES)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SPECULATION_MODES = listed("exspec.scheduler.policies")  # scheduler/policies/, read without importing torch
DEFAULT_SPECULATION = SchedulerConfig.speculation  # the scheduler's own default: k from modelled goodput


class Settings(BaseSettings):
    """Everything a command may be told. Field `x_y` is flag `--x-y` and variable `EXSPEC_X_Y` (a flag wins)."""

    model_config = SettingsConfigDict(env_prefix="EXSPEC_", env_ignore_empty=True, extra="ignore")

    # the model pair
    model: Path | None = None  # target model directory or .gguf file; None: the built-in demo pair
    draft_model: Path | None = None  # draft model directory or .gguf file; None with --model: plain decoding
    served_model_name: str | None = None  # default: the target directory's name ("exspec-demo" for the demo)
    demo: str = DEFAULT_DEMO  # which built-in demo pair serves without --model: smollm2 | tiny
    # the engine
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) or one of DTYPES
    max_model_len: int | None = Field(default=None, ge=2)  # default: the smaller position limit of the two models
    num_speculative_tokens: int = Field(  # k (the largest k under an adaptive policy)
        default=SchedulerConfig.num_speculative_tokens, ge=0, le=MAX_SPECULATIVE_TOKENS)
    attention_backend: str = "auto"  # auto or one of attention_backends(): how attention reads the KV blocks
    kv_cache_memory: str | None = None  # KV pool: a fraction of the memory free after the weights, or bytes ("4GiB")
    gemm: str = "auto"  # auto | packed | unpadded | default: oneDNN-prepacked linears for CPU forwards
    # draft and verify forwards compiled at static shapes (engine/static_forward.py); off everywhere until measured
    compile: bool = False
    compile_mode: str = "inductor"  # how --compile does it: one of engine/config.py COMPILE_MODES
    # where drafts come from: "draft" (the draft model) or "ngram" (lookup in each sequence's tokens, no draft model);
    # None: the demo pair's own default without --model (DEMO_SPECULATIVE_METHOD), else "draft" (resolved_...)
    speculative_method: str | None = None
    prompt_lookup_max: int = Field(default=PROMPT_LOOKUP_MAX, ge=1, le=PROMPT_LOOKUP_LIMIT)  # ngram: longest suffix
    prompt_lookup_min: int = Field(default=PROMPT_LOOKUP_MIN, ge=1, le=PROMPT_LOOKUP_LIMIT)  # ngram: shortest
    # the scheduler
    speculation: str = DEFAULT_SPECULATION
    calibrate: bool = True  # serve: the policy's calibration steps before serving (SchedulerCore.calibrate)
    max_batch_size: int = Field(default=SchedulerConfig.max_batch_size, ge=1, le=4096)  # B: sequences per step
    pool_size: int | None = Field(default=None, ge=1, le=65536)  # W: live sequences (KV slots); default_pool_size(B)
    max_waiting: int = Field(default=SchedulerConfig.max_waiting, ge=1)  # queued beyond this: the server's 429
    # tokens (rows x width, padding included) of one prefill step at most; longer prompts are chunked
    max_prefill_tokens: int = Field(default=SchedulerConfig.max_prefill_tokens, ge=1, le=1 << 20)
    # the server
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    shutdown_timeout: float = Field(default=ServerConfig.shutdown_timeout, ge=0)  # seconds to finish on SIGTERM
    log_level: str = "info"
    # the server's limits (exspec.server.config.ServerConfig; docs/SERVER.md lists them all)
    max_body_bytes: int = Field(default=ServerConfig.max_body_bytes, ge=1, le=INT64_MAX)  # larger bodies: 413
    body_read_timeout: float = Field(default=ServerConfig.body_read_timeout, gt=0)  # else 408
    keep_alive_timeout: float = Field(default=ServerConfig.keep_alive_timeout, gt=0)  # idle: closed
    max_n: int = Field(default=ServerConfig.max_n, ge=1, le=INT64_MAX)  # choices per request (n, best_of)
    max_prompts: int = Field(default=ServerConfig.max_prompts, ge=1, le=INT64_MAX)  # per completions request
    max_prompt_chars: int = Field(default=ServerConfig.max_prompt_chars, ge=1, le=INT64_MAX)  # per prompt
    max_messages: int = Field(default=ServerConfig.max_messages, ge=1, le=INT64_MAX)  # messages per chat request
    max_stop: int = Field(default=ServerConfig.max_stop, ge=1, le=INT64_MAX)  # stop strings per request
    max_stop_chars: int = Field(default=ServerConfig.max_stop_chars, ge=1, le=INT64_MAX)  # characters per stop string
    max_stop_token_ids: int = Field(default=ServerConfig.max_stop_token_ids, ge=0, le=INT64_MAX)
    max_logit_bias: int = Field(default=ServerConfig.max_logit_bias, ge=0, le=INT64_MAX)  # entries per request

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_cache_memory(cls, value: str | None) -> str | None:
        parse_kv_cache_memory(value)
        return value

    @field_validator("device", "dtype", "attention_backend", "gemm", "compile_mode", "speculation", "log_level",
                     "demo", "speculative_method")
    @classmethod
    def _one_of(cls, value: str, info: ValidationInfo) -> str:
        """A named choice; the error names the flag and its variable (load_settings), and the choices."""
        field = info.field_name
        if value is None and field == "speculative_method":
            return value
        if field == "device":
            if not (value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())):
                raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        elif field == "attention_backend":
            if value != "auto" and value not in attention_backends():
                raise ValueError(f"attention_backend must be auto or one of {', '.join(attention_backends())}, "
                                 f"got {value!r}")
        else:
            choices = {"dtype": DTYPES, "gemm": GEMM_MODES, "compile_mode": COMPILE_MODES,
                       "speculation": SPECULATION_MODES, "demo": DEMO_PAIRS, "log_level": LOG_LEVELS,
                       "speculative_method": SPECULATIVE_METHODS}[field]
            if (value.lower() if field == "log_level" else value) not in choices:
                raise ValueError(f"{field} must be one of {', '.join(choices)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.pool_size is not None and self.pool_size < self.max_batch_size:
            raise ValueError(f"pool_size must be >= max_batch_size ({self.max_batch_size}), got {self.pool_size}")
        most = SchedulerConfig.max_wait_steps * self.max_batch_size  # the aging bound (scheduler/policy.py)
        if self.resolved_pool_size > most:
            raise ValueError(f"pool_size must be <= max_batch_size x {SchedulerConfig.max_wait_steps} = {most} (no running "
                             f"sequence waits more than {SchedulerConfig.max_wait_steps} decode steps), got "
                             f"{self.resolved_pool_size}")
        if self.draft_model is not None and self.model is None:
            raise ValueError("draft_model needs model (without --model the built-in demo pair is used)")
        if self.resolved_speculative_method == "ngram" and self.draft_model is not None:
            raise ValueError("speculative_method ngram drafts without a draft model: drop draft_model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    @property
    def resolved_kv_cache_memory(self) -> float | int | None:
        return parse_kv_cache_memory(self.kv_cache_memory)

    @property
    def resolved_speculative_method(self) -> str:
        """As given; else the built-in demo pair's default (without --model), else "draft"."""
        if self.speculative_method is not None:
            return self.speculative_method
        return DEMO_SPECULATIVE_METHOD.get(self.demo, "draft") if self.model is None else "draft"

    @property
    def resolved_pool_size(self) -> int:
        return self.pool_size if self.pool_size is not None else default_pool_size(self.max_batch_size)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_kv_cache_memory(value: str | None) -> float | int | None:
    """`--kv-cache-memory`: a fraction in (0, 1] of the memory free once the weights are loaded ("0.5"), or a
    byte count with an optional unit ("4GiB", "512MB", "1000000"). None: the engine's device default."""
    if value is None:
        return None
    text = str(value).strip()
    bad = f"kv_cache_memory must be a fraction in (0, 1] (with a decimal point) or a byte size like 4GiB, got {value!r}"
    if "." in text:
        try:
            fraction = float(text)
        except ValueError:
            raise ValueError(bad) from None
        if not 0 < fraction <= 1:
            raise ValueError(bad)
        return fraction
    match = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text)
    if match is None or match.group(2).lower() not in _UNITS or int(match.group(1)) == 0:
        raise ValueError(bad)
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def attention_backends() -> tuple[str, ...]:
    """The attention backends: engine/backends/, one file per backend named as it, listed without importing the
    engine (torch), so that `--help` stays fast. The registry checks that each file registers its own name."""
    return listed("exspec.engine.backends")


def load_settings(given: dict) -> Settings:
    """Flags (`given`, absent ones left out) over EXSPEC_* variables over defaults. Raises ConfigError with a
    message naming each bad flag and its variable."""
    try:
        return Settings(**given)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = [str(x) for x in err.get("loc", ())]
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            if loc:
                field = loc[0]
                lines.append(f"--{field.replace('_', '-')} / EXSPEC_{field.upper()}: {msg} (got {err.get('input')!r})")
            else:
                lines.append(msg)
        raise ConfigError("invalid settings:\n  " + "\n  ".join(lines)) from None


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig
    scheduler: SchedulerConfig
    position_limit: int | None  # the smaller position limit the two models declare, if any


def position_limit(model_dir: Path | None) -> int | None:
    """The number of positions a model's config.json declares (learned or trained), or None."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader reports a missing or broken config clearly
    return position_limit_of(cfg.get("text_config", cfg))


def resolve_device(device: str, dtype: str) -> tuple[str, str]:
    """`auto` device: cuda when torch sees one; `auto` dtype: bfloat16 on cuda, float32 on cpu."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def resolve(
    settings: Settings,
    target: Path,
    draft: Path | None,
    *,
    max_waiting: int | None = None,
) -> ResolvedConfig:
    """The engine's and the scheduler's configs for this pair. A .gguf target or draft (or a directory holding
    one) is converted to a Hugging Face directory first (engine/gguf.py; cached). max_model_len defaults to the
    smaller position limit of the target and the draft; a larger value is an error naming the limit. k = 0 drops
    the draft, and so does speculative_method ngram (the built-in demo pair's: lookup needs no draft model)."""
    from exspec.engine.config import EngineConfig
    from exspec.engine.gguf import resolve_model_path

    k = settings.num_speculative_tokens
    method = settings.resolved_speculative_method
    if k == 0 or method == "ngram":
        draft = None
    # a .gguf file (or a directory holding one) becomes its converted Hugging Face directory, once, here
    target = resolve_model_path(Path(target))
    draft = resolve_model_path(Path(draft)) if draft is not None else None
    limits = {role: position_limit(d) for role, d in (("target", target), ("draft", draft)) if d is not None}
    known = {role: n for role, n in limits.items() if n is not None}
    limit = min(known.values()) if known else None
    max_len = settings.max_model_len
    if max_len is None:
        max_len = limit if limit is not None else DEFAULT_MAX_MODEL_LEN
    elif limit is not None and max_len > limit:
        which = ", ".join(f"{role} {n}" for role, n in known.items())
        raise ConfigError(f"max_model_len {max_len} exceeds the models' position limit {limit} ({which}): lower it")
    device, dtype = resolve_device(settings.device, settings.dtype)
    pool = settings.resolved_pool_size
    engine = EngineConfig(
        model=Path(target),
        draft_model=Path(draft) if draft is not None else None,
        device=device,
        dtype=dtype,
        max_num_seqs=pool,
        max_model_len=max_len,
        max_num_speculative_tokens=k,
        attention=settings.attention_backend,
        gemm=settings.gemm,
        compile=settings.compile,
        compile_mode=settings.compile_mode,
        kv_cache_memory=settings.resolved_kv_cache_memory,
        speculative_method=method,
        prompt_lookup_max=settings.prompt_lookup_max,
        prompt_lookup_min=settings.prompt_lookup_min,
    )
    scheduler = SchedulerConfig(
        max_batch_size=settings.max_batch_size,
        pool_size=pool,
        max_waiting=max_waiting if max_waiting is not None else settings.max_waiting,
        max_prefill_tokens=settings.max_prefill_tokens,
        num_speculative_tokens=k,
        speculation=settings.speculation,
    )
    return ResolvedConfig(engine=engine, scheduler=scheduler, position_limit=limit)
