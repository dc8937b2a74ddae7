"""`exspec_sdpa` computes what transformers' `sdpa` computes, without copying K/V for grouped-query heads."""

import torch

from exspec.engine.attention import NAME, gqa_sdpa_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class _Module(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def test_matches_transformers_sdpa_with_mask_and_gqa():
    torch.manual_seed(0)
    for heads, kv_heads, q_len, kv_len in [(4, 2, 5, 37), (8, 1, 1, 20), (4, 4, 3, 9)]:
        q = torch.randn(3, heads, q_len, 16)
        k = torch.randn(3, kv_heads, kv_len, 16)
        v = torch.randn(3, kv_heads, kv_len, 16)
        pos = torch.tensor([[kv_len - q_len], [2], [kv_len - q_len - 1]]) + torch.arange(q_len)  # [3, Q]
        mask = (torch.arange(kv_len)[None, None, :] <= pos[:, :, None])[:, None]  # [3, 1, Q, kv]
        module = _Module(heads // kv_heads)
        ours, _ = gqa_sdpa_forward(module, q, k, v, mask, scaling=0.25)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        assert ours.shape == (3, q_len, heads, 16)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_cpu_engines_load_models_with_exspec_sdpa(models):
    engine = models.engine("qwen3")
    assert engine.target.model.config._attn_implementation == NAME
    assert not engine.target.float_mask
