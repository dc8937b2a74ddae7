"""The real demo pair's recipe (demo/imitate.py) part by part on tiny shapes, and its whole build path with a
tiny target standing in for SmolLM2 (seconds). Building the real pair takes minutes: not run here."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from exspec.demo import build, cache, corpus, imitate, recipe
from exspec.demo.imitate import ContinuationSet, DraftShape

from ..support.tiny_models import build_pair

SHAPE = DraftShape(hidden=16, layers=1, intermediate=32, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    target, _ = build_pair(tmp_path_factory.mktemp("imitate"), "llama", draft_same=True)
    return target


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def continuations(target) -> ContinuationSet:
    return imitate.target_continuations(target, _prompts(12), 10, eos_id=2, pad_id=3, topk=5, batch_size=4,
                                        progress=False)


def test_project_embedding_keeps_the_top_directions_deterministically():
    emb = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))  # [V, H]
    full = imitate.project_embedding(emb, 8)  # [V, 8]: a rotation of emb, rescaled by 1
    torch.testing.assert_close(full @ full.T, emb @ emb.T, rtol=1e-4, atol=1e-4)  # inner products kept
    low = imitate.project_embedding(emb, 3)
    assert low.shape == (50, 3)
    torch.testing.assert_close(low.norm(dim=1).mean(), emb.norm(dim=1).mean())
    assert torch.equal(low, imitate.project_embedding(emb.clone(), 3))


def test_new_draft_shares_the_targets_tokens_and_ties_a_projected_head(target):
    draft = imitate.new_draft(target.config, SHAPE, target.model.embed_tokens.weight)
    c, tc = draft.config, target.config
    assert (c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (
        tc.vocab_size, tc.bos_token_id, tc.eos_token_id, tc.pad_token_id)
    assert c.hidden_size == SHAPE.hidden and c.num_hidden_layers == SHAPE.layers
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(draft.model.embed_tokens.weight,
                               imitate.project_embedding(target.model.embed_tokens.weight, SHAPE.hidden))


def test_continuations_are_the_targets_greedy_tokens_with_its_top_k(target, continuations):
    prompts = _prompts(12)
    assert continuations.prompt_lens == [len(p) for p in prompts]
    for i in (0, 5, 11):  # batched, left-padded generation equals the prompt alone
        p = torch.tensor([prompts[i]])  # [1, P]
        alone = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=10, do_sample=False,
                                eos_token_id=2, pad_token_id=3)[0].tolist()
        if 2 in alone[len(prompts[i]):]:
            alone = alone[: alone.index(2, len(prompts[i])) + 1]
        assert continuations.sequences[i] == alone
        cont = torch.tensor(alone[len(prompts[i]):])  # [n]
        assert torch.equal(continuations.top_ids[i][:, 0], cont)  # the greedy token is the top-1
        lp = continuations.top_logprobs[i]  # [n, 5]
        assert lp.shape == (len(cont), 5) and bool((lp[:, :-1] >= lp[:, 1:]).all()) and bool((lp <= 0).all())


def test_batch_scores_exactly_the_continuation_positions(continuations):
    ids, mask, where, top_ids, _ = imitate._batch(continuations, [0, 1], pad_id=3)
    for r in (0, 1):
        seq, p = continuations.sequences[r], continuations.prompt_lens[r]
        pos = where[where[:, 0] == r, 1]
        assert pos.tolist() == list(range(p - 1, len(seq) - 1))
        assert ids[r, pos + 1 - 1].tolist() == seq[p - 1 : len(seq) - 1]  # the inputs there
        assert int(mask[r].sum()) == len(seq) - 1
    assert top_ids.shape[0] == where.shape[0]


def test_distillation_raises_agreement_and_is_deterministic(target, continuations):
    def trained(seed_init):
        torch.manual_seed(seed_init)
        draft = imitate.new_draft(target.config, SHAPE, target.model.embed_tokens.weight)
        before = imitate.agreement(draft, continuations, pad_id=3)
        log = imitate.distill_draft(draft, continuations, steps=150, batch_size=4, lr=2e-2, warmup=5, pad_id=3,
                                    seed=0, progress=False)
        return draft, before, log

    draft, before, log = trained(0)
    after = imitate.agreement(draft, continuations, pad_id=3)
    assert after > before + 0.2 and after > 0.5, (before, after)
    assert sum(log[-5:]) < sum(log[:5])
    again, _, log2 = trained(0)
    assert log == log2
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), again.state_dict().values()))


def test_imitation_prompts_hold_out_the_measured_questions():
    train, held = corpus.imitation_prompts(0, 100, 16)
    assert len(train) == 100 and len(held) == 16
    assert not set(train) & set(held)
    assert held == [q for _, q in corpus.spec_bench_prompts(corpus.MEASURE_PROMPTS)][:16]
    assert train == corpus.imitation_prompts(0, 100, 16)[0] != corpus.imitation_prompts(1, 100, 16)[0]


def test_the_real_pair_build_path_with_a_tiny_target(tmp_path, target_dir, monkeypatch):
    """build_demo_pair(scale="smollm2") end to end, with the GGUF conversion replaced by a tiny target."""
    import shutil

    from exspec.engine import gguf

    def fake_convert(path, cache_root=None):
        out = Path(cache_root) / "converted"
        shutil.copytree(target_dir, out)
        return out

    monkeypatch.setattr(gguf, "gguf_to_hf_dir", fake_convert)
    monkeypatch.setattr(gguf, "smollm2_gguf_path", lambda: Path("/nowhere/model.gguf"))
    tiny = replace(recipe.IMITATION_RECIPES["smollm2"], draft=recipe.ModelShape(16, 1, 32, 2, 1), train_prompts=4,
                   new_tokens=6, heldout_prompts=2, heldout_new_tokens=4, topk=4, generate_batch=4, steps=3,
                   batch_size=2)
    monkeypatch.setitem(recipe.IMITATION_RECIPES, "smollm2", tiny)
    t, d = build.build_demo_pair(tmp_path / "pair", progress=False, scale="smollm2")
    assert cache.cached_pair(tmp_path / "pair", scale="smollm2") == (t, d)
    assert cache.cached_pair(tmp_path / "pair", scale="tiny") is None
    info = json.loads((tmp_path / "pair" / cache.MARKER).read_text())
    assert 0.0 <= info["heldout_agreement"] <= 1.0 and info["recipe"]["steps"] == 3
    from transformers import AutoConfig

    dc, tc = AutoConfig.from_pretrained(d), AutoConfig.from_pretrained(t)
    assert dc.vocab_size == tc.vocab_size and dc.hidden_size == 16 and dc.tie_word_embeddings
    assert (d / "tokenizer.json").read_bytes() == (t / "tokenizer.json").read_bytes()
