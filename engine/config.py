"""Engine configuration, resolved and validated once, and the engine's limits and defaults, each written once here
(the command line's settings, the scheduler and the bench import them).

Free of torch at import time (torch is imported where a config is checked or a dtype is needed), so that the
command line reads these limits without importing torch: `exspec --help` stays fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from exspec.errors import ConfigError

if TYPE_CHECKING:
    import torch

# dtype names -> torch dtype names (float32, bfloat16, float16)
DTYPES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
MAX_SPECULATIVE_TOKENS = 32  # k, draft tokens per step, is in [0, MAX_SPECULATIVE_TOKENS] everywhere
# max_model_len where neither the user nor the models' config.json gives one
DEFAULT_MAX_MODEL_LEN = 2048
# The KV pool's default share of the memory free once the weights are loaded (--kv-cache-memory): most of a
# GPU (vLLM's --gpu-memory-utilization is 0.9 of the whole GPU), a modest part of the RAM a CPU host still has
# available (its other processes keep the rest; the pool's pages are touched at start-up).
KV_MEMORY_DEFAULT = {"cuda": 0.9, "cpu": 0.25}
# The attention backends "auto" tries per device type, in order: the first that can run here ("reference" where none
# can). On the CPU `native` needs a C compiler to build its kernel on first use; `sdpa` is pure PyTorch.
ATTENTION_DEFAULT = {"cuda": ("triton",), "cpu": ("native", "sdpa")}
GEMM_MODES = ("auto", "packed", "unpadded", "default")  # EngineConfig.gemm (engine/packed_linear.py)
# EngineConfig.compile_mode, how `compile` makes the static forwards fast (engine/static_forward.py): "inductor"
# compiles them (torch.compile: the CPU's capturability proof; CUDA graphs through mode "reduce-overhead" on CUDA, run
# on an H100); "cudagraph" records the eager forward into a torch.cuda.CUDAGraph (CUDA only, no compiler, as vLLM
# captures its decode graphs). "cudagraph" ran on an H100 on 2026-11-27 (docs/BENCHMARKS.md section 0): the 1b pair
# in bf16 identical to eager at B = 1 and 8, decode 5.6x and 3.0x eager's, 0.1-0.2 s to capture a batch size's graphs.
COMPILE_MODES = ("inductor", "cudagraph")
# EngineConfig.speculative_method, where draft tokens come from: "draft" (the draft model's proposals) or "ngram" (no
# draft model: n-gram lookup in each sequence's own tokens, engine/lookup.py; vLLM's `ngram` method).
SPECULATIVE_METHODS = ("draft", "ngram")
# n-gram lookup (speculative_method "ngram"): the longest and shortest suffix looked up (vLLM's prompt_lookup_max and
# _min). 4 down to 1 measured best on the demo target's held-out answers (docs/BENCHMARKS.md section 5).
PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_LIMIT = 4, 1, 16
# Model config keys that declare a model's position limit, in the order they are looked for.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def position_limit_of(config: Mapping | object) -> int | None:
    """The number of positions a model config declares (a config.json dict or a transformers config), or None."""
    for key in POSITION_KEYS:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_num_speculative_tokens(k: int, name: str) -> str | None:
    """None when k is in [0, MAX_SPECULATIVE_TOKENS], else the message that names `name` and the range."""
    if isinstance(k, int) and 0 <= k <= MAX_SPECULATIVE_TOKENS:
        return None
    return f"{name} must be in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model pair and size its paged KV pools."""

    model: Path  # target model directory (from_pretrained)
    draft_model: Path | None = None  # draft model directory; None: no speculation
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "float32"  # one of DTYPES
    max_num_seqs: int = 64  # sequence slots (token buffer, sampling parameters, block table row): live sequences at most
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # prompt + generated tokens per sequence
    max_num_speculative_tokens: int = 8  # largest k a step may use
    attn_implementation: str = "sdpa"  # "sdpa" or "eager"
    force_mixed: bool = False  # benchmarks only: every step through the mixed-length path, even equal lengths
    attention: str = "auto"  # "auto" or a backend in engine/backends/ (backends.names()): how attention reads the pools
    block_size: int = 16  # positions per KV block
    # KV pool size: a fraction (0, 1] of the memory free after the weights, or a byte count (int); None: the
    # device's default (KV_MEMORY_DEFAULT). Never more blocks than max_num_seqs sequences of max_model_len.
    kv_cache_memory: float | int | None = None
    gemm: str = "auto"  # "auto" | "packed" | "unpadded" | "default": oneDNN-prepacked linears for CPU forwards
    # The draft's forwards and the verify through compiled static-shape forwards (engine/static_forward.py). Off by
    # default on every device: on the CPU it is a capturability proof, not a speed-up; on CUDA it is a 2x to 7.6x
    # faster decode step (one H100, docs/BENCHMARKS.md section 0). compile_mode "inductor" compiles each (bucket, Q)
    # for 30-70 s at its first use; "cudagraph" captures them all when the engine starts (SpecEngine.prepare_static).
    compile: bool = False
    compile_mode: str = "inductor"  # one of COMPILE_MODES: how `compile` makes them fast
    speculative_method: str = "draft"  # one of SPECULATIVE_METHODS; "ngram" takes no draft_model
    prompt_lookup_max: int = PROMPT_LOOKUP_MAX  # "ngram": the longest suffix looked up, <= PROMPT_LOOKUP_LIMIT
    prompt_lookup_min: int = PROMPT_LOOKUP_MIN  # "ngram": the shortest, >= 1 and <= prompt_lookup_max

    def __post_init__(self) -> None:
        import torch

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
        if bad_k := check_num_speculative_tokens(self.max_num_speculative_tokens, "max_num_speculative_tokens"):
            raise ConfigError(bad_k)
        from exspec.engine import backends

        if self.attention != backends.AUTO and self.attention not in backends.names():
            raise ConfigError(f"attention must be {backends.AUTO} or one of {list(backends.names())}, got {self.attention!r}")
        if not 1 <= self.block_size <= 1024:
            raise ConfigError(f"block_size must be in [1, 1024], got {self.block_size}")
        mem = self.kv_cache_memory
        if mem is not None and not ((isinstance(mem, float) and 0 < mem <= 1) or (isinstance(mem, int) and mem > 0)):
            raise ConfigError(f"kv_cache_memory must be a fraction in (0, 1] or a byte count > 0, got {mem!r}")
        if self.gemm not in GEMM_MODES:
            raise ConfigError(f"gemm must be one of {', '.join(GEMM_MODES)}, got {self.gemm!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}")
        if self.compile and self.attn_implementation == "eager":
            raise ConfigError("compile needs attn_implementation 'sdpa' (exspec's attention), not 'eager'")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.compile_mode == "cudagraph" and not self.device.startswith("cuda"):
            raise ConfigError(f"compile_mode 'cudagraph' needs a CUDA device, not {self.device!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.speculative_method!r}")
        if self.speculative_method == "ngram" and self.draft_model is not None:
            raise ConfigError("speculative_method 'ngram' drafts without a draft model: drop draft_model")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= PROMPT_LOOKUP_LIMIT:
            raise ConfigError(f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= "
                              f"{PROMPT_LOOKUP_LIMIT}, got {self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def speculates(self) -> bool:
        """Whether steps can draft: a draft model, or n-gram lookup (k may still be 0)."""
        return self.draft_model is not None or self.speculative_method == "ngram"

    @property
    def drafter(self) -> str:
        """Where drafts come from, for logs: the draft model's path, "n-gram lookup", or "none (no speculation)"."""
        if self.speculative_method == "ngram" and self.max_num_speculative_tokens > 0:
            return f"n-gram lookup (suffixes of {self.prompt_lookup_max} down to {self.prompt_lookup_min} tokens)"
        return str(self.draft_model) if self.draft_model is not None else "none (no speculation)"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @staticmethod
    def token_pool_length(max_model_len: int, max_k: int) -> int:
        """Positions a sequence slot's token buffer holds: max_model_len, plus slack for a rectangular verify,
        which writes k + 1 columns from each row's pending token (rows near the end of their context fill the
        columns past their budget with padding). max_k: the largest k a step uses (0 without a draft)."""
        return max_model_len + max_k + 1
