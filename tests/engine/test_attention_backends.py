"""Attention backends (engine/attention_pool.py): every backend that runs here gives the target's own greedy
output in the scenarios that exercise the pool (scattered slots, mixed lengths, padding, chunked prefill,
sliding window, stale K/V), and the pool backend reads the pools in place (no gathered copy)."""

from __future__ import annotations

import pytest
import torch
from tests.engine.test_engine_equivalence import MIXED, MIXED_MAX, assert_matches_reference
from tests.engine.test_kv_cache import _poison
from tests.support.driver import admit, prefill, run_to_end, step
from tests.support.models import random_prompts

from exspec.engine import SamplingParams
from exspec.engine.attention_pool import BACKENDS, PoolPlan, flash_available, plan_runs, pool_attention
from exspec.engine.kv_cache import ForwardView, SlotKVCache
from exspec.engine.runner import resolve_attention
from exspec.errors import ExspecError

RUNNABLE = [b for b in BACKENDS if b != "flash" or flash_available(torch.device("cuda"))]
ALL = [pytest.param(b, marks=pytest.mark.skipif(b not in RUNNABLE, reason="needs CUDA and flash_attn")) for b in BACKENDS]


@pytest.fixture
def backend(request):
    return request.param


# ---------------------------------------------------------------------------------------------- unit level


def test_plan_runs_splits_at_slot_gaps_and_start_changes():
    runs = plan_runs([4, 5, 6, 9, 2, 3], [7, 7, 7, 7, 7, 9], q_len=2, pool_len=100)
    assert [(r.row_start, r.row_end, r.first_slot, r.kv_len) for r in runs] == [
        (0, 3, 4, 9),
        (3, 4, 9, 9),
        (4, 5, 2, 9),
        (5, 6, 3, 11),
    ]
    assert plan_runs([0, 1], [98, 98], q_len=5, pool_len=100)[0].kv_len == 100  # clamped to the pool


@pytest.mark.parametrize("q_len, window", [(1, None), (3, None), (4, 6)])
def test_pool_attention_matches_masked_sdpa_over_gathered_kv(q_len, window):
    torch.manual_seed(0)
    slots_n, heads, kv_heads, pool_len, dim = 7, 4, 2, 40, 8
    k_pool = torch.randn(slots_n, kv_heads, pool_len, dim)
    v_pool = torch.randn(slots_n, kv_heads, pool_len, dim)
    slots, starts = [5, 1, 2, 6], [20, 3, 3, 31]
    batch = len(slots)
    query = torch.randn(batch, heads, q_len, dim)
    positions = torch.tensor(starts)[:, None] + torch.arange(q_len)  # [B, Q]
    kv_len = max(starts) + q_len
    keys = torch.arange(kv_len)
    allowed = keys[None, None, :] <= positions[:, :, None]  # [B, Q, kv_len]
    if window:
        allowed &= keys[None, None, :] > positions[:, :, None] - window
    mask = allowed[:, None]  # [B, 1, Q, kv_len]
    idx = torch.tensor(slots)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, k_pool[idx, :, :kv_len], v_pool[idx, :, :kv_len], attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)  # [B, Q, heads, dim]
    plan = PoolPlan("pool", plan_runs(slots, starts, q_len, pool_len), mask if (q_len > 1 or window) else None, None, None, None)
    assert len(plan.runs) == 3  # slots 1, 2 share a run
    ours = pool_attention(None, query, k_pool, v_pool, plan, scaling=None)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_pool_reading_update_returns_the_pools_themselves():
    cache = SlotKVCache(num_layers=1, num_slots=4, max_len=16)
    k = torch.randn(2, 2, 3, 8)  # [B, kv_heads, Q, dim]
    v = torch.randn(2, 2, 3, 8)
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    cache.view = ForwardView(torch.tensor([3, 0]), positions, kv_len=8, slot_range=None, read_pool=True)
    keys, values = cache.update(k, v, 0)
    assert keys is cache.keys[0] and values is cache.values[0]  # no copy: the pool itself
    torch.testing.assert_close(keys[3, :, 5:8], k[0])
    torch.testing.assert_close(values[0, :, 0:3], v[1])
    cache.view = ForwardView(torch.tensor([3, 0]), positions, kv_len=8, slot_range=None, read_pool=False)
    keys, _ = cache.update(k, v, 0)  # the reference gathers each row's [0, kv_len)
    assert keys.shape == (2, 2, 8, 8) and keys.data_ptr() != cache.keys[0].data_ptr()


