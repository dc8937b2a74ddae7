"""EngineConfig.compile_mode "cudagraph": the static draft and verify forwards recorded into torch.cuda.CUDAGraphs
directly (engine/static_forward.py `StaticForward.capture`), no compiler. CUDA only: on the CPU the mode is refused
and the GPU case skips; scripts/gpu_check.sh runs it on a GPU (passed on an H100, 2026-11-27)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tests.support.models import random_prompts

from exspec.engine import EngineConfig, ModelPair, SamplingParams, SpecEngine
from exspec.engine.config import COMPILE_MODES
from exspec.engine.static_forward import StaticForward
from exspec.errors import ConfigError
from exspec.scheduler import SchedulerConfig, generate_offline


def test_compile_mode_is_checked_and_cudagraph_needs_cuda():
    assert COMPILE_MODES[0] == EngineConfig(model="m").compile_mode == "inductor"
    with pytest.raises(ConfigError, match="compile_mode must be one of inductor, cudagraph"):
        EngineConfig(model="m", compile=True, compile_mode="graphs")
    with pytest.raises(ConfigError, match="compile_mode 'cudagraph' needs a CUDA device"):
        EngineConfig(model="m", compile=True, compile_mode="cudagraph")


@pytest.mark.models
def test_capture_refuses_a_cpu_runner(models):
    engine = models.engine("llama", "draft", max_num_seqs=2, max_model_len=32, attention="reference")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticForward(engine.target, 2, 3).capture()


@pytest.mark.models
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: CUDA only")
def test_cudagraph_engine_matches_eager_in_fp32_on_cuda(models):
    """fp32 on the GPU, the same prompts through the engine eager and with every static forward captured: identical
    greedy outputs, each static forward holding a graph, speculation running (acceptance above 1)."""
    base = models.pair("llama", "noisy")
    pair = ModelPair(copy.deepcopy(base.target).to("cuda").eval(), copy.deepcopy(base.draft).to("cuda").eval(),
                     base.tokenizer, base.vocab_size, base.eos_token_ids, "cuda")
    target_dir, _ = models.dirs("llama")
    rng = random.Random(5)
    prompts = random_prompts([rng.randint(1, 60) for _ in range(12)], seed=17)
    outputs = {}
    for mode in ("eager", "cudagraph"):
        compiled = dict(compile=True, compile_mode="cudagraph") if mode == "cudagraph" else {}
        engine = SpecEngine(EngineConfig(model=target_dir, device="cuda", dtype="float32", max_num_seqs=8,
                                         max_model_len=160, max_num_speculative_tokens=3, **compiled), pair=pair)
        if mode == "cudagraph":  # every graph captured when the engine starts
            assert set(engine._static) == set(engine.static_keys())
        results, summary = generate_offline(
            engine, prompts, [SamplingParams(max_tokens=16)] * len(prompts),
            SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=3, speculation="fixed"),
        )
        assert all(r.error is None for r in results) and summary.mean_acceptance_length > 1.0
        outputs[mode] = [r.token_ids for r in results]
        if mode == "cudagraph":
            assert set(engine._static) == set(engine.static_keys())  # none built in the loop
            assert all(s.graph is not None for s in engine._static.values())
    assert outputs["cudagraph"] == outputs["eager"]


def _run_every_k(engine, max_k: int) -> None:
    """Prompts at every batch size up to the engine's slots, fixed k = 0 .. max_k in turn (each k its own run)."""
    rng = random.Random(3)
    prompts = random_prompts([rng.randint(1, 30) for _ in range(7)], seed=23)
    for k in range(max_k + 1):
        for batch in (1, 2, 3, 4):
            results, _ = generate_offline(
                engine, prompts[:batch], [SamplingParams(max_tokens=6)] * batch,
                SchedulerConfig(max_batch_size=batch, pool_size=4, num_speculative_tokens=k, speculation="fixed"),
            )
            assert all(r.error is None for r in results)


@pytest.mark.models
def test_static_keys_hold_every_forward_a_step_runs_and_prepare_builds_them_all(models, monkeypatch):
    """compile_mode "cudagraph" captures `static_keys` when the engine starts (prepare_static), so that no request
    waits for a capture in the serving loop (the first GPU load test's stall). On the CPU, with the compiler stubbed
    out (static forwards run eager): a workload over every batch size, k and full accepts (the draft's width-2 first
    forward) builds only keys in `static_keys`; after prepare_static it builds none."""
    built: list[tuple[int, int]] = []
    monkeypatch.setattr(StaticForward, "compile", lambda self, **options: built.append((self.bucket, self.q_len)))
    max_k = 3
    config = dict(max_num_seqs=4, max_model_len=64, max_num_speculative_tokens=max_k, compile=True)
    lazy = models.engine("llama", "same", **config)  # draft = target: every draft accepted, width 2 next step
    assert lazy._static == {}  # compile_mode "inductor" builds at first use
    _run_every_k(lazy, max_k)
    keys = lazy.static_keys()
    assert len(keys) == len(set(keys)) == 3 * (max_k + 1 + 2)  # buckets 1, 2, 4; verify Q 1..k+1; draft Q 1, 2
    assert set(lazy._static) <= set(keys)
    assert (True, 1, 2) in lazy._static and (False, 4, max_k + 1) in lazy._static  # full accepts and k = max_k ran
    assert len(built) == len(lazy._static)

    eager = models.engine("llama", "same", **config)
    built.clear()
    assert eager.prepare_static() == len(keys) and set(eager._static) == set(keys) and len(built) == len(keys)
    _run_every_k(eager, max_k)
    assert len(built) == len(keys) and eager.prepare_static() == 0  # nothing built after the start
