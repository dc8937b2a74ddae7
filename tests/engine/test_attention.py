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


def test_models_built_elsewhere_are_switched_to_exspec_attention(models):
    """A `ModelPair` handed to the engine whose models use transformers' own attention (sdpa, eager) is switched to
    exspec's entry points, which write and read the pools; the output is still the target's."""
    import copy

    from tests.engine.test_engine_equivalence import MIXED, assert_matches_reference
    from tests.support.driver import run_to_end

    from exspec.engine import ModelPair, SamplingParams, SpecEngine
    from exspec.engine.attention import EAGER_NAME

    base = models.pair("llama")
    target, draft = copy.deepcopy(base.target), copy.deepcopy(base.draft)
    target.set_attn_implementation("sdpa")
    draft.set_attn_implementation("eager")
    pair = ModelPair(target, draft, base.tokenizer, base.vocab_size, base.eos_token_ids, "elsewhere")
    engine = SpecEngine(models.config("llama", compile=False), pair=pair)
    assert target.config._attn_implementation == NAME and draft.config._attn_implementation == EAGER_NAME
    seqs, _ = run_to_end(engine, MIXED[:4], SamplingParams(max_tokens=10), 3)
    assert_matches_reference(models, "llama", MIXED[:4], seqs, 10)
