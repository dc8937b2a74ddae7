"""`sdpa`: the CPU default. Rows of similar, modest lengths (a grouped batch, or a mixed one padded by at most a
fifth; up to 1024 keys) are gathered into a buffer the backend keeps, one `index_select` per layer, and attended
in one batched SDPA call under the mask; other rows (one row, long or very unequal rows) take one SDPA call each,
over their own length: a zero-copy view of the row's blocks when they are contiguous ids (the pools' head-major
storage makes a block range one contiguous [kv_len, head_dim] stretch per head), else a gather of its blocks into
a buffer, head-major as well. The buffer is what makes a gather cheap: a fresh tensor per gather may pay page faults
(2048 keys of the demo target: 420 or 32 us fresh, depending on the allocator's state, against 11 to 22 us into a
kept buffer), and eight rows' gather plus one call costs 0.6x to 1.0x of eight calls over views (128 to 1024 keys;
docs/BENCHMARKS.md section 4). A call per row with one query and no window needs no mask.
Measured against `reference` in docs/BENCHMARKS-HISTORY.md ("Paged KV (issue 19)"); scattered rows:
docs/BENCHMARKS.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exspec.engine.backends import AttentionBackend, register
from exspec.engine.kv_cache import ForwardMeta


# Rows are gathered and attended in one call when the longest holds at most BATCHED_MAX_KEYS keys (longer ones gain
# nothing from it, 1.0x at 1024 keys, B = 8, and would grow the buffer with B) and padding to the longest fills at
# most 1 - BATCHED_MIN_FILL of the call. `scripts/bench_gather_sdpa.py`, 8 rows against a call per row: 300 to 600
# keys (fill 0.75) 1.15-1.25x slower, 300 to 350 (fill 0.93) 0.91-0.93x, 128 to 168 0.76-0.81x; 800 to 900 keys
# 1.0-1.13x, so the 1024-key bound is generous for unequal rows.
BATCHED_MAX_KEYS = 1024
BATCHED_MIN_FILL = 0.8


@dataclass(frozen=True)
class RowsPlan:
    rows: tuple[tuple[int, int], ...]  # per row: (keys it reads, its first block when its blocks are contiguous and
    # hold them all, else -1)
    block_tables: torch.Tensor  # [B, n_blocks] int32
    batch_ids: torch.Tensor | None  # [B * n_blocks] long: every row's blocks when the rows are one batched call
    mask: torch.Tensor | None  # [1 or B, 1, Q, kv_len] bool; None: one query per row, no window, and (batched) one
    # length


@register("sdpa")
class RowSdpaBackend(AttentionBackend):
    """PyTorch SDPA: one call over rows of similar lengths, else per row over views of contiguous blocks"""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}  # gather buffers, grown to the largest gather

    def _gather(self, which: int, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The blocks `ids` [n] of `cache` [num_blocks + 1, block_size, kv_heads, head_dim] copied head-major into
        buffer `which` (0: keys, 1: values): returns [kv_heads, n, block_size, head_dim] contiguous, so each head's
        keys are one stretch of memory for SDPA (as in the pools). The buffer is reused by every row and layer (each
        row's SDPA reads it before the next gather) and grows to the largest gather."""
        _, block_size, kv_heads, head_dim = cache.shape
        size = kv_heads * ids.numel() * block_size * head_dim
        key = (which, cache.dtype, cache.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < size:
            buf = cache.new_empty(size)
            self._buffers[key] = buf
        out = buf[:size].view(kv_heads, ids.numel(), block_size, head_dim)
        # the pools' storage order (engine/kv_cache.py); any strides work
        torch.index_select(cache.permute(2, 0, 1, 3), 1, ids, out=out)
        return out

    def plan(self, meta: ForwardMeta) -> RowsPlan:
        lens = [start + meta.q_len for start in meta.starts]  # keys each row reads
        rows = tuple(zip(lens, meta.first_blocks))
        longest = max(lens)
        batched = len(lens) > 1 and longest <= BATCHED_MAX_KEYS and sum(lens) >= BATCHED_MIN_FILL * len(lens) * longest
        if not batched:
            return RowsPlan(rows, meta.block_tables, None, meta.mask)
        mask = meta.mask
        if mask is None and min(lens) < longest:  # one query per row: it sees the keys its row holds
            keys = torch.arange(longest, device=meta.block_tables.device)
            mask = (keys < torch.tensor(lens, device=keys.device)[:, None])[:, None, None, :]  # [B, 1, 1, longest]
        return RowsPlan(rows, meta.block_tables, meta.block_tables.reshape(-1).long(), mask)

    def wants_mask(self, q_len: int, window: int | None) -> bool:
        return q_len > 1 or window is not None  # one query sees every key its row holds

    def forward(self, query, k_cache, v_cache, plan: RowsPlan, scale):
        batch, heads, q_len, head_dim = query.shape
        _, block_size, kv_heads, _ = k_cache.shape
        flat_k = k_cache.view(-1, kv_heads, head_dim)  # [(num_blocks + 1) * block_size, kv_heads, head_dim]
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        gqa = kv_heads != heads
        if plan.batch_ids is not None:  # every row gathered, one call
            n_blocks = plan.block_tables.shape[1]
            kv_len = min(max(n for n, _ in plan.rows), n_blocks * block_size)
            k_buf = self._gather(0, k_cache, plan.batch_ids)  # [kv_heads, B * n_blocks, block_size, head_dim]
            v_buf = self._gather(1, v_cache, plan.batch_ids)
            keys = k_buf.view(kv_heads, batch, -1, head_dim)[:, :, :kv_len].transpose(0, 1)  # [B, kv_heads, kv_len, D]
            values = v_buf.view(kv_heads, batch, -1, head_dim)[:, :, :kv_len].transpose(0, 1)
            mask = plan.mask[..., :kv_len] if plan.mask is not None else None  # [1 or B, 1, Q, kv_len]
            o = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
            )  # [B, heads, Q, head_dim]
            return o.transpose(1, 2)
        # One call per row. The per-row work is a handful of tensor ops (each costs a few us from Python, and this
        # runs rows x layers times a forward): the pools' [kv_heads, tokens, head_dim] views are taken once per layer.
        keys_t, values_t = flat_k.transpose(0, 1), flat_v.transpose(0, 1)  # [kv_heads, tokens, head_dim] views
        cap = plan.block_tables.shape[1] * block_size
        per_row_mask = plan.mask is not None and plan.mask.shape[0] > 1
        outs = []
        for b, (kv_len, first) in enumerate(plan.rows):
            kv_len = min(kv_len, cap)
            if first >= 0:
                start = first * block_size
                keys = keys_t[None, :, start : start + kv_len]  # [1, kv_heads, kv_len, head_dim] view
                values = values_t[None, :, start : start + kv_len]
            else:
                ids = plan.block_tables[b, : -(-kv_len // block_size)]  # [n]
                keys = self._gather(0, k_cache, ids).view(1, kv_heads, -1, head_dim)[:, :, :kv_len]  # [1, kvh, kv, D]
                values = self._gather(1, v_cache, ids).view(1, kv_heads, -1, head_dim)[:, :, :kv_len]
            mask = None
            if plan.mask is not None:
                mask = plan.mask[b : b + 1, :, :, :kv_len] if per_row_mask else plan.mask[..., :kv_len]  # [1, 1, Q, kv]
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1], keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
            ))  # [1, heads, Q, head_dim]; a fresh tensor (the gather buffer is reused by the next row)
        o = outs[0] if batch == 1 else torch.cat(outs)  # [B, heads, Q, head_dim]
        return o.transpose(1, 2)  # [B, Q, heads, head_dim] view
