"""Speculative sampling emits tokens with exactly the target's own distribution.

On a vocabulary of 8 tokens the exact joint distribution of the first three generated tokens is computed
by enumeration from the target's softmax (after temperature, top-k, top-p), and compared with the
engine's samples (thousands of sequences, one seed each) by a G-test at p = 1e-3. Token 1 comes from
prefill; tokens 2 and 3 from speculative steps, after rejections for most rows (the draft is a different
random model). The same samples are also checked against the draft's joint, which the test must reject:
it has the power to see a wrong distribution.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.support.driver import run_to_end
from tests.support.models import random_prompts
from scipy.stats import chi2

from exspec.engine import EngineConfig, ModelPair, SamplingParams, SpecEngine
from exspec.engine.sampling import RowParams, process_probs

# Every scenario runs with every attention backend that runs on the CPU (tests/engine/conftest.py).
pytestmark = pytest.mark.usefixtures("attention_backend")

V = 8  # vocabulary of the small models
PROMPT = [1, 5, 3, 6, 2]
N_BATCH, N_ROUNDS = 2048, 4  # 8192 samples per configuration
ALPHA = 1e-3


def _small_lm(seed: int, layers: int, sharpen: float) -> torch.nn.Module:
    from exspec.engine.random_model import causal_lm_config, random_causal_lm

    cfg = causal_lm_config("llama", V, layers=layers, hidden=32, intermediate=64, heads=2, kv_heads=1, positions=64,
                           tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = random_causal_lm(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # random init is near-uniform: make the distributions uneven
    return model


@pytest.fixture(scope="module")
def small_models():
    return _small_lm(seed=1, layers=2, sharpen=6.0), _small_lm(seed=2, layers=1, sharpen=6.0)


def small_engine(target, draft, max_num_seqs: int = N_BATCH, max_k: int = 4) -> SpecEngine:
    pair = ModelPair(target=target, draft=draft, tokenizer=None, vocab_size=V, eos_token_ids=(), name="small")
    cfg = EngineConfig(model="unused", max_num_seqs=max_num_seqs, max_model_len=16, max_num_speculative_tokens=max_k)
    return SpecEngine(cfg, pair=pair)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The textbook sampling distribution: softmax(logits / T), keep the top_k largest, then the smallest
    most-likely set whose mass reaches top_p; renormalise. logits [..., V] -> probs [..., V] (float64)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exact_joint(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) by enumeration: one forward over all V*V continuations. -> [V, V, V]"""
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()  # [V*V, len + 2, V]
    probs = filtered_probs(logits[:, -3:], temperature, top_k, top_p).reshape(V, V, 3, V)  # [t1, t2, 3, V]
    p1 = probs[0, 0, 0]  # [V]
    p2 = probs[:, 0, 1]  # [t1, V]
    p3 = probs[:, :, 2]  # [t1, t2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def g_test_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """G-test of observed counts against probabilities; cells with expected < min_expected are pooled into
    one bin (cells of probability 0 must stay empty: any count there fails outright)."""
    counts, probs = counts.reshape(-1).double(), probs.reshape(-1).double()
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < min_expected:  # too little pooled mass to test on its own: fold it into the largest bin
        j = int(exp[:-1].argmax())
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    nz = obs > 0
    g = 2.0 * float((obs[nz] * torch.log(obs[nz] / exp[nz])).sum())
    dof = len(obs) - 1
    return float(chi2.sf(g, dof))


def sample_three(engine: SpecEngine, k: int, temperature: float, top_k: int, top_p: float, prefill_k: int = 0,
                 **extra):
    """N_BATCH * N_ROUNDS sequences (seeds 0, 1, ...), 3 tokens each (`extra`: more SamplingParams fields).
    Returns counts [V, V, V], the number of draft tokens proposed and accepted, and how many rows emitted token
    2 after a rejection."""
    counts = torch.zeros(V, V, V, dtype=torch.long)
    proposed = accepted = corrected = 0
    for r in range(N_ROUNDS):
        params = [
            SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=r * N_BATCH + i,
                           **extra)
            for i in range(N_BATCH)
        ]
        seqs, outs = run_to_end(engine, [PROMPT] * N_BATCH, params, k, prefill_k=prefill_k)
        assert outs[0].num_draft_tokens == prefill_k  # the prefill verified drafts where asked to
        toks = torch.tensor([s.output_token_ids for s in seqs])  # [N_BATCH, 3]
        counts += torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V**3).reshape(V, V, V)
        first_step = outs[1].outputs
        corrected += sum(o.num_accepted < o.num_draft_tokens for o in first_step)
        proposed += sum(o.num_draft_tokens for out in outs[1:] for o in out.outputs)
        accepted += sum(o.num_accepted for out in outs[1:] for o in out.outputs)
    return counts, proposed, accepted, corrected


@pytest.mark.parametrize(
    "k, temperature, top_k, top_p",
    [(3, 1.0, 0, 1.0), (2, 1.0, 3, 1.0), (3, 1.0, 0, 0.8), (4, 0.7, 5, 0.9)],
    ids=["plain", "top_k", "top_p", "all"],
)
def test_speculative_samples_follow_target_distribution(small_models, k, temperature, top_k, top_p):
    target, draft = small_models
    engine = small_engine(target, draft)
    counts, proposed, accepted, corrected = sample_three(engine, k, temperature, top_k, top_p)
    n = N_BATCH * N_ROUNDS
    assert int(counts.sum()) == n

    joint = exact_joint(target, temperature, top_k, top_p)
    assert math.isclose(float(joint.sum()), 1.0, rel_tol=1e-9)
    # The first token (from prefill) on its own, then the whole joint (tokens 2 and 3 from steps).
    assert g_test_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > ALPHA
    assert g_test_pvalue(counts.sum(0), joint.sum(0)) > ALPHA  # tokens 2 and 3
    assert g_test_pvalue(counts, joint) > ALPHA

    # The draft disagrees often: most rows went through a rejection, yet some drafts were accepted.
    assert 0.05 < accepted / proposed < 0.9
    assert corrected > n // 4
    # Power: the same samples are unmistakably not from the draft's distribution.
    assert g_test_pvalue(counts, exact_joint(draft, temperature, top_k, top_p)) < ALPHA


@pytest.mark.parametrize("k, temperature, top_k, top_p", [(2, 1.0, 0, 1.0), (3, 0.7, 5, 0.9)], ids=["plain", "all"])
def test_fused_prefill_samples_follow_target_distribution(small_models, k, temperature, top_k, top_p):
    """The prefill forward verifies k drafts (the engine's fused prefill): its first k + 1 tokens, accepted or
    resampled after a rejection, follow the target's joint distribution as a step's do."""
    target, draft = small_models
    engine = small_engine(target, draft)
    counts, *_ = sample_three(engine, k, temperature, top_k, top_p, prefill_k=k)
    assert int(counts.sum()) == N_BATCH * N_ROUNDS
    joint = exact_joint(target, temperature, top_k, top_p)
    assert g_test_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > ALPHA
    assert g_test_pvalue(counts, joint) > ALPHA
    assert g_test_pvalue(counts, exact_joint(draft, temperature, top_k, top_p)) < ALPHA  # power


def penalised_joint(model, temperature: float, rep: float, freq: float, pres: float) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) by enumeration, each token's logits penalised as vLLM does for the target alone:
    repetition over the prompt and the tokens before it, frequency and presence over those tokens. -> [V, V, V]"""
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()[:, -3:]  # [V*V, 3, V]: the logits of t1, t2, t3
    onehot = torch.nn.functional.one_hot(ids[:, -2:], V).double()  # [V*V, 2, V]
    counts = torch.stack([torch.zeros(V * V, V, dtype=torch.float64), onehot[:, 0], onehot.sum(1)], dim=1)
    seen = (torch.bincount(torch.tensor(PROMPT), minlength=V).double() + counts) > 0  # [V*V, 3, V]
    x = logits.double()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x) - freq * counts - pres * (counts > 0).double()
    probs = torch.softmax(x / temperature, dim=-1).reshape(V, V, 3, V)
    return probs[0, 0, 0][:, None, None] * probs[:, 0, 1][:, :, None] * probs[:, :, 2]


