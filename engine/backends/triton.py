"""`triton`: the paged attention kernel (engine/kernels/paged_attention.py) over the block tables: each row its
own length and causal offset, grouped-query heads, sliding window. The CUDA default. On the CPU it runs only
under the Triton interpreter (`TRITON_INTERPRET=1`, for tests). `triton` is imported lazily: exspec itself
never needs it."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from exspec.engine.backends import AttentionBackend, register
from exspec.engine.kv_cache import ForwardMeta


@register("triton")
class TritonBackend(AttentionBackend):
    """needs the triton package, and CUDA or TRITON_INTERPRET=1"""

    needs_mask = False  # the kernel masks by position itself
    warm_interpreted = False  # warm up under Triton's interpreter too (nothing compiles there: tests only)

    @classmethod
    def available(cls, device: torch.device) -> bool:
        from exspec.engine.kernels.paged_attention import available

        # triton imports, and CUDA, or CPU tensors under a recent enough interpreter (TRITON_INTERPRET=1)
        return available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

    def __init__(self) -> None:
        from exspec.engine.kernels.paged_attention import paged_attention, warm_up

        self._kernel = paged_attention
        self._warm_up = warm_up

    def warm_up(self, heads, k_cache, v_cache, window) -> int:
        """Every kernel variant this model's forwards can launch (kernel_variants), compiled now, on CUDA: a forward of
        a new shape (a prefill, the draft's catch-up) compiled one in the serving loop, 1-3 s each, before 2026-11-27."""
        if k_cache.device.type != "cuda" and not self.warm_interpreted:
            return 0
        return self._warm_up(heads, k_cache, v_cache, window)

    def plan(self, meta: ForwardMeta) -> ForwardMeta:
        return replace(meta, block_tables=meta.block_tables.contiguous())  # [B, n_blocks]: rows at a plain stride

    def forward(self, query, k_cache, v_cache, plan: ForwardMeta, scale):
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        return self._kernel(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, window=plan.window)
