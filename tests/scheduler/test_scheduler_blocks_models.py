"""Preemption and recompute on tiny real models (issue 19): with the KV blocks exhausted, every request
completes, greedy outputs stay token-identical to the target alone and seeded sampling reproduces the run
that had blocks to spare. Once through a block budget seen by the scheduler only (any engine), once with the
engine's own pool sized to a few blocks (the paged engine)."""

from exspec.engine.params import SamplingParams
from exspec.scheduler import SchedulerConfig, SchedulerCore
from exspec.scheduler.request import Request
from tests.support.block_budget import BlockBudget
from tests.support.models import random_prompts


def _run(engine, jobs, config):
    core = SchedulerCore(engine, config)
    for i, (prompt, params) in enumerate(jobs):
        core.add(Request(str(i), list(prompt), params, order=i))
    finals = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for req, out in core.step()[0]:
            if out.finished:
                finals[int(req.request_id)] = (list(req.output_token_ids), out.finish_reason)
    assert not core.has_work()
    return core, [finals[i] for i in range(len(jobs))]


def _jobs(eos_prompts):
    lengths = [3, 40, 7, 22, 12, 31, 5, 18, 9, 26]
    prompts = random_prompts(lengths, seed=31)
    jobs = []
    for i, p in enumerate(prompts):
        if i % 3 == 2:  # seeded sampling: under the default policy it decodes without drafts, so it reproduces
            jobs.append((p, SamplingParams(max_tokens=12 + 3 * i, temperature=0.9, seed=50 + i, ignore_eos=True)))
        else:
            jobs.append((p, SamplingParams(max_tokens=12 + 3 * i)))
    # Greedy outputs that end with EOS, and the same prompts with min_tokens suppressing it for a while.
    jobs += [(p, SamplingParams(max_tokens=40)) for p in eos_prompts]
    jobs += [(p, SamplingParams(max_tokens=40, min_tokens=20)) for p in eos_prompts]
    return jobs


def test_exhausted_blocks_keep_outputs_identical_on_real_models(models):
    """A budget of 8 blocks of 16 positions: the longest request needs 6 (40 + 39 tokens, k = 3)."""
    jobs = _jobs(models.eos_prompts("llama", count=2, max_new_tokens=40))
    config = SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=3)
    _, roomy = _run(models.engine("llama", "noisy", max_num_seqs=8), jobs, config)
    engine = BlockBudget(models.engine("llama", "noisy", max_num_seqs=8), num_blocks=8)
    core, tight = _run(engine, jobs, config)
    assert core.num_preemptions >= 3
    assert engine.num_free_blocks == 8 and engine.num_free_slots == engine.num_slots
    for i, ((prompt, params), got, expected) in enumerate(zip(jobs, tight, roomy)):
        assert got == expected, f"request {i}"
        if params.greedy:
            ref = models.reference("llama", prompt, params.max_tokens, min_new_tokens=params.min_tokens)
            assert got[0] == ref, f"request {i}"
    assert [reason for _, reason in tight[-4:-2]] == ["stop", "stop"]  # EOS ends them
    assert all(len(tokens) >= 20 for tokens, _ in tight[-2:])  # but not before min_tokens


def _kv_bytes_per_block(config, block_size: int, dtype_bytes: int = 4) -> int:
    """K and V of one block of positions, every layer: what a paged fp32 pool spends per block."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * dtype_bytes


def test_the_engine_with_its_own_blocks_exhausted_keeps_outputs_identical(models):
    jobs = _jobs(models.eos_prompts("llama", count=2, max_new_tokens=40))
    config = SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=3)
    _, roomy = _run(models.engine("llama", "noisy", max_num_seqs=8), jobs, config)
    pair = models.pair("llama", "noisy")
    per_block = sum(_kv_bytes_per_block(m.config, 16) for m in (pair.target, pair.draft))
    # 10 blocks of 16 positions: the longest request needs 6, one sequence of max_model_len 8.
    engine = models.engine("llama", "noisy", max_num_seqs=8, max_model_len=128, block_size=16,
                           kv_cache_memory=10 * per_block)
    assert 8 <= engine.num_blocks <= 10
    core, tight = _run(engine, jobs, config)
    assert core.num_preemptions >= 3
    assert engine.num_free_blocks == engine.num_blocks and engine.num_free_slots == engine.num_slots
    for i, ((prompt, params), got, expected) in enumerate(zip(jobs, tight, roomy)):
        assert got == expected, f"request {i}"
        if params.greedy:
            ref = models.reference("llama", prompt, params.max_tokens, min_new_tokens=params.min_tokens)
            assert got[0] == ref, f"request {i}"
