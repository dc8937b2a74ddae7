"""Host syncs the engine's bookkeeping would make on CUDA, seen on the CPU. On CUDA a Python number written into a
device tensor (`t[i] = 0.5`) is a copy from pageable memory that waits for the queued kernels, and `.item()` waits
too: an H100 trace (2026-11-27, scripts/profile_gpu_step.py) found four a request at admission, beside the step's
one. Nothing waits on the CPU, but the ops that would are visible to a dispatch mode: a copy_ from a 0-dim CPU tensor
(a wrapped Python number; `t[a:b] = x` is a fill_ instead, which reads the number on the host and does not wait) and
_local_scalar_dense (`.item()`)."""

from __future__ import annotations

import pytest
import torch
from tests.support.driver import admit, prefill, step
from tests.support.models import random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from exspec.engine import SamplingParams

aten = torch.ops.aten


class WaitingOps(TorchDispatchMode):
    """Records the ops that make the host wait for the device when the tensors are on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default:
            self.seen.append("item")
        elif func is aten.copy_.default and args[1].dim() == 0 and args[1].device.type == "cpu":
            self.seen.append(f"{func} of a Python number")
        return func(*args, **(kwargs or {}))


OPTIONS = {"plain": {}, "logprobs": dict(logprobs=3, prompt_logprobs=2),
           "adjusted": dict(logit_bias=((5, 1.5), (9, -2.0)), presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2, min_tokens=3)}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_a_request_s_life_writes_no_number_from_the_host_and_reads_no_item(models, options):
    """Admission, prefill, decode steps and release: the step's one read (`.tolist()` of the sampled tokens, with
    their logprobs where asked for; not a dispatched op) is the only wait the host would make, with logprobs, and
    with logit_bias, the penalties and min_tokens adjusting the logits."""
    engine = models.engine("llama", "noisy")
    params = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=3, **OPTIONS[options])
    watch = WaitingOps()
    with watch:
        seqs = [admit(engine, p, params) for p in random_prompts([6, 9, 7], seed=5)]
        prefill(engine, [(s, 0, s.length) for s in seqs], k=2)
        step(engine, seqs, 2)
        for s in seqs:
            engine.free(s.seq_id)
    assert watch.seen == []
    # the mode sees what it looks for: the writes these replaced
    with watch:
        engine.temperature[0] = 0.5
        engine.seeds[:1].sum().item()
    assert len(watch.seen) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_ngram_lookup_steps_write_no_number_from_the_host_and_read_no_item(models, temperature):
    """`speculative_method="ngram"`: the lookup (engine/lookup.py), its one-hot q, the next step's match and a plain
    step's shadow proposal add no wait to a step."""
    import dataclasses

    from exspec.engine import SpecEngine

    cfg = dataclasses.replace(models.config("llama"), draft_model=None, speculative_method="ngram")
    engine = SpecEngine(cfg, pair=dataclasses.replace(models.pair("llama"), draft=None))
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3)
    watch = WaitingOps()
    with watch:
        seqs = [admit(engine, p, params) for p in ([4, 5, 6, 4, 5], [7, 8, 7, 8, 7, 8], [9, 10, 11])]
        prefill(engine, [(s, 0, s.length) for s in seqs])
        step(engine, seqs, 3)
        step(engine, seqs, 0)  # a step without drafts still looks up (what it would have proposed)
        step(engine, seqs, 3)
    assert watch.seen == []
