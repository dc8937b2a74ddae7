"""Engine configuration, resolved and validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from exspec.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model pair and size its KV slot pools."""

    model: Path  # target model directory (from_pretrained)
    draft_model: Path | None = None  # draft model directory; None: no speculation
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "float32"  # one of DTYPES
    max_num_seqs: int = 64  # KV slots per model: the most live sequences at once
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    max_num_speculative_tokens: int = 8  # largest k a step may use (sizes the pool's slack)
    attn_implementation: str = "sdpa"  # "sdpa" or "eager"
    force_mixed: bool = False  # benchmarks only: every step through the mixed-length path, even equal lengths
    attention: str = "auto"  # "auto" | "pool" | "gather" | "flash": how attention reads the slot pools (runner.py)
    gemm: str = "auto"  # "auto" | "packed" | "default": oneDNN-prepacked linears for multi-row CPU forwards

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} asked for, but torch sees no CUDA device")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.max_num_speculative_tokens <= 32:
            raise ConfigError(
                f"max_num_speculative_tokens must be in [0, 32], got {self.max_num_speculative_tokens}"
            )
        if self.attention not in ("auto", "pool", "gather", "flash"):
            raise ConfigError(f"attention must be auto, pool, gather or flash, got {self.attention!r}")
        if self.gemm not in ("auto", "packed", "default"):
            raise ConfigError(f"gemm must be auto, packed or default, got {self.gemm!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
