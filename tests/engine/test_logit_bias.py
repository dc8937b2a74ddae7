"""logit_bias: added to the target's and the draft's logits, so a speculative row's output is the target alone's
under the same bias (greedy: token-identical to a biased greedy loop over the target; sampling: a banned token never
drawn, a forced one always), whatever shares the batch; and with min_tokens on the same rows."""

from __future__ import annotations

import pytest
import torch
from tests.support.driver import run_to_end
from tests.support.models import random_prompts

from exspec.engine import InvalidRequestError, SamplingParams
from exspec.engine.params import LOGIT_BIAS_MAX


def _biased_greedy(models, arch, prompt, n, bias: dict[int, float]) -> list[int]:
    """The target alone, greedy, with `bias` added to its logits: a plain loop over full forwards (fp32)."""
    model = models._ref_model(arch)
    add = torch.zeros(model.config.vocab_size)
    for t, v in bias.items():
        add[t] = v
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int((logits + add[: logits.shape[0]]).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [0, 3])
def test_biased_greedy_rows_are_the_biased_target_alone(models, arch, k):
    prompts = random_prompts([6, 10, 4], seed=31)
    plain = [_biased_greedy(models, arch, p, 12, {}) for p in prompts]
    # ban each row's most frequent unbiased token, push two others up
    biases = []
    for out in plain:
        top = max(set(out), key=out.count)
        biases.append({top: -LOGIT_BIAS_MAX, 17: 4.0, 101: 2.5})
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=tuple(sorted(b.items()))) for b in biases]
    params.append(SamplingParams(max_tokens=12, ignore_eos=True))  # a row without bias in the same batch
    prompts_all = prompts + [prompts[0]]
    seqs, _ = run_to_end(models.engine(arch, "noisy"), prompts_all, params, k)
    for seq, prompt, bias, out in zip(seqs, prompts, biases, plain):
        assert seq.output_token_ids == _biased_greedy(models, arch, prompt, 12, bias)
        assert seq.output_token_ids != out and min(bias, key=bias.get) not in seq.output_token_ids
    assert seqs[-1].output_token_ids == plain[0]


def test_sampled_rows_never_draw_a_banned_token_and_always_a_forced_one(models):
    prompts = random_prompts([5] * 8, seed=32)
    free = [SamplingParams(max_tokens=16, temperature=1.5, seed=i, ignore_eos=True) for i in range(8)]
    seqs, _ = run_to_end(models.engine("llama", "noisy"), prompts, free, 3)
    drawn = [t for s in seqs for t in s.output_token_ids]
    banned = max(set(drawn), key=drawn.count)  # the token these seeds draw most without a bias
    forced = min(range(8, 300), key=drawn.count)  # one they (nearly) never draw
    ban = [SamplingParams(max_tokens=16, temperature=1.5, seed=i, ignore_eos=True,
                          logit_bias=((banned, -LOGIT_BIAS_MAX),)) for i in range(4)]
    force = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True, min_tokens=4,
                            logit_bias=((forced, LOGIT_BIAS_MAX),)) for i in range(4, 8)]
    seqs, _ = run_to_end(models.engine("llama", "noisy"), prompts, ban + force, 3)
    assert drawn.count(banned) >= 4 and all(banned not in s.output_token_ids for s in seqs[:4])
    assert all(set(s.output_token_ids) == {forced} for s in seqs[4:])


def test_logit_bias_bounds(models):
    for bad in (((1, 100.5),), ((1, float("nan")),), ((-1, 1.0),), ((3, 1.0), (3, 2.0)), ((1.0, 1.0),)):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    engine = models.engine("llama")
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.check_params(SamplingParams(logit_bias=((engine.vocab_size, 1.0),)))
    engine.check_params(SamplingParams(logit_bias=((engine.vocab_size - 1, -100.0), (0, 100.0))))