@pytest.mark.parametrize("prefill_k", [0, 2])
def test_penalised_samples_follow_the_penalised_target(small_models, prefill_k):
    """Penalties with speculation (k = 3; the fused prefill's k = 2 as well): the joint of three tokens is the
    target alone's under the same penalties, each verify column penalised for the drafts before it; and the samples
    are unmistakably not from the unpenalised target's joint (power)."""
    target, draft = small_models
    kw = dict(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.5)
    counts, proposed, accepted, _ = sample_three(small_engine(target, draft), 3, 1.0, 0, 1.0, prefill_k, **kw)
    assert int(counts.sum()) == N_BATCH * N_ROUNDS and 0.05 < accepted / proposed < 0.9
    joint = penalised_joint(target, 1.0, 1.4, 0.7, 0.5)
    assert math.isclose(float(joint.sum()), 1.0, rel_tol=1e-9)
    assert g_test_pvalue(counts, joint) > ALPHA
    assert g_test_pvalue(counts, exact_joint(target, 1.0, 0, 1.0)) < ALPHA


def test_statistical_check_has_power(small_models):
    """Plain target sampling (no draft) at temperature 1.2 passes against its own joint, and the same
    samples fail against the temperature-1 joint and against a top-k = 6 joint: the check sees errors
    of that size."""
    target, _ = small_models
    engine = small_engine(target, None)  # no draft: every token is a plain target sample
    counts, *_ = sample_three(engine, 0, 1.2, 0, 1.0)
    assert g_test_pvalue(counts, exact_joint(target, 1.2, 0, 1.0)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(target, 1.0, 0, 1.0)) < ALPHA
    assert g_test_pvalue(counts, exact_joint(target, 1.2, 6, 1.0)) < ALPHA


