"""Speculation by n-gram lookup (`speculative_method="ngram"`, engine/lookup.py): the vectorised lookup against a
plain-Python one, greedy outputs token-identical to the target alone, samples with the target's distribution."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tests.engine.test_engine_equivalence import assert_matches_reference
from tests.engine.test_engine_sampling import ALPHA, N_BATCH, N_ROUNDS, V, exact_joint, g_test_pvalue, sample_three
from tests.support.driver import admit, prefill, run_to_end, step
from tests.support.models import ARCHS

from exspec.engine import EngineConfig, ModelPair, SamplingParams, SpecEngine
from exspec.engine.lookup import propose_ngram
from exspec.errors import ConfigError


def lookup_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int] | None:
    """The lookup, one row, plainly: the longest suffix of length max_n .. min_n that occurred before (the most
    recent occurrence whose next token is known); then k tokens copied from after it, the copy reading its own
    proposals where it runs past the end. None: no match."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if L <= n:
            continue
        suffix = tokens[L - n:]
        for j in range(L - n - 1, -1, -1):
            if tokens[j:j + n] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[j + n + i])
                return ext[L:]
    return None


def test_lookup_matches_plain_python():
    rng = random.Random(0)
    for case in range(300):
        B, T = rng.randint(1, 5), rng.randint(1, 40)
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies match often, large ones seldom
        k, max_n = rng.randint(1, 6), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        hist = torch.tensor([[rng.randrange(vocab) for _ in range(T)] for _ in range(B)])
        lengths = torch.tensor([rng.randint(1, T) for _ in range(B)])
        tokens, valid = propose_ngram(hist, lengths, k, min_n, max_n)
        assert tokens.shape == valid.shape == (B, k)
        for b in range(B):
            ref = lookup_reference(hist[b, : lengths[b]].tolist(), k, min_n, max_n)
            assert bool(valid[b, 0]) == (ref is not None), (case, b)
            assert valid[b].all() == valid[b, 0]
            if ref is not None:
                assert tokens[b].tolist() == ref, (case, b)


def test_lookup_semantics():
    # longest suffix wins over a more recent shorter one; the most recent of equal length wins
    hist = torch.tensor([[1, 2, 3, 9, 8, 3, 7, 0, 2, 3]])
    tokens, valid = propose_ngram(hist, torch.tensor([10]), 2, 1, 4)
    assert valid.all() and tokens.tolist() == [[9, 8]]  # [2, 3] at 1-2, not [3] at 5
    tokens, _ = propose_ngram(hist, torch.tensor([10]), 2, 1, 1)
    assert tokens.tolist() == [[7, 0]]  # [3] most recently at 5
    # a loop: the copy goes on through its own proposals
    tokens, _ = propose_ngram(torch.tensor([[5, 6, 7, 5, 6, 7, 5]]), torch.tensor([7]), 5, 1, 3)
    assert tokens.tolist() == [[6, 7, 5, 6, 7]]
    # positions past a row's length are never read; nothing matches -> not valid
    hist = torch.tensor([[1, 2, 3, 1, 2, 3], [4, 5, 6, 4, 0, 0]])
    tokens, valid = propose_ngram(hist, torch.tensor([3, 4]), 3, 1, 2)
    assert valid.tolist() == [[False] * 3, [True] * 3] and tokens[1].tolist() == [5, 6, 4]


def ngram_engine(models, arch: str, **overrides) -> SpecEngine:
    cfg = dataclasses.replace(models.config(arch), draft_model=None, speculative_method="ngram", **overrides)
    return SpecEngine(cfg, pair=dataclasses.replace(models.pair(arch), draft=None))


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (so the lookup proposes) around random tokens (so it also fails)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(4, 200) for _ in range(rng.randint(2, 6))]
        prompt = []
        for _ in range(rng.randint(2, 5)):
            prompt += phrase + [rng.randrange(4, 200) for _ in range(rng.randint(0, 3))]
        prompts.append(prompt)
    return prompts


