"""Logprobs: each emitted token's log-probability under the target and its n most likely alternatives, the same
whether the token came from a speculative step (an accepted draft, a correction, a bonus), a fused prefill or the
target alone, and whatever else shares the batch. Compared with one forward of the target (Hugging Face, fp32)
over the prompt and the output the engine produced."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.support.driver import admit
from tests.support.models import random_prompts

from exspec.engine import InvalidRequestError, PrefillBatch, PrefillChunk, SamplingParams, StepBatch
from exspec.engine.params import MAX_LOGPROBS

ATOL = 1e-4  # fp32: the verify reads k + 1 positions in one forward, the reference the whole sequence


def _run(engine, prompts, params, k: int, prefill_k: int = 0):
    """Admit, prefill together, step until every row has its max_tokens (no stopping rule: the engine's raw
    output). Returns, per row, (output tokens, their logprobs or None)."""
    seqs = [admit(engine, p, prm) for p, prm in zip(prompts, params)]
    out_ids = [[] for _ in seqs]
    out_lps = [[] if prm.logprobs is not None else None for prm in params]

    def take(rows, outputs):
        for i, o in zip(rows, outputs):
            assert (o.logprobs is None) == (params[i].logprobs is None)
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.token_ids)
                out_lps[i].extend(o.logprobs)
            out_ids[i].extend(o.token_ids)

    chunks = tuple(PrefillChunk(s.seq_id, 0, s.prompt_len) for s in seqs)
    take(range(len(seqs)), engine.prefill(PrefillBatch(chunks, num_draft_tokens=prefill_k)).outputs)
    while live := [i for i in range(len(seqs)) if len(out_ids[i]) < params[i].max_tokens]:
        take(live, engine.step(StepBatch(tuple(seqs[i].seq_id for i in live), k)).outputs)
    for s in seqs:
        engine.free(s.seq_id)
    return [(ids[: p.max_tokens], None if lps is None else lps[: p.max_tokens])
            for ids, lps, p in zip(out_ids, out_lps, params)]


def _check(models, arch, prompt, ids, lps, n, greedy=False, atol=ATOL):
    """lps against log_softmax of the target's logits over prompt + ids: the chosen token's value (greedy: the
    largest), and n alternatives that are the n most likely (values in order; each id's own value right)."""
    model = models._ref_model(arch)
    seq = torch.tensor([list(prompt) + ids])
    with torch.inference_mode():
        ref = torch.log_softmax(model(seq).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]  # [len(ids), V]
    assert len(lps) == len(ids)
    for j, (tok, lp) in enumerate(zip(ids, lps)):
        assert abs(lp.logprob - ref[j, tok].item()) < atol, f"position {j}"
        if greedy:
            assert abs(lp.logprob - ref[j].max().item()) < atol, f"position {j}"
        assert len(lp.top) == n
        best = ref[j].topk(n).values.tolist()
        got = [v for _, v in lp.top]
        assert got == sorted(got, reverse=True)
        assert all(abs(a - b) < atol for a, b in zip(got, best)), f"position {j}"
        assert all(abs(v - ref[j, t].item()) < atol for t, v in lp.top), f"position {j}"
        assert len({t for t, _ in lp.top}) == n


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(("k", "prefill_k"), [(0, 0), (3, 0), (3, 2)])
def test_logprobs_are_the_target_s_in_a_mixed_batch(models, arch, k, prefill_k):
    """Rows asking for no logprobs, for the chosen token only, and for 3 and MAX_LOGPROBS alternatives share
    greedy and sampled batches with partial acceptance ("noisy" draft); k = 0 is the target alone."""
    engine = models.engine(arch, "noisy")
    prompts = random_prompts([5, 9, 3, 12, 7], seed=21)
    asks = [None, 0, 3, MAX_LOGPROBS, 1]
    params = [SamplingParams(max_tokens=10, logprobs=n, **({"temperature": 0.9, "seed": 40 + i} if i >= 3 else {}))
              for i, n in enumerate(asks)]
    results = _run(engine, prompts, params, k, prefill_k)
    for (ids, lps), prompt, prm in zip(results, prompts, params):
        if prm.logprobs is None:
            assert lps is None
        else:
            _check(models, arch, prompt, ids, lps, prm.logprobs, greedy=prm.greedy)
    # the same tokens whether or not logprobs were asked for
    plain = _run(models.engine(arch, "noisy"), prompts, [replace(p, logprobs=None) for p in params], k, prefill_k)
    assert [ids for ids, _ in plain] == [ids for ids, _ in results]


def test_speculative_and_target_alone_logprobs_agree(models):
    """The same greedy rows through k = 4 (accepted drafts, corrections, bonuses: the "same" draft accepts all)
    and k = 0: the same tokens and the same logprobs."""
    prompts = random_prompts([6, 11], seed=22)
    params = [SamplingParams(max_tokens=12, logprobs=4)] * 2
    for variant in ("same", "noisy"):
        spec = _run(models.engine("qwen3", variant), prompts, params, 4)
        alone = _run(models.engine("qwen3", variant), prompts, params, 0)
        for (ids_s, lps_s), (ids_a, lps_a) in zip(spec, alone):
            assert ids_s == ids_a
            for s, a in zip(lps_s, lps_a):
                assert abs(s.logprob - a.logprob) < ATOL
                assert [t for t, _ in s.top] == [t for t, _ in a.top] or all(
                    abs(x - y) < ATOL for (_, x), (_, y) in zip(s.top, a.top))


def test_raw_logprobs_ignore_min_tokens(models):
    """min_tokens keeps EOS from being sampled, not from being reported: the logprobs are the raw model's."""
    engine = models.engine("llama", "noisy")
    prompt = random_prompts([8], seed=23)[0]
    ((ids, lps),) = _run(engine, [prompt], [SamplingParams(max_tokens=6, min_tokens=6, logprobs=2)], 2)
    _check(models, "llama", prompt, ids, lps, 2)
    assert all(lp.logprob > float("-inf") for lp in lps)


def test_logprobs_bounds():
    for bad in (-1, MAX_LOGPROBS + 1, 1.5, True):
        with pytest.raises(InvalidRequestError, match="logprobs"):
            SamplingParams(logprobs=bad)
    SamplingParams(logprobs=0)
    SamplingParams(logprobs=MAX_LOGPROBS)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prompt_logprobs_over_chunked_prefills(models, arch):
    """prompt_logprobs: None for the first prompt token, then each token's log-probability and alternatives from
    the prefill's logits at the position before it, the same whether the prompt is prefilled whole or in chunks
    that share batches with rows asking for nothing; the first generated token's come with `logprobs`."""
    engine = models.engine(arch, "noisy")
    prompts = random_prompts([13, 6, 1], seed=24)
    asks = [SamplingParams(max_tokens=3, prompt_logprobs=4, logprobs=1), SamplingParams(max_tokens=3),
            SamplingParams(max_tokens=3, prompt_logprobs=0)]
    seqs = [admit(engine, p, prm) for p, prm in zip(prompts, asks)]
    got = [[] for _ in seqs]
    first = [None] * len(seqs)
    # chunk plans: row 0 in chunks [0, 5) [5, 6) [6, 13); row 1 whole; row 2 (one token) whole
    plans = [[(0, 5), (5, 6), (6, 13)], [(0, 6)], [(0, 1)]]
    for step_i in range(3):
        chunks = [(i, plan[step_i]) for i, plan in enumerate(plans) if step_i < len(plan)]
        out = engine.prefill(PrefillBatch(tuple(PrefillChunk(seqs[i].seq_id, a, b) for i, (a, b) in chunks)))
        for (i, _), o in zip(chunks, out.outputs):
            if asks[i].prompt_logprobs is None:
                assert o.prompt_logprobs is None
            else:
                got[i].extend(o.prompt_logprobs)
            if o.token_ids:
                first[i] = (o.token_ids[0], o.logprobs)
    model = models._ref_model(arch)
    for i in (0, 2):
        prompt, n = prompts[i], asks[i].prompt_logprobs
        assert len(got[i]) == len(prompt) and got[i][0] is None
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([prompt + [first[i][0]]])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt)):
            lp = got[i][p]
            assert abs(lp.logprob - ref[p - 1, prompt[p]].item()) < ATOL, f"row {i}, token {p}"
            assert len(lp.top) == n
            assert all(abs(v - ref[p - 1, t].item()) < ATOL for t, v in lp.top)
            assert all(abs(a - b) < ATOL for (_, a), b in zip(lp.top, ref[p - 1].topk(n).values.tolist()))
    token, logprobs = first[0]
    assert abs(logprobs[0].logprob - torch.log_softmax(
        models._ref_model(arch)(torch.tensor([prompts[0]])).logits[0, -1].float(), -1)[token].item()) < ATOL
    for s in seqs:
        engine.free(s.seq_id)