def test_identical_draft_accepts_everything_when_sampling(small_models):
    target, _ = small_models
    engine = small_engine(target, target, max_num_seqs=64)
    prompts = [PROMPT[: 1 + i % 5] for i in range(64)]
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, top_k=(0, 4)[i % 2], top_p=(1.0, 0.9)[i % 3 == 0], seed=i)
        for i in range(64)
    ]
    _, outs = run_to_end(engine, prompts, params, 4)
    for out in outs[1:]:
        assert out.accepted_per_position == (out.batch_size,) * 4
        assert all(o.num_accepted == 4 for o in out.outputs)


def test_seeded_request_is_the_same_alone_and_in_any_batch(models):
    """Counter-based randomness: a seeded request's tokens do not depend on its batch neighbours. A
    greedy row in a sampling batch still matches the target's greedy output."""
    arch = "llama"
    prompt = random_prompts([23], seed=41)[0]
    mine = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)

    (alone,), _ = run_to_end(models.engine(arch, "noisy"), [prompt], mine, 3)
    others = random_prompts([5, 60, 23, 1, 140], seed=42)
    other_params = [
        SamplingParams(max_tokens=20),  # greedy
        SamplingParams(max_tokens=8, temperature=1.3, top_k=5, seed=7),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=99),
        SamplingParams(max_tokens=20, temperature=0.5),  # engine-drawn seed
        SamplingParams(max_tokens=20, temperature=1.0, use_speculation=False, seed=5),
    ]
    for order in ([0, 1, 2, 3, 4], [4, 2, 0]):
        prompts = [others[i] for i in order[:2]] + [prompt] + [others[i] for i in order[2:]]
        params = [other_params[i] for i in order[:2]] + [mine] + [other_params[i] for i in order[2:]]
        seqs, _ = run_to_end(models.engine(arch, "noisy"), prompts, params, 3)
        assert seqs[2].output_token_ids == alone.output_token_ids
        for p, prm, s in zip(prompts, params, seqs):
            if prm.greedy:
                assert s.output_token_ids == models.reference(arch, p, 20)

    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1235)
    (other,), _ = run_to_end(models.engine(arch, "noisy"), [prompt], other_seed, 3)
    assert other.output_token_ids != alone.output_token_ids  # the seed does matter


def test_rows_without_filters_are_not_touched_by_other_rows_filters():
    """When one row of a batch uses top-k/top-p, the batch takes the filtering path; rows with top_p = 1
    must still get exactly their own distribution, tail included (a float32 cumulative sum reaches 1.0
    before the tail here, which must not cut it), so a seeded row's draws do not depend on its neighbours."""
    logits = torch.tensor([[[0.0] + [-20.0] * 7], [[3.0, -20.0, 0.0] + [-20.0] * 5], [[0.0] * 8]])  # [3, 1, V]

    def rows(any_filter: bool, top_k: list[int]) -> RowParams:
        return RowParams(
            temperature=torch.ones(3),
            top_p=torch.tensor([1.0, 1.0, 0.5]),
            top_k=torch.tensor(top_k),
            seeds=torch.arange(3),
            any_sampling=True,
            any_filter=any_filter,
        )

    plain = process_probs(logits, rows(False, [0, 0, 0]))
    filtered = process_probs(logits, rows(True, [0, 0, 0]))
    assert torch.equal(filtered[:2], plain[:2])
    assert (filtered[0, 0, 1:] > 0).all()
    # top_k = 2 with top_p = 1 keeps exactly the two largest, however small the second one is.
    top2 = process_probs(logits, rows(True, [0, 2, 0]))[1, 0]
    assert (top2 > 0).tolist() == [True, False, True] + [False] * 5
    # The row that asked for top_p = 0.5 over a uniform distribution keeps 4 of 8 tokens.
    assert int((filtered[2, 0] > 0).sum()) == 4
