"""Presence, frequency and repetition penalties with speculation: at each verify position the target's logits are
penalised for the output so far plus the drafts before that position (what the target alone would have generated
there), and the draft's the same way, so greedy rows are token-identical to a penalised greedy loop over the target
alone, whatever shares the batch, fused prefill and a preemption's recompute included. (Sampling: the exact joint
test in test_engine_sampling.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.support.driver import run_to_end
from tests.support.models import random_prompts
from tests.support.penalties import penalised

from exspec.engine import InvalidRequestError, SamplingParams
from exspec.engine.params import PENALTY_MAX, REPETITION_PENALTY_MAX


def penalised_greedy(models, arch, prompt, n, rep=1.0, freq=0.0, pres=0.0) -> list[int]:
    """The target alone, greedy, penalised: a plain loop over full forwards (fp32)."""
    model = models._ref_model(arch)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(penalised(logits, ids, ids[len(prompt):], rep, freq, pres).argmax()))
    return ids[len(prompt):]


SETTINGS = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.6, presence_penalty=0.3),
            dict(repetition_penalty=0.8, frequency_penalty=-0.2, presence_penalty=0.5)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(("k", "prefill_k"), [(0, 0), (3, 0), (4, 2)])
def test_penalised_greedy_rows_are_the_penalised_target_alone(models, arch, k, prefill_k):
    prompts = random_prompts([7, 3, 11], seed=41)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **kw) for kw in SETTINGS]
    params.append(SamplingParams(max_tokens=16, ignore_eos=True))  # a row without penalties in the same batch
    seqs, _ = run_to_end(models.engine(arch, "noisy"), prompts + [prompts[0]], params, k, prefill_k=prefill_k)
    changed = 0
    for seq, prompt, kw in zip(seqs, prompts, SETTINGS):
        ref = penalised_greedy(models, arch, prompt, 16, kw.get("repetition_penalty", 1.0),
                               kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0))
        assert seq.output_token_ids == ref, kw
        changed += ref != penalised_greedy(models, arch, prompt, 16)
    assert changed >= 2  # the penalties change these outputs
    assert seqs[-1].output_token_ids == penalised_greedy(models, arch, prompts[0], 16)


def test_all_drafts_accepted_under_penalties(models):
    """The "same" draft agrees with the target wherever both see the same penalties: every draft of a greedy
    penalised row is accepted, so the draft's penalties count its own earlier drafts as the verify does."""
    engine = models.engine("llama", "same")
    prompt = random_prompts([9], seed=42)[0]
    kw = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5)
    seqs, outs = run_to_end(engine, [prompt], SamplingParams(max_tokens=17, ignore_eos=True, **kw), 4)
    assert seqs[0].output_token_ids == penalised_greedy(models, "llama", prompt, 17, 1.5, 0.5, 0.5)
    steps = [o for out in outs[1:] for o in out.outputs]
    assert all(o.num_accepted == o.num_draft_tokens for o in steps) and sum(o.num_accepted for o in steps) >= 8


def test_a_recomputed_output_keeps_its_penalties(models):
    """A preemption re-adds prompt + output as the prompt with `recomputed` = the output's length (the
    scheduler's re-add): the continuation equals the uninterrupted run's."""
    engine = models.engine("qwen3", "noisy")
    params = SamplingParams(max_tokens=14, ignore_eos=True, frequency_penalty=1.5, presence_penalty=1.0)
    differs = 0
    for prompt in random_prompts([6, 4, 9, 5, 7, 8], seed=43):
        (whole,), _ = run_to_end(engine, [prompt], params, 3)
        (first,), _ = run_to_end(engine, [prompt], replace(params, max_tokens=5), 3)
        assert first.output_token_ids == whole.output_token_ids[:5]
        again = replace(params, max_tokens=9, recomputed=5)
        (rest,), _ = run_to_end(engine, [prompt + first.output_token_ids], again, 3)
        assert first.output_token_ids + rest.output_token_ids == whole.output_token_ids
        # without `recomputed` the five count as prompt: no frequency or presence penalty for them
        (wrong,), _ = run_to_end(engine, [prompt + first.output_token_ids], replace(again, recomputed=0), 3)
        differs += wrong.output_token_ids != rest.output_token_ids
    assert differs >= 1  # (the tiny model seldom repeats a token: 1 of these 6 prompts shows it)


def test_penalty_bounds(models):
    for kw in (dict(presence_penalty=PENALTY_MAX + 0.1), dict(frequency_penalty=-PENALTY_MAX - 0.1),
               dict(repetition_penalty=0.0), dict(repetition_penalty=REPETITION_PENALTY_MAX + 1),
               dict(presence_penalty=float("nan")), dict(recomputed=-1)):
        with pytest.raises(InvalidRequestError, match=next(iter(kw))):
            SamplingParams(**kw)
    engine = models.engine("llama")
    with pytest.raises(InvalidRequestError, match="recomputed"):
        engine.add(10_000, [5, 6], SamplingParams(recomputed=2))
