"""STAND-IN (branch h-kv) for the Triton kernel h-triton writes: the contract's signature in plain PyTorch, so the
`triton` backend's adapter can be tested before the kernel lands. Replaced by h-triton's file at merge."""

from __future__ import annotations

import torch


def paged_attention(
    query: torch.Tensor,  # [B, heads, Q, head_dim]
    k_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: keys row b holds (start_b + Q); 0: a padding row
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,  # [B, Q, heads, head_dim]
) -> torch.Tensor:  # [B, Q, heads, head_dim]
    batch, heads, q_len, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    keys = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, max_blocks * block_size, D]
    values = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len, device=query.device)  # [B, Q]
    key_pos = torch.arange(keys.shape[2], device=query.device)  # [L]
    mask = key_pos[None, None, :] <= pos[:, :, None]  # [B, Q, L]
    if window:
        mask &= key_pos[None, None, :] > pos[:, :, None] - window
    res = torch.nn.functional.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask[:, None], scale=scale,
        enable_gqa=kv_heads != heads,
    ).transpose(1, 2)  # [B, Q, heads, head_dim]
    res = torch.where((seq_lens > 0)[:, None, None, None], res.nan_to_num(), 0.0)
    if out is not None:
        out.copy_(res)
        return out
    return res