def test_a_prompt_asking_for_logprobs_is_not_fused(models):
    """A prefill that could verify drafts (k > 0) still reads every prompt position for prompt_logprobs: the
    rows get one token each, as an unfused prefill's."""
    engine = models.engine("llama", "same")
    prompts = random_prompts([7, 7], seed=25)
    seqs = [admit(engine, p, SamplingParams(max_tokens=8, prompt_logprobs=2)) for p in prompts]
    out = engine.prefill(PrefillBatch(tuple(PrefillChunk(s.seq_id, 0, 7) for s in seqs), num_draft_tokens=3))
    assert [len(o.token_ids) for o in out.outputs] == [1, 1]
    assert [len(o.prompt_logprobs) for o in out.outputs] == [7, 7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="logprobs on the device: CUDA only (scripts/gpu_check.sh)")
def test_logprobs_on_the_device(models):
    """The same checks with the engine on CUDA (fp32): the float64 read-back of tokens and logprobs, top-k on the
    device, a fused prefill, prompt logprobs; against the CPU reference within 1e-3."""
    import copy

    from exspec.engine import EngineConfig, ModelPair, SpecEngine

    base = models.pair("llama", "noisy")
    pair = ModelPair(copy.deepcopy(base.target).to("cuda"), copy.deepcopy(base.draft).to("cuda"), base.tokenizer,
                     base.vocab_size, base.eos_token_ids, "fp32")
    target_dir, _ = models.dirs("llama")
    engine = SpecEngine(EngineConfig(model=target_dir, device="cuda", max_num_seqs=16, max_model_len=256), pair=pair)
    prompts = random_prompts([5, 9, 12], seed=26)
    params = [SamplingParams(max_tokens=10, logprobs=3), SamplingParams(max_tokens=10),
              SamplingParams(max_tokens=10, logprobs=2, temperature=0.8, seed=7)]
    for (ids, lps), prompt, prm in zip(_run(engine, prompts, params, 3, prefill_k=2), prompts, params):
        if prm.logprobs is not None:
            _check(models, "llama", prompt, ids, lps, prm.logprobs, greedy=prm.greedy, atol=1e-3)
    seq = admit(engine, prompts[2], SamplingParams(max_tokens=2, prompt_logprobs=2))
    out = engine.prefill(PrefillBatch((PrefillChunk(seq.seq_id, 0, 12),))).outputs[0]
    assert len(out.prompt_logprobs) == 12 and out.prompt_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(models._ref_model("llama")(torch.tensor([prompts[2]])).logits[0].float(), dim=-1)
    assert all(abs(out.prompt_logprobs[p].logprob - ref[p - 1, prompts[2][p]].item()) < 1e-3 for p in range(1, 12))
    engine.free(seq.seq_id)


