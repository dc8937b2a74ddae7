"""`native`: the CPU default. A C kernel (engine/kernels/paged_attention_cpu.c, built with the machine's compiler on
first use and cached: engine/kernels/native.py) reads each row's K/V in place through its block table, so rows whose
blocks are scattered cost what consecutive ones do, and needs no mask (positions and the window are the kernel's).
Forwards of more than MAX_KERNEL_QUERIES queries per row (prefill chunks) go to `sdpa`, whose batched GEMMs are
faster there. Unavailable (no compiler, or a failed build): the CPU's default is `sdpa`.
Measured against `sdpa` in docs/BENCHMARKS.md section 4."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exspec.engine.backends import AttentionBackend, register
from exspec.engine.backends.sdpa import RowSdpaBackend
from exspec.engine.kernels import native
from exspec.engine.kv_cache import ForwardMeta

# Queries per row up to which the kernel runs (decode, draft steps, verifies of k <= 7); longer forwards take `sdpa`.
# Attention alone, toy target (4 heads over 2 kv heads of 64), 8 rows, one thread, kernel / SDPA over consecutive
# rows at 1, 5, 9, 17 queries: 256 keys 0.32x, 0.60x, 0.88x, 1.12x; 2048 keys 0.76x, 0.80x, 1.01x, 1.28x
# (scripts/bench_native_kernel.py; docs/BENCHMARKS.md section 4).
MAX_KERNEL_QUERIES = 8


@dataclass(frozen=True)
class NativePlan:
    block_tables: torch.Tensor  # [B, n_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    window: int | None


@register("native")
class NativeBackend(AttentionBackend):
    """a C kernel over the block tables (the machine's C compiler builds it); prefill through sdpa"""

    needs_mask = False

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return device.type == "cpu" and native.available()

    def __init__(self) -> None:
        self._sdpa = RowSdpaBackend()  # prefill chunks

    def wants_mask(self, q_len: int, window: int | None) -> bool:
        return q_len > MAX_KERNEL_QUERIES and self._sdpa.wants_mask(q_len, window)

    def plan(self, meta: ForwardMeta):
        if meta.q_len > MAX_KERNEL_QUERIES:
            return self._sdpa.plan(meta)
        return NativePlan(meta.block_tables.to(torch.int32).contiguous(), meta.seq_lens.to(torch.int32).contiguous(),
                          meta.window)

    def forward(self, query, k_cache, v_cache, plan, scale):
        if not isinstance(plan, NativePlan):
            return self._sdpa.forward(query, k_cache, v_cache, plan, scale)
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        return native.paged_attention_cpu(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale,
                                          window=plan.window)  # [B, Q, heads, head_dim]
