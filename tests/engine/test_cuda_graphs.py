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
        results, summary = generate_offline(
            engine, prompts, [SamplingParams(max_tokens=16)] * len(prompts),
            SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=3, speculation="fixed"),
        )
        assert all(r.error is None for r in results) and summary.mean_acceptance_length > 1.0
        outputs[mode] = [r.token_ids for r in results]
        if mode == "cudagraph":
            assert engine._static and all(s.graph is not None for s in engine._static.values())
    assert outputs["cudagraph"] == outputs["eager"]
