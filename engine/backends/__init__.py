"""Attention backends: one small interface, one file each, registered by name.

A backend reads the paged pools (engine/kv_cache.py) in its own way. The runner builds a `ForwardMeta`
once per forward (slot mapping, block tables, seq_lens, the mask when the backend asks for one), the backend
turns it into its `plan` once per forward, and every layer then calls `forward` with its own pools. The
K/V of the forward are already written into the pools when `forward` runs.

To add a backend: a file here named as the backend, with a class decorated `@register("name")`, imported at
the bottom of this file (docs/ARCHITECTURE.md has a worked example). `--attention-backend` lists `names()`
(`exspec.registry.listed` reads them from the file names, torch-free); "auto" resolves with
`default_backend(device)`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from exspec.engine.config import ATTENTION_DEFAULT
from exspec.engine.kv_cache import ForwardMeta
from exspec.registry import Registry

AUTO = "auto"


class AttentionBackend:
    """name, availability on a device, a plan per forward, a forward per layer."""

    name: ClassVar[str]
    needs_mask: ClassVar[bool] = True  # the runner builds ForwardMeta.mask ([1 or B, 1, Q, kv_len] bool)

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return True

    def wants_mask(self, q_len: int, window: int | None) -> bool:
        """Whether a forward of q_len queries per row needs ForwardMeta.mask (asked once per forward)."""
        return self.needs_mask

    def plan(self, meta: ForwardMeta) -> Any:
        """Whatever `forward` needs beyond the pools, built once per forward (shared by every layer)."""
        return meta

    def warm_up(self, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None) -> int:
        """Called once per model when its runner is built, with one layer's pools: whatever must not happen in the
        serving loop (a JIT compile) happens here. Returns how many things it prepared; 0 by default."""
        return 0

    def forward(
        self,
        query: torch.Tensor,  # [B, heads, Q, head_dim]
        k_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
        plan: Any,
        scale: float | None,
    ) -> torch.Tensor:  # [B, Q, heads, head_dim]
        raise NotImplementedError


BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend", __name__)
register = BACKENDS.register


def names() -> tuple[str, ...]:
    """Every registered backend, in registration order."""
    return BACKENDS.names()


def available_names(device: torch.device) -> tuple[str, ...]:
    return tuple(n for n, cls in BACKENDS.items() if cls.available(device))


def default_backend(device: torch.device) -> str:
    """The first of exspec.engine.config.ATTENTION_DEFAULT's backends for the device type that can run here (`triton`
    on CUDA; `native`, else `sdpa`, on the CPU: measured fastest there, docs/BENCHMARKS.md section 4), `reference`
    where none can."""
    for name in ATTENTION_DEFAULT.get(device.type, ()):
        if BACKENDS.get(name).available(device):
            return name
    return "reference"


def create(name: str, device: torch.device) -> AttentionBackend:
    """The backend `name` ("auto": the device's default). Raises ValueError naming the choices."""
    if name == AUTO:
        name = default_backend(device)
    if name not in BACKENDS.names():
        raise ValueError(f"attention backend must be {AUTO} or one of {list(BACKENDS.names())}, got {name!r}")
    cls = BACKENDS.get(name)
    if not cls.available(device):
        raise ValueError(f"attention backend {name!r} cannot run on {device.type} here ({cls.__doc__.splitlines()[0]})")
    return cls()


from exspec.engine.backends import native, reference, sdpa, triton  # noqa: E402,F401  (registers them)
