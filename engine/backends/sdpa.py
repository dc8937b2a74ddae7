"""`sdpa`: the CPU default. One SDPA call per row, each over its own length: a zero-copy strided view of the
row's blocks when they are contiguous ids (token-major blocks make a block range one [kv_len, kv_heads,
head_dim] run of memory), else a gather of its blocks. A row with one query and no window needs no mask.
Measured against `reference` in docs/BENCHMARKS-HISTORY.md ("Paged KV (issue 19)"); scattered rows: docs/BENCHMARKS.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exspec.engine.backends import AttentionBackend, register
from exspec.engine.kv_cache import ForwardMeta


@dataclass(frozen=True)
class RowsPlan:
    rows: tuple[tuple[int, int], ...]  # per row: (keys it reads, its first block when its blocks are contiguous and
    # hold them all, else -1)
    block_tables: torch.Tensor  # [B, n_blocks] int32
    mask: torch.Tensor | None  # [1 or B, 1, Q, kv_len] bool; None: one query per row, no window


@register("sdpa")
class RowSdpaBackend(AttentionBackend):
    """PyTorch SDPA per row over views of contiguous blocks"""

    def plan(self, meta: ForwardMeta) -> RowsPlan:
        rows = tuple((start + meta.q_len, first) for start, first in zip(meta.starts, meta.first_blocks))
        return RowsPlan(rows, meta.block_tables, meta.mask if (meta.q_len > 1 or meta.window) else None)

    def forward(self, query, k_cache, v_cache, plan: RowsPlan, scale):
        batch, heads, q_len, head_dim = query.shape
        _, block_size, kv_heads, _ = k_cache.shape
        flat_k = k_cache.view(-1, kv_heads, head_dim)  # [(num_blocks + 1) * block_size, kv_heads, head_dim]
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        gqa = kv_heads != heads
        out = query.new_empty(batch, q_len, heads, v_cache.shape[-1])  # [B, Q, heads, head_dim]
        for b, (kv_len, first) in enumerate(plan.rows):
            kv_len = min(kv_len, plan.block_tables.shape[1] * block_size)
            if first >= 0:
                start = first * block_size
                keys = flat_k[start : start + kv_len]  # [kv_len, kv_heads, head_dim] view
                values = flat_v[start : start + kv_len]
            else:
                n = -(-kv_len // block_size)
                ids = plan.block_tables[b, :n]
                keys = k_cache.index_select(0, ids).view(-1, kv_heads, head_dim)[:kv_len]
                values = v_cache.index_select(0, ids).view(-1, kv_heads, head_dim)[:kv_len]
            mask = None
            if plan.mask is not None:
                m = 0 if plan.mask.shape[0] == 1 else b
                mask = plan.mask[m : m + 1, :, :, :kv_len]  # [1, 1, Q, kv_len]
            o = torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1],
                keys.transpose(0, 1)[None],  # [1, kv_heads, kv_len, head_dim]
                values.transpose(0, 1)[None],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )  # [1, heads, Q, head_dim]
            out[b] = o[0].transpose(0, 1)
        return out
