"""Engine configuration, resolved and validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from exspec.config import KV_MEMORY_DEFAULT  # noqa: F401  (re-exported: the engine's default, written once there)
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
    """Everything the engine needs to load a model pair and size its paged KV pools."""

    model: Path  # target model directory (from_pretrained)
    draft_model: Path | None = None  # draft model directory; None: no speculation
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "float32"  # one of DTYPES
    max_num_seqs: int = 64  # sequence slots (token buffer, sampling parameters, block table row): live sequences at most
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    max_num_speculative_tokens: int = 8  # largest k a step may use
    attn_implementation: str = "sdpa"  # "sdpa" or "eager"
    force_mixed: bool = False  # benchmarks only: every step through the mixed-length path, even equal lengths
    attention: str = "auto"  # "auto" or a backend in engine/backends/ (backends.names()): how attention reads the pools
    block_size: int = 16  # positions per KV block
    # KV pool size: a fraction (0, 1] of the memory free after the weights, or a byte count (int); None: the
    # device's default (KV_MEMORY_DEFAULT). Never more blocks than max_num_seqs sequences of max_model_len.
    kv_cache_memory: float | int | None = None
    gemm: str = "auto"  # "auto" | "packed" | "default": oneDNN-prepacked linears for multi-row CPU forwards
    # The draft's one-token forwards and the verify through compiled static-shape forwards (engine/static_forward.py).
    # Off by default on every device: on the CPU it is a capturability proof, not a speed-up; on CUDA it is not yet
    # measured (CUDA graph capture has never run on a GPU).
    compile: bool = False

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
        from exspec.engine import backends

        if self.attention != backends.AUTO and self.attention not in backends.names():
            raise ConfigError(f"attention must be {backends.AUTO} or one of {list(backends.names())}, got {self.attention!r}")
        if not 1 <= self.block_size <= 1024:
            raise ConfigError(f"block_size must be in [1, 1024], got {self.block_size}")
        mem = self.kv_cache_memory
        if mem is not None and not ((isinstance(mem, float) and 0 < mem <= 1) or (isinstance(mem, int) and mem > 0)):
            raise ConfigError(f"kv_cache_memory must be a fraction in (0, 1] or a byte count > 0, got {mem!r}")
        if self.gemm not in ("auto", "packed", "default"):
            raise ConfigError(f"gemm must be auto, packed or default, got {self.gemm!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}")
        if self.compile and self.attn_implementation == "eager":
            raise ConfigError("compile needs attn_implementation 'sdpa' (exspec's attention), not 'eager'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