@pytest.mark.usefixtures("attention_backend")  # every backend that runs on the CPU (tests/engine/conftest.py)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_greedy_matches_target(models, arch, k):
    prompts = repetitive_prompts(9, seed=3)
    max_tokens = [24, 5, 17, 24, 1, 12, 24, 8, 20]
    engine = ngram_engine(models, arch)
    assert engine.has_draft and engine.draft is None
    seqs, outs = run_to_end(engine, prompts, [SamplingParams(max_tokens=m) for m in max_tokens], k)
    assert_matches_reference(models, arch, prompts, seqs, max_tokens)
    accepted = sum(o.num_accepted for out in outs[1:] for o in out.outputs)
    drafted = sum(o.num_draft_tokens for out in outs[1:] for o in out.outputs)
    assert accepted < drafted  # proposals refused (or none made)
    if arch != "gpt2":  # the tiny random GPT-2 rarely repeats itself (1 accepted of 824 at k = 4): the others do
        assert accepted > 0
    assert all(out.catchup_s == 0.0 for out in outs[1:])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_without_a_match_draft_nothing_and_a_step_without_any_verifies_one_column(models, temperature):
    """The engine looks each row up again when it commits (`ngram_match`, read with the step's tokens): in the next
    step a row whose lookup matches nothing drafts nothing (num_draft_tokens 0), and a step where no row matches runs
    as plain decoding (k = 0: one verify column), whatever k was asked for. Checked against the plain-Python lookup
    on each row's tokens before every step, on prompts that repeat (matches) and prompts that do not."""
    engine = ngram_engine(models, "llama")
    k, lo, hi = 3, engine.config.prompt_lookup_min, engine.config.prompt_lookup_max
    params = SamplingParams(max_tokens=30, temperature=temperature, seed=1, ignore_eos=True)
    rng = random.Random(5)
    distinct = [rng.sample(range(4, 200), n) for n in (5, 9, 7)]  # no token twice: no match until the output repeats
    prompts = repetitive_prompts(3, seed=4) + distinct
    seqs = [admit(engine, p, params) for p in prompts]
    prefill(engine, [(s, 0, s.length) for s in seqs])
    widths, seen = [], {True: 0, False: 0}
    for _ in range(12):
        for group in (seqs, seqs[3:]):  # the whole batch, and the prompts without repeats alone
            live = [s for s in group if not s.finished]
            if not live:
                continue
            expect = [lookup_reference(s.token_ids, k, lo, hi) is not None for s in live]
            out = step(engine, live, k)
            assert [o.num_draft_tokens for o in out.outputs] == [k if e else 0 for e in expect]
            assert out.num_draft_tokens == (k if any(expect) else 0)
            for e in expect:
                seen[e] += 1
            widths.append(out.num_draft_tokens)
    assert seen[True] > 0 and seen[False] > 0
    assert 0 in widths and k in widths  # steps without any match ran plain, others drafted


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_step_without_drafts_reports_what_the_lookup_would_have_proposed(models, temperature):
    """k = 0 steps with lookup: `shadow_proposed` counts the rows whose lookup proposes a first token, and
    `shadow_accepted` those whose proposal is the token the target then chose (plain-Python lookup as reference)."""
    engine = ngram_engine(models, "llama")
    lo, hi = engine.config.prompt_lookup_min, engine.config.prompt_lookup_max
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=2, ignore_eos=True)
    seqs = [admit(engine, p, params) for p in repetitive_prompts(5, seed=6)]
    prefill(engine, [(s, 0, s.length) for s in seqs])
    totals = [0, 0]
    for _ in range(25):
        live = [s for s in seqs if not s.finished]
        firsts = [lookup_reference(s.token_ids, 1, lo, hi) for s in live]
        out = step(engine, live, 0)
        assert out.num_draft_tokens == 0 and all(len(o.token_ids) == 1 for o in out.outputs)
        assert out.shadow_proposed == sum(f is not None for f in firsts)
        assert out.shadow_accepted == sum(f is not None and f[0] == o.token_ids[0] for f, o in zip(firsts, out.outputs))
        totals[0] += out.shadow_proposed
        totals[1] += out.shadow_accepted
    assert totals[1] < totals[0] and (totals[1] > 0 or temperature > 0)  # the tiny model samples near-uniformly
    assert step(engine, [s for s in seqs if not s.finished], 2).shadow_proposed == 0  # drafting steps: none


