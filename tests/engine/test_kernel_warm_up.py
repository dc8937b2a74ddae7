"""An engine on the `triton` backend compiles every variant of the paged kernel when its runners are built, and its
forwards (prefills of any length, the draft's catch-up, drafts and verifies, grouped or mixed) launch no other.

On the GPU of 2026-11-27 each variant first launched in the serving loop was a Triton compile of 1-3 s: the served
default policy stalled up to 2 s at 4 requests/s and lost 0.39x of its throughput in a burst (docs/BENCHMARKS.md
section 0). Here the kernel launch is replaced by its PyTorch reference (the interpreter would take minutes), so what
is tested is which variants the engine's launches ask for, with the key splits an H100 would pick (132
multiprocessors)."""

from __future__ import annotations

import importlib
import random

import pytest

from exspec.engine import backends
from exspec.engine.backends.triton import TritonBackend
from exspec.engine.params import SamplingParams
from exspec.scheduler import SchedulerConfig, generate_offline
from tests.engine.conftest import use_triton
from tests.support.models import random_prompts

kernel_module = importlib.import_module("exspec.engine.kernels.paged_attention")


@pytest.fixture
def launches(monkeypatch):
    """The triton backend on CPU engines, warmed up like on CUDA; each launch recorded as its (BLOCK_M, splits) and
    computed by the reference."""
    use_triton(monkeypatch, cpu_engines=True)
    monkeypatch.setattr(backends, "default_backend", lambda device: "triton")
    monkeypatch.setattr(TritonBackend, "warm_interpreted", True)
    monkeypatch.setattr(kernel_module, "_launched", set())
    monkeypatch.setattr(kernel_module, "_watching", False)
    monkeypatch.setattr(kernel_module, "_gpu_multiprocessors", lambda device: 132)  # an H100's key splits
    seen = []

    def launch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, out, block_m, splits):
        seen.append(kernel_module.launch_key(query, k_cache, window, block_m, splits))
        out.copy_(kernel_module.paged_attention_reference(query, k_cache, v_cache, block_tables, seq_lens, scale, window))

    monkeypatch.setattr(kernel_module, "_launch", launch)
    return seen


@pytest.mark.parametrize("force_mixed", [False, True])
def test_an_engine_launches_only_the_variants_it_warmed_up(models, launches, caplog, force_mixed):
    engine = models.engine("llama", "noisy", max_num_seqs=8, force_mixed=force_mixed)
    warmed = set(launches)
    # tiny llama: 4 heads on 2 kv heads of 16: BLOCK_M 16, 32, 64, each with 1, 2, 4, 8 and 16 key splits; the
    # draft's pools have the target's layout, so they share the target's variants
    assert len(warmed) == 15 and warmed == kernel_module._launched
    launches.clear()
    rng = random.Random(11)
    prompts = random_prompts([1, 2, 7, 8, 9, 16, 17, 40, 70, 3, 5, 12], seed=12)
    params = [SamplingParams(max_tokens=rng.randint(2, 20)) for _ in prompts]
    cfg = SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=3, speculation="fixed")
    results, _ = generate_offline(engine, prompts, params, cfg)
    for prompt, sp, result in zip(prompts, params, results):
        assert result.token_ids == models.reference("llama", prompt, sp.max_tokens)
    assert launches and set(launches) <= warmed
    assert len({key[-2] for key in launches}) == 3  # prefills, drafts and verifies took every BLOCK_M
    assert "after warm_up" not in caplog.text
