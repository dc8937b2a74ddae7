"""`sdpa`: the CPU default. Rows of equal length (a grouped batch) are gathered into a buffer the backend keeps,
one `index_select` per layer, and attended in one batched SDPA call; rows of different lengths (a mixed batch,
or one row) take one SDPA call each, over their own length: a zero-copy strided view of the row's blocks when
they are contiguous ids (token-major blocks make a block range one [kv_len, kv_heads, head_dim] run of memory),
else a gather of its blocks into the buffer. The buffer is what makes a gather cheap: a fresh tensor per gather
costs page faults (2048 keys of the demo target: 420 us fresh against 11 us into a warm buffer), and eight rows'
gather plus one call costs 0.5x to 1.0x of eight calls over views (128 to 1024 keys; docs/BENCHMARKS.md section
4). A row with one query and no window needs no mask.
Measured against `reference` in docs/BENCHMARKS-HISTORY.md ("Paged KV (issue 19)"); scattered rows: docs/BENCHMARKS.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exspec.engine.backends import AttentionBackend, register
from exspec.engine.kv_cache import ForwardMeta


# Rows of one length up to this many keys are gathered and attended in one call; longer ones gain nothing from it
# (1.0x at 1024 keys, B = 8) and would grow the buffer with B.
BATCHED_MAX_KEYS = 1024


@dataclass(frozen=True)
class RowsPlan:
    rows: tuple[tuple[int, int], ...]  # per row: (keys it reads, its first block when its blocks are contiguous and
    # hold them all, else -1)
    block_tables: torch.Tensor  # [B, n_blocks] int32
    batch_ids: torch.Tensor | None  # [B * n_blocks] long: every row's blocks when the rows are one batched call
    mask: torch.Tensor | None  # [1 or B, 1, Q, kv_len] bool; None: one query per row, no window (wants_mask)


@register("sdpa")
class RowSdpaBackend(AttentionBackend):
    """PyTorch SDPA: one call over rows of one length, else per row over views of contiguous blocks"""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}  # gather buffers, grown to the largest gather

    def _buffer(self, which: int, like: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Buffer `which` (0: keys, 1: values) for n_blocks blocks shaped like `like`'s: [n_blocks, block_size,
        kv_heads, head_dim] contiguous. Reused by every row and layer (each row's SDPA reads it before the next
        gather)."""
        key = (which, like.dtype, like.device, like.shape[1:])
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n_blocks:
            buf = like.new_empty((n_blocks, *like.shape[1:]))
            self._buffers[key] = buf
        return buf[:n_blocks]

    def plan(self, meta: ForwardMeta) -> RowsPlan:
        rows = tuple((start + meta.q_len, first) for start, first in zip(meta.starts, meta.first_blocks))
        batched = (len(rows) > 1 and rows[0][0] <= BATCHED_MAX_KEYS
                   and all(start == meta.starts[0] for start in meta.starts))
        ids = meta.block_tables.reshape(-1).long() if batched else None
        return RowsPlan(rows, meta.block_tables, ids, meta.mask)

    def wants_mask(self, q_len: int, window: int | None) -> bool:
        return q_len > 1 or window is not None  # one query sees every key its row holds

    def forward(self, query, k_cache, v_cache, plan: RowsPlan, scale):
        batch, heads, q_len, head_dim = query.shape
        _, block_size, kv_heads, _ = k_cache.shape
        flat_k = k_cache.view(-1, kv_heads, head_dim)  # [(num_blocks + 1) * block_size, kv_heads, head_dim]
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        gqa = kv_heads != heads
        if plan.batch_ids is not None:  # rows of one length: gathered, one call
            n_blocks = plan.block_tables.shape[1]
            kv_len = min(plan.rows[0][0], n_blocks * block_size)
            k_buf = self._buffer(0, k_cache, batch * n_blocks)  # [B * n_blocks, block_size, kv_heads, head_dim]
            v_buf = self._buffer(1, v_cache, batch * n_blocks)
            torch.index_select(k_cache, 0, plan.batch_ids, out=k_buf)
            torch.index_select(v_cache, 0, plan.batch_ids, out=v_buf)
            keys = k_buf.view(batch, -1, kv_heads, head_dim)[:, :kv_len].transpose(1, 2)  # [B, kv_heads, kv_len, D]
            values = v_buf.view(batch, -1, kv_heads, head_dim)[:, :kv_len].transpose(1, 2)
            mask = plan.mask[..., :kv_len] if plan.mask is not None else None  # [1 or B, 1, Q, kv_len]
            o = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
            )  # [B, heads, Q, head_dim]
            return o.transpose(1, 2)
        out = query.new_empty(batch, q_len, heads, v_cache.shape[-1]) if batch > 1 else None  # [B, Q, heads, head_dim]
        for b, (kv_len, first) in enumerate(plan.rows):
            kv_len = min(kv_len, plan.block_tables.shape[1] * block_size)
            if first >= 0:
                start = first * block_size
                keys = flat_k[start : start + kv_len]  # [kv_len, kv_heads, head_dim] view
                values = flat_v[start : start + kv_len]
            else:
                n = -(-kv_len // block_size)
                ids = plan.block_tables[b, :n]
                k_buf, v_buf = self._buffer(0, k_cache, n), self._buffer(1, v_cache, n)  # [n, block_size, ...]
                torch.index_select(k_cache, 0, ids, out=k_buf)
                torch.index_select(v_cache, 0, ids, out=v_buf)
                keys = k_buf.view(-1, kv_heads, head_dim)[:kv_len]  # [kv_len, kv_heads, head_dim]
                values = v_buf.view(-1, kv_heads, head_dim)[:kv_len]
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
            if batch == 1:
                return o.transpose(1, 2)  # [1, Q, heads, head_dim] view
            out[b] = o[0].transpose(0, 1)
        return out