def test_a_lookup_engine_without_drafts_looks_nothing_up(models):
    """speculative_method "ngram" with max_num_speculative_tokens 0 (a server's `--num-speculative-tokens 0`, the load
    test's baseline): no lookup at commit and no shadow proposals, so plain decoding pays nothing for the method; the
    tokens and logprobs are the target's."""
    engine = ngram_engine(models, "llama", max_num_speculative_tokens=0)
    assert engine.max_k == 0 and not engine.lookahead
    params = SamplingParams(max_tokens=6, logprobs=2)
    seqs = [admit(engine, p, params) for p in repetitive_prompts(3, seed=2)]
    out = prefill(engine, [(s, 0, s.length) for s in seqs])
    assert all(not o.drafts_next and len(o.logprobs) == 1 for o in out.outputs)
    for _ in range(5):
        out = step(engine, seqs, 3)
        assert out.num_draft_tokens == 0 and out.shadow_proposed == 0
        assert all(not o.drafts_next and len(o.logprobs) == 1 for o in out.outputs)
    assert all(engine._seqs[s.seq_id].lookup_n == -1 for s in seqs)
    for s in seqs:
        assert s.output_token_ids == models.reference("llama", s.token_ids[: s.prompt_len], 6)


def test_ngram_config_checks(models):
    target, draft = models.dirs("llama")
    with pytest.raises(ConfigError, match="without a draft model"):
        EngineConfig(model=target, draft_model=draft, speculative_method="ngram")
    with pytest.raises(ConfigError, match="speculative_method must be one of"):
        EngineConfig(model=target, speculative_method="eagle")
    for lo, hi in ((0, 3), (3, 2), (1, 17)):
        with pytest.raises(ConfigError, match="prompt_lookup_min and prompt_lookup_max"):
            EngineConfig(model=target, speculative_method="ngram", prompt_lookup_min=lo, prompt_lookup_max=hi)


@pytest.mark.parametrize("k, temperature, top_k, top_p", [(3, 1.0, 0, 1.0), (2, 0.7, 5, 0.9)], ids=["plain", "all"])
def test_ngram_samples_follow_target_distribution(small_models, k, temperature, top_k, top_p):
    """A lookup proposal is certain (q one-hot): accepted with probability p(d), else the token is drawn from p
    without d. The prompt [1, 5, 3, 6, 2] makes the lookup propose whenever token 1 or 2 repeats a prompt token.
    The device's default attention backend only: the lookup does not touch attention (under Triton's CPU
    interpreter this case took 772 s)."""
    target, _ = small_models
    pair = ModelPair(target=target, draft=None, tokenizer=None, vocab_size=V, eos_token_ids=(), name="small")
    cfg = EngineConfig(model="unused", max_num_seqs=N_BATCH, max_model_len=16, max_num_speculative_tokens=4,
                       speculative_method="ngram")
    counts, proposed, accepted, corrected = sample_three(SpecEngine(cfg, pair=pair), k, temperature, top_k, top_p)
    assert int(counts.sum()) == N_BATCH * N_ROUNDS
    joint = exact_joint(target, temperature, top_k, top_p)
    assert g_test_pvalue(counts.sum(0), joint.sum(0)) > ALPHA  # tokens 2 and 3, from steps
    assert g_test_pvalue(counts, joint) > ALPHA
    assert 0.02 < accepted / proposed < 0.9 and corrected > N_BATCH  # proposals accepted and refused
    # Power: the same samples are unmistakably not from the target at another temperature.
    assert g_test_pvalue(counts, exact_joint(target, temperature * 1.5, top_k, top_p)) < ALPHA


@pytest.fixture(scope="module")
def small_models():
    from tests.engine.test_engine_sampling import _small_lm

    return _small_lm(seed=1, layers=2, sharpen=6.0), None