def test_ngram_lookup_logprobs_are_the_target_s(models):
    """speculative_method "ngram" packs each row's next lookup match into the step's one read, beside the tokens and
    their logprobs: the logprobs are still the target's, and the tokens the same as without logprobs."""
    import dataclasses

    from exspec.engine import SpecEngine

    cfg = dataclasses.replace(models.config("llama"), draft_model=None, speculative_method="ngram")

    def engine():
        return SpecEngine(cfg, pair=dataclasses.replace(models.pair("llama"), draft=None))

    prompts = [[4, 5, 6, 4, 5, 6, 4], [7, 8, 9, 10], [11, 12, 11, 12, 11]]
    asks = [2, None, MAX_LOGPROBS]
    params = [SamplingParams(max_tokens=14, logprobs=n, **({"temperature": 0.9, "seed": 3} if i == 2 else {}))
              for i, n in enumerate(asks)]
    results = _run(engine(), prompts, params, 3)
    for (ids, lps), prompt, prm in zip(results, prompts, params):
        if prm.logprobs is not None:
            _check(models, "llama", prompt, ids, lps, prm.logprobs, greedy=prm.greedy)
    plain = _run(engine(), prompts, [replace(p, logprobs=None) for p in params], 3)
    assert [ids for ids, _ in plain] == [ids for ids, _ in results]