def test_backend_resolution():
    cpu = torch.device("cpu")
    assert resolve_attention(None, cpu, "exspec_sdpa") == "pool"
    assert resolve_attention(None, torch.device("cuda"), "exspec_sdpa") == "gather"  # unmeasured on CUDA
    assert resolve_attention("gather", cpu, "exspec_sdpa") == "gather"
    assert resolve_attention("pool", cpu, "eager") == "gather"  # eager adds a float mask to gathered K/V
    assert resolve_attention("auto", cpu, "exspec_sdpa") == "pool"
    with pytest.raises(ExspecError, match="attention backend must be one of"):
        resolve_attention("paged", cpu, "exspec_sdpa")
    if not flash_available(torch.device("cuda")):
        with pytest.raises(ExspecError, match="needs a CUDA device and the flash_attn package"):
            resolve_attention("flash", cpu, "exspec_sdpa")


# ---------------------------------------------------------------------------------------------- engine level


@pytest.mark.parametrize("backend", ALL, indirect=True)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_mixed_lengths_at_scattered_slots_match_target(models, arch, backend):
    engine = models.engine(arch, "noisy", attention=backend)
    assert engine.target.attention == backend
    # Occupy every other slot first, so the batch's slots are scattered.
    holders = [admit(engine, [5, 6], SamplingParams()) for _ in range(8)]
    for h in holders[::2]:
        engine.free(h.seq_id)
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX[:8]]
    seqs, outs = run_to_end(engine, MIXED[:8], params, 3)
    assert sorted(s.slot for s in seqs) != list(range(min(s.slot for s in seqs), min(s.slot for s in seqs) + 8))
    assert_matches_reference(models, arch, MIXED[:8], seqs, MIXED_MAX[:8])
    assert outs[1].kind == "mixed"


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_grouped_then_forced_mixed_match_target(models, backend):
    engine = models.engine("llama", "noisy", attention=backend)
    prompts = random_prompts([24] * 6, seed=61)
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=12), 4)
    assert outs[1].kind == "grouped"
    forced = models.engine("llama", "noisy", attention=backend, force_mixed=True)
    seqs2, outs2 = run_to_end(forced, prompts, SamplingParams(max_tokens=12), 2)
    assert outs2[1].kind == "mixed"
    for p, a, b in zip(prompts, seqs, seqs2):
        assert a.output_token_ids == b.output_token_ids == models.reference("llama", p, 12)


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_chunked_prefill_with_padding_past_the_pool_matches_target(models, backend):
    engine = models.engine("qwen3", "noisy", max_model_len=160, attention=backend)
    a, d = random_prompts([150, 120], seed=31)
    sa = admit(engine, a, SamplingParams(max_tokens=30))
    sd = admit(engine, d, SamplingParams(max_tokens=12))
    prefill(engine, [(sa, 0, 100)])
    prefill(engine, [(sa, 100, 150), (sd, 0, 120)])  # padding past the pool
    live = [sa, sd]
    while live:
        step(engine, live, 4)
        live = [s for s in live if not s.finished]
    assert sa.output_token_ids == models.reference("qwen3", a, 10)
    assert sd.output_token_ids == models.reference("qwen3", d, 12)


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_sliding_window_matches_target(models, backend):
    engine = models.engine("mistral", "window", attention=backend)
    prompts = MIXED[:6]
    seqs, _ = run_to_end(engine, prompts, SamplingParams(max_tokens=12), 3)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == models.reference("mistral", prompt, 12, target="window")


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_stale_kv_is_never_read(models, backend):
    """Poison everything no sequence may read, before every step: outputs do not change."""
    prompts = random_prompts([1, 9, 40, 77, 3, 55], seed=51)
    params = [SamplingParams(max_tokens=m) for m in (14, 13, 14, 7, 14, 11)]
    gen = torch.Generator().manual_seed(0)
    ks = [4, 1, 0, 6, 3]
    engine = models.engine("llama", "noisy", attention=backend)
    _poison(engine, [], gen)
    seqs, _ = run_to_end(engine, prompts, params, lambda i: ks[i % 5], before_step=lambda e, live: _poison(e, live, gen))
    for prompt, seq, prm in zip(prompts, seqs, params):
        assert seq.output_token_ids == models.reference("llama", prompt, prm.max_tokens)
