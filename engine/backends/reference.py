"""`reference`: plain PyTorch any device runs. Gathers each row's blocks [0, kv_len) into fresh tensors, then
one masked SDPA over the batch (grouped-query heads natively)."""

from __future__ import annotations

import torch

from exspec.engine.backends import AttentionBackend, register
from exspec.engine.kv_cache import ForwardMeta, gather_kv


@register("reference")
class ReferenceBackend(AttentionBackend):
    """plain PyTorch: gather the blocks, masked SDPA"""

    def forward(self, query, k_cache, v_cache, plan: ForwardMeta, scale):
        keys = gather_kv(k_cache, plan)  # [B, kv_heads, kv_len, head_dim]
        values = gather_kv(v_cache, plan)
        mask = plan.mask[..., : plan.kv_len]  # [1 or B, 1, Q, kv_len]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != query.shape[1]
        )  # [B, heads, Q, head_dim]
        return out.transpose(1, 2)
