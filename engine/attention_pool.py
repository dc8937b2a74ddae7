"""Attention that reads each row's K/V where it lies in the slot pool: no gathered copy of the cache.

A forward over rows at scattered slots used to gather every row's K/V (up to the batch's longest row)
into fresh tensors before attention. The backends here receive the layer's whole pool instead
([num_slots, kv_heads, pool_len, head_dim], written in place by `SlotKVCache.update`) plus a `PoolPlan`
built once per forward on the host, and attend row by row over views of it, each row over its own length.

Backends (choose with `EngineConfig.attention`, flag `--attention-backend`, or `ModelRunner(attention=...)`):
- "gather": the reference. The cache returns each row's K/V [0, longest) (a view for consecutive slots, an
  `index_select` copy otherwise) and masked SDPA runs once over the batch. Also the only path for "eager".
- "pool": SDPA once per *run* of rows (consecutive slots, equal start) over the pool view
  `pool[first_slot:first_slot + n, :, :kv_len]`. A grouped batch at consecutive slots is one run (the
  same single call as "gather"); rows at scattered slots are one call each, over their own length.
  Measured on a 2-core CPU (docs/BENCHMARKS.md): the default on the CPU (CUDA keeps "gather" by default).
- "flash": CUDA only, `flash_attn_with_kvcache(cache_batch_idx=slots, cache_seqlens=lengths)` over the
  pool seen as [num_slots, pool_len, kv_heads, head_dim] (a transpose view; flash-attn reads strides).
  Needs the `flash_attn` package; never run in exspec's CI (no GPU there): it is selectable, not default.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

BACKENDS = ("gather", "pool", "flash")


@dataclass(frozen=True)
class PoolRun:
    """Batch rows [row_start, row_end) at slots first_slot.. (consecutive), all reading keys [0, kv_len)."""

    row_start: int
    row_end: int
    first_slot: int
    kv_len: int


@dataclass(frozen=True)
class PoolPlan:
    """Everything pool-reading attention needs for one forward; built once, shared by every layer."""

    backend: str  # "pool" or "flash"
    runs: tuple[PoolRun, ...]  # "pool": the SDPA calls of each layer
    mask: torch.Tensor | None  # [1 or B, 1, Q, kv_len] bool: query may see key; None: every key up to the row's length
    slots: torch.Tensor | None  # "flash": [B] int32 slot of each row
    seqlens: torch.Tensor | None  # "flash": [B] int32 keys each row reads (its start + Q)
    window: int | None  # sliding window ("flash" only; "pool" has it in the mask)


def plan_runs(slots: list[int], starts: list[int], q_len: int, pool_len: int) -> tuple[PoolRun, ...]:
    """Split the batch into maximal runs of rows with consecutive slots and equal starts (host lists)."""
    runs = []
    r0 = 0
    for r in range(1, len(slots) + 1):
        if r == len(slots) or slots[r] != slots[r - 1] + 1 or starts[r] != starts[r0]:
            runs.append(PoolRun(r0, r, slots[r0], min(starts[r0] + q_len, pool_len)))
            r0 = r
    return tuple(runs)


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def pool_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, Q, head_dim]
    k_pool: torch.Tensor,  # [num_slots, kv_heads, pool_len, head_dim]: the layer's whole pool
    v_pool: torch.Tensor,  # [num_slots, kv_heads, pool_len, head_dim]
    plan: PoolPlan,
    scaling: float | None,
) -> torch.Tensor:  # [B, Q, heads, head_dim]
    if plan.backend == "flash":
        return _flash(query, k_pool, v_pool, plan, scaling)
    batch, heads, q_len, head_dim = query.shape
    gqa = k_pool.shape[1] != heads
    if len(plan.runs) == 1:
        return _run_sdpa(query, k_pool, v_pool, plan, plan.runs[0], scaling, gqa).transpose(1, 2).contiguous()
    out = query.new_empty(batch, q_len, heads, v_pool.shape[-1])  # [B, Q, heads, head_dim]
    for run in plan.runs:
        out[run.row_start : run.row_end] = _run_sdpa(query, k_pool, v_pool, plan, run, scaling, gqa).transpose(1, 2)
    return out


def _run_sdpa(query, k_pool, v_pool, plan: PoolPlan, run: PoolRun, scaling, gqa: bool) -> torch.Tensor:
    """SDPA for one run over pool views (no copy). returns [n, heads, Q, head_dim]."""
    n = run.row_end - run.row_start
    keys = k_pool[run.first_slot : run.first_slot + n, :, : run.kv_len]  # [n, kv_heads, kv_len, head_dim] view
    values = v_pool[run.first_slot : run.first_slot + n, :, : run.kv_len]
    mask = None
    if plan.mask is not None:
        rows = slice(0, 1) if plan.mask.shape[0] == 1 else slice(run.row_start, run.row_end)
        mask = plan.mask[rows, :, :, : run.kv_len]  # [1 or n, 1, Q, kv_len] view
    return torch.nn.functional.scaled_dot_product_attention(
        query[run.row_start : run.row_end], keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa
    )


def _flash(query, k_pool, v_pool, plan: PoolPlan, scaling) -> torch.Tensor:  # pragma: no cover - needs CUDA
    from flash_attn import flash_attn_with_kvcache

    window = (plan.window - 1, 0) if plan.window else (-1, -1)
    return flash_attn_with_kvcache(
        query.transpose(1, 2),  # [B, Q, heads, head_dim]
        k_pool.transpose(1, 2),  # [num_slots, pool_len, kv_heads, head_dim] view
        v_pool.transpose(1, 2),
        cache_seqlens=plan.seqlens,
        cache_batch_idx=plan.slots,
        softmax_scale=scaling,
        causal=True,  # flash-attn aligns the causal mask bottom-right: query i sees keys < seqlen - Q + i + 1
        window_size=window,
    )
