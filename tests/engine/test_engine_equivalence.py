"""Greedy speculative decoding is token-identical to the target model alone, whatever shares the batch.

Every test compares `SpecEngine` outputs with `Models.reference`: the target's own `generate(do_sample=
False)` at batch 1 in fp32. Draft variants (see conftest): "draft" a different random 1-layer model (it
almost never agrees), "noisy" the target with perturbed weights (partial acceptance), "same" the target
itself (everything accepted), "disagree" the target with its head rolled by one id (nothing accepted),
"pad" a draft with 16 padded vocabulary rows.
"""

from __future__ import annotations

import pytest
from tests.support.driver import admit, prefill, run_to_end, serve, step
from tests.support.models import ARCHS, EOS, random_prompts

from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.engine.static_forward import bucket_for

# Every scenario runs with every attention backend that runs on the CPU, and with EngineConfig.compile off and on
# (tests/engine/conftest.py: compile on, a few cases by default, all with EXSPEC_TEST_COMPILE=1).
pytestmark = pytest.mark.usefixtures("attention_backend", "engine_compile")

# 104 prompts of 1 to 200 tokens in a scrambled order; tests take slices so references are shared.
LENGTHS = [1 + (i * 73) % 200 for i in range(104)]
PROMPTS = random_prompts(LENGTHS, seed=7)
# A mixed batch of 16: prompts of 1 to 200 tokens, max_tokens from 1 (done at prefill) to 24.
MIXED = PROMPTS[:16]
MIXED_MAX = [24, 7, 1, 16, 24, 3, 12, 24, 9, 20, 5, 24, 14, 2, 24, 11]


def assert_matches_reference(models, arch, prompts, seqs, max_tokens, eos=(EOS,), min_tokens=0):
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    for i, (prompt, seq, m) in enumerate(zip(prompts, seqs, max_tokens)):
        ref = models.reference(arch, prompt, m, eos, min_tokens)
        assert seq.output_token_ids == ref, f"{arch}: sequence {i} (prompt of {len(prompt)} tokens) diverged"
        stopped = ref[-1] in eos and len(ref) > min_tokens
        assert seq.finish_reason == ("stop" if stopped else "length"), f"sequence {i}"
        if not stopped:
            assert len(ref) == m


def num_accepted(outs):
    return sum(o.num_accepted for out in outs for o in out.outputs)


@pytest.mark.parametrize("variant", ["draft", "noisy"])
@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_lengths_batch_matches_target(models, arch, k, variant):
    engine = models.engine(arch, variant)
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, outs = run_to_end(engine, MIXED, params, k)
    assert_matches_reference(models, arch, MIXED, seqs, MIXED_MAX)
    assert outs[1].kind == "mixed"
    assert all(out.num_draft_tokens == k for out in outs[1:])
    if models.compile:  # the verify and every draft forward ran static at each step's bucket, 16 down as rows finished
        used = sorted(engine._static)  # (draft?, bucket, Q)
        assert {q for is_draft, _, q in used if not is_draft} == {k + 1}
        draft_q = {q for is_draft, _, q in used if is_draft}  # the step's first: width 1, or 2 after a full accept
        assert 1 in draft_q and draft_q <= {1, 2}
        assert {b for _, b, _ in used} == {bucket_for(out.batch_size) for out in outs[1:]} and 16 in {b for _, b, _ in used}
    if variant == "noisy":  # acceptance lengths differ per row: every catch-up and rollback path runs
        lengths = {o.num_accepted for out in outs[1:] for o in out.outputs}
        assert 0 in lengths and len(lengths) >= min(3, k + 1)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 9, 16])
def test_batch_sizes_match_target(models, batch_size):
    engine = models.engine("llama", "noisy")
    prompts = PROMPTS[16 : 16 + batch_size]
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=20), 4)
    assert_matches_reference(models, "llama", prompts, seqs, 20)
    assert outs[1].kind == ("grouped" if batch_size == 1 else "mixed")


@pytest.mark.parametrize("arch", ARCHS)
def test_equal_lengths_grouped_matches_target_and_identical_draft_accepts_all(models, arch):
    """Same-length prompts and a draft identical to the target: every row accepts all k drafts, so the
    lengths stay equal and every step runs grouped, emitting k + 1 tokens per row."""
    k, steps = 3, 4
    max_tokens = 1 + steps * (k + 1)
    prompts = random_prompts([24] * 6, seed=21)
    engine = models.engine(arch, "same")
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), k)
    assert [out.kind for out in outs] == ["prefill"] + ["grouped"] * steps
    for out in outs[1:]:
        assert out.accepted_per_position == (6,) * k
        assert all(len(o.token_ids) == k + 1 and o.num_accepted == k for o in out.outputs)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == models.reference(arch, prompt, max_tokens, eos_token_ids=())


@pytest.mark.parametrize("arch", ARCHS)
def test_equal_lengths_grouped_then_mixed_and_forced_mixed_match_target(models, arch):
    """Equal prompt lengths start grouped; rows then diverge (partial acceptance) and run mixed. Forcing
    the mixed path on the same batch gives the same tokens."""
    prompts = random_prompts([17] * 7, seed=22)
    params = SamplingParams(max_tokens=18)
    seqs, outs = run_to_end(models.engine(arch, "noisy"), prompts, params, 3)
    assert outs[1].kind == "grouped"
    assert "mixed" in {out.kind for out in outs[2:]}
    assert_matches_reference(models, arch, prompts, seqs, 18)

    forced, outs = run_to_end(models.engine(arch, "noisy", force_mixed=True), prompts, params, 3)
    assert {out.kind for out in outs[1:]} == {"mixed"}
    assert [s.output_token_ids for s in forced] == [s.output_token_ids for s in seqs]


@pytest.mark.parametrize("k", [1, 8])
def test_identical_draft_emits_k_plus_one_per_step(models, k):
    """Mixed lengths, draft == target: every step emits exactly k + 1 tokens per row until the end."""
    engine = models.engine("qwen3", "same")
    prompts = MIXED[:8]
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=20), k)
    for out in outs[1:]:
        for o in out.outputs:
            assert o.num_accepted == k
            assert len(o.token_ids) == k + 1  # the engine never cuts; the stopping rule does
    assert_matches_reference(models, "qwen3", prompts, seqs, 20)


@pytest.mark.parametrize("arch", ARCHS)
def test_always_disagreeing_draft_matches_target(models, arch):
    engine = models.engine(arch, "disagree")
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, outs = run_to_end(engine, MIXED, params, 4)
    for out in outs[1:]:
        assert out.accepted_per_position == (0, 0, 0, 0)
        assert all(len(o.token_ids) == 1 for o in out.outputs)
    assert_matches_reference(models, arch, MIXED, seqs, MIXED_MAX)


@pytest.mark.parametrize("schedule", ["k0", "alternating"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_steps_without_speculation_match_target(models, arch, schedule):
    """k = 0 decodes one target token per row; alternating k = 0 with k > 0 leaves the draft several
    tokens behind, which the next drafting phase catches up."""
    ks = [0] if schedule == "k0" else [0, 3, 0, 0, 5, 8, 1, 0]
    engine = models.engine(arch, "noisy")
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, outs = run_to_end(engine, MIXED, params, lambda i: ks[i % len(ks)])
    for i, out in enumerate(outs[1:]):
        assert out.num_draft_tokens == ks[i % len(ks)]
        if out.num_draft_tokens == 0:
            assert all(len(o.token_ids) == 1 and o.num_draft_tokens == 0 for o in out.outputs)
    assert_matches_reference(models, arch, MIXED, seqs, MIXED_MAX)
    if schedule == "alternating":
        assert num_accepted(outs) > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompts_prefilled_without_the_draft_are_caught_up_by_the_first_drafting_step(models, arch):
    """A prefill may leave the draft out (the policy expects no drafts); the first step that drafts feeds
    the draft each row's whole context, apart, so a draft identical to the target accepts every token at
    once, and every row matches the target."""
    engine = models.engine(arch, "same")
    seqs, outs = run_to_end(engine, MIXED, [SamplingParams(max_tokens=m) for m in MIXED_MAX], 4, prefill_draft=False)
    assert outs[1].catchup_s > 0
    assert all(o.num_accepted == o.num_draft_tokens == 4 for o in outs[1].outputs)
    assert all(out.catchup_s == 0.0 for out in outs[2:])  # caught up once; a full accept leaves it 2 behind
    assert_matches_reference(models, arch, MIXED, seqs, MIXED_MAX)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_with_and_without_the_draft(models, arch):
    """Chunks fed to the draft only part of the way: the draft takes a chunk only where its cache reaches
    the chunk's start; the rest is caught up by the first drafting step."""
    engine = models.engine(arch, "same")
    prompts = [p for p in PROMPTS if len(p) >= 40][:6]
    seqs = [admit(engine, p, SamplingParams(max_tokens=9)) for p in prompts]
    cut = [len(p) // 2 for p in prompts]
    prefill(engine, [(s, 0, c) for s, c in zip(seqs[:3], cut)], draft=False)
    prefill(engine, [(s, 0, c) for s, c in zip(seqs[3:], cut[3:])], draft=True)
    prefill(engine, [(s, c, s.prompt_len) for s, c in zip(seqs, cut)], draft=True)  # first 3: draft not fed
    out = step(engine, seqs, 4)
    assert out.catchup_s > 0
    assert all(o.num_accepted == 4 for o in out.outputs)
    while not all(s.finished for s in seqs):
        step(engine, [s for s in seqs if not s.finished], 4)
    assert_matches_reference(models, arch, prompts, seqs, 9)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_without_speculation_mixed_with_speculating_rows(models, arch):
    """use_speculation=False rows share the batch with rows that accept everything: they accept nothing
    and emit one token per step, and every row still matches the target."""
    prompts = MIXED[:10]
    params = [SamplingParams(max_tokens=17, use_speculation=i % 2 == 0) for i in range(10)]
    seqs, outs = run_to_end(models.engine(arch, "same"), prompts, params, 4)
    speculating = {s.seq_id: s.params.use_speculation for s in seqs}
    for out in outs[1:]:
        for o in out.outputs:
            if speculating[o.seq_id]:
                assert o.num_draft_tokens == 4 and o.num_accepted == 4
            else:
                assert o.num_draft_tokens == 0 and o.num_accepted == 0 and len(o.token_ids) == 1
    assert_matches_reference(models, arch, prompts, seqs, 17)

    # Every row opted out: the step runs without drafting at all.
    opted_out = SamplingParams(max_tokens=5, use_speculation=False)
    seqs, outs = run_to_end(models.engine(arch, "same"), prompts[:3], opted_out, 4)
    assert all(out.num_draft_tokens == 0 for out in outs[1:])
    assert_matches_reference(models, arch, prompts[:3], seqs, 5)


@pytest.mark.parametrize("variant", ["noisy", "same", "disagree"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_prefill_verifies_drafts_and_matches_target(models, arch, variant):
    """The prefill forward reads each prompt with k drafts and verifies them (Hugging Face assisted generation's
    first forward): 16 prompts of 1 to 200 tokens in one batch (each row's drafts land over the shorter rows'
    padding), max_tokens from 1. Token-identical to the target alone; the prefill emits k + 1 tokens a row with an
    identical draft, 1 with a disagreeing one, and the rows' caches continue from there."""
    k = 3
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, outs = run_to_end(models.engine(arch, variant), MIXED, params, k, prefill_k=k)
    first = outs[0]
    assert first.kind == "prefill" and first.num_draft_tokens == k
    emitted = [len(o.token_ids) for o in first.outputs]
    if variant == "same":
        assert emitted == [k + 1] * len(MIXED)
        assert all(o.num_accepted == k for out in outs[1:] for o in out.outputs)  # the caches carried on
    elif variant == "disagree":
        assert emitted == [1] * len(MIXED)
    else:
        assert 1 < max(emitted)
    assert_matches_reference(models, arch, MIXED, seqs, MIXED_MAX)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_prefill_only_where_every_chunk_completes_its_prompt_and_fed_the_draft(models, arch):
    """A prefill batch with a chunk that does not complete its prompt, or a chunk the draft was not fed, samples one
    token a row as before; rows that opted out of speculation verify no draft; rows near max_model_len draft fewer."""
    engine = models.engine(arch, "same", max_model_len=64)
    a, b, c, d = random_prompts([40, 30, 20, 61], seed=5)
    sa, sb = admit(engine, a, SamplingParams(max_tokens=12)), admit(engine, b, SamplingParams(max_tokens=12))
    out = prefill(engine, [(sa, 0, 20), (sb, 0, 30)], k=4)  # a's chunk does not complete its prompt
    assert out.num_draft_tokens == 0 and [len(o.token_ids) for o in out.outputs] == [0, 1]
    sc = admit(engine, c, SamplingParams(max_tokens=12))
    prefill(engine, [(sc, 0, 10)], draft=False)
    out = prefill(engine, [(sa, 20, 40), (sc, 10, 20)], k=4)  # c's draft was not fed: no drafts
    assert out.num_draft_tokens == 0 and [len(o.token_ids) for o in out.outputs] == [1, 1]
    se = admit(engine, c, SamplingParams(max_tokens=12, use_speculation=False))
    sd = admit(engine, d, SamplingParams(max_tokens=12))  # 61 of 64 positions: two drafts, three tokens at most
    sf = admit(engine, b, SamplingParams(max_tokens=12))
    out = prefill(engine, [(se, 0, 20), (sd, 0, 61), (sf, 0, 30)], k=4)
    assert out.num_draft_tokens == 4
    assert [len(o.token_ids) for o in out.outputs] == [1, 3, 5]
    assert [o.num_draft_tokens for o in out.outputs] == [0, 2, 4]
    live = [s for s in (sa, sb, sc, se, sd, sf) if not s.finished]
    while live:
        step(engine, live, 4)
        live = [s for s in live if not s.finished]
    assert_matches_reference(models, arch, [a, b, c, c, d, b], [sa, sb, sc, se, sd, sf], [12, 12, 12, 12, 3, 12])


def test_fused_prefill_of_a_prompt_with_no_room_for_a_draft_samples_one_token(models):
    """A prompt filling max_model_len but one position leaves no row room for a draft: the fused prefill asked for k
    drafts falls back to sampling one token (it crashed on an empty draft loop, a 500 the server fuzz test found)."""
    engine = models.engine("llama", "same", max_model_len=64)
    (p,) = random_prompts([63], seed=6)
    s = admit(engine, p, SamplingParams(max_tokens=4))
    out = prefill(engine, [(s, 0, 63)], k=4)
    assert out.num_draft_tokens == 0 and [len(o.token_ids) for o in out.outputs] == [1]
    assert_matches_reference(models, "llama", [p], [s], [1])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sequences_admitted_and_finished_at_different_times(models, arch):
    """Continuous batching over 4 slots: finished sequences free their slots mid-run and new prompts are
    admitted into them while others are half-way through."""
    prompts = PROMPTS[30:41]
    max_tokens = [3, 20, 9, 14, 1, 24, 6, 17, 11, 4, 22]
    engine = models.engine(arch, "noisy", max_num_seqs=4)
    seqs, outs, slots = serve(engine, prompts, [SamplingParams(max_tokens=m) for m in max_tokens], 3, max_batch=4)
    assert_matches_reference(models, arch, prompts, seqs, max_tokens)
    assert set(slots.values()) == {0, 1, 2, 3}  # 11 sequences went through 4 slots
    assert engine.num_free_slots == 4
    assert any(out.kind == "prefill" for out in outs[2:])  # admissions happened between steps


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_chunked_prefill_matches_target(models, arch):
    """A long prompt prefilled in three chunks, alongside whole prompts and another chunked one, in
    batches whose rows start at different positions; one sequence runs into max_model_len."""
    max_model_len = 160
    engine = models.engine(arch, "noisy", max_model_len=max_model_len)
    a, b, c, d = random_prompts([150, 60, 80, 120], seed=31)
    sa = admit(engine, a, SamplingParams(max_tokens=30))  # stops at max_model_len: 10 tokens
    sb = admit(engine, b, SamplingParams(max_tokens=12))
    sc = admit(engine, c, SamplingParams(max_tokens=12))
    sd = admit(engine, d, SamplingParams(max_tokens=12))

    out = prefill(engine, [(sa, 0, 40), (sc, 0, 30)])  # equal starts
    assert [o.token_ids for o in out.outputs] == [(), ()]
    assert (engine._seqs[sa.seq_id].num_prefilled, engine._seqs[sc.seq_id].num_prefilled) == (40, 30)
    out = prefill(engine, [(sa, 40, 100), (sb, 0, 60), (sc, 30, 80)])
    assert [len(o.token_ids) for o in out.outputs] == [0, 1, 1]
    # The last chunk starts at 100 while d's whole prompt is 120 wide: padding runs past the pool.
    out = prefill(engine, [(sa, 100, 150), (sd, 0, 120)])
    assert [len(o.token_ids) for o in out.outputs] == [1, 1]

    live = [s for s in (sa, sb, sc, sd) if not s.finished]
    while live:
        step(engine, live, 4)
        live = [s for s in live if not s.finished]
    assert sa.finish_reason == "length" and sa.length == max_model_len
    assert_matches_reference(models, arch, [a, b, c, d], [sa, sb, sc, sd], [10, 12, 12, 12])


@pytest.mark.parametrize("variant", ["same", "draft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_eos_finishes_sequence_and_nothing_after_it_leaks(models, arch, variant):
    """Prompts whose greedy output really ends with EOS (token 2), in a batch with others. With the
    identical draft a step proposes past the EOS; those tokens must be cut."""
    eos_prompts = models.eos_prompts(arch, count=2, max_new_tokens=40)
    prompts = eos_prompts + MIXED[3:7]
    k = 8
    seqs, outs = run_to_end(models.engine(arch, variant), prompts, SamplingParams(max_tokens=40), k)
    assert_matches_reference(models, arch, prompts, seqs, 40)
    truncated = 0
    for seq in seqs[:2]:
        assert seq.finish_reason == "stop" and seq.stop_token_id == EOS
        assert seq.output_token_ids[-1] == EOS and EOS not in seq.output_token_ids[:-1]
        assert len(seq.output_token_ids) < 40 and seq.length == seq.prompt_len + len(seq.output_token_ids)
        last = [o for out in outs for o in out.outputs if o.seq_id == seq.seq_id][-1]
        assert EOS in last.token_ids  # the step that sampled the EOS ended the sequence
        truncated += last.token_ids.index(EOS) < len(last.token_ids) - 1
    if variant == "same":
        assert truncated > 0  # tokens past the EOS were generated, then dropped

    # ignore_eos: the same prompts run on through the EOS, still token-identical.
    seqs, _ = run_to_end(models.engine(arch, variant), prompts[:2], SamplingParams(max_tokens=40, ignore_eos=True), k)
    for prompt, seq in zip(prompts, seqs):
        assert seq.finish_reason == "length" and EOS in seq.output_token_ids[:-1]
        assert seq.output_token_ids == models.reference(arch, prompt, 40, eos_token_ids=())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_stop_token_ids_end_like_eos(models, arch):
    prompt = MIXED[4]
    ref = models.reference(arch, prompt, 24)
    j = next(i for i in range(4, 24) if ref[i] not in ref[:i] and ref[i] != EOS)
    stop = ref[j]
    params = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    seqs, _ = run_to_end(models.engine(arch, "same"), [prompt, MIXED[5]], params, 5)
    assert seqs[0].output_token_ids == ref[: j + 1]
    assert seqs[0].finish_reason == "stop" and seqs[0].stop_token_id == stop
    assert_matches_reference(models, arch, [prompt, MIXED[5]], seqs, 24, eos=(EOS, stop))


@pytest.mark.parametrize("arch", ARCHS)
def test_min_tokens_suppresses_eos(models, arch):
    prompt = models.eos_prompts(arch, count=2, max_new_tokens=40)[0]
    plain = models.reference(arch, prompt, 40)
    min_tokens = len(plain) + 2  # EOS came at len(plain): forbid it until 2 tokens later
    max_tokens = min_tokens + 6
    expected = models.reference(arch, prompt, max_tokens, min_new_tokens=min_tokens)
    assert expected[: len(plain) - 1] == plain[:-1] and expected[len(plain) - 1] != EOS
    params = [SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens), SamplingParams(max_tokens=max_tokens)]
    seqs, _ = run_to_end(models.engine(arch, "noisy"), [prompt, prompt], params, 4)
    assert seqs[0].output_token_ids == expected
    assert EOS not in seqs[0].output_token_ids[:min_tokens]
    assert seqs[1].output_token_ids == plain  # the same prompt without min_tokens still stops at EOS


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_draft_with_padded_vocabulary(models, arch):
    pair = models.pair(arch, "pad")
    assert pair.draft.get_output_embeddings().weight.shape[0] == 320 + 16
    assert pair.vocab_size == 320
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, _ = run_to_end(models.engine(arch, "pad"), MIXED, params, 4)
    assert_matches_reference(models, arch, MIXED, seqs, MIXED_MAX)


@pytest.mark.parametrize("arch", ARCHS)
def test_hundred_mixed_prompts_batch8_k4(models, arch):
    """104 prompts of 1 to 200 tokens through 8 slots with continuous refill, k = 4: token-identical."""
    engine = models.engine(arch, "noisy", max_num_seqs=8)
    seqs, outs, _ = serve(engine, PROMPTS, SamplingParams(max_tokens=24), 4, max_batch=8)
    assert len(seqs) == 104
    assert_matches_reference(models, arch, PROMPTS, seqs, 24)
    assert max(out.batch_size for out in outs if out.kind != "prefill") == 8
    assert num_accepted(outs) > 0


def test_eager_attention_matches_target(models):
    """attn_implementation="eager" adds the mask to the scores: the engine must hand it a float mask."""
    target, draft = models.dirs("qwen3")
    cfg = EngineConfig(model=target, draft_model=draft, attn_implementation="eager", max_model_len=320, max_num_seqs=16)
    engine = SpecEngine(cfg)
    assert engine.pair.target.config._attn_implementation == "exspec_eager"  # the model family's eager, via the pools
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, _ = run_to_end(engine, MIXED, params, 4)
    assert_matches_reference(models, "qwen3", MIXED, seqs, MIXED_MAX)


def test_sliding_window_attention_matches_target(models):
    """Mistral with an 8-token sliding window, prompts far longer than the window."""
    engine = models.engine("mistral", "window")
    assert engine.target.sliding_window == 8
    prompts = MIXED[:10]
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=16), 3)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == models.reference("mistral", prompt, 16, target="window")
    # The window matters: the same prompts give other tokens without it.
    assert [s.output_token_ids for s in seqs] != [models.reference("mistral", p, 16) for p in prompts]


def test_k_above_the_configured_maximum_is_capped(models):
    engine = models.engine("llama", "same", max_num_speculative_tokens=2)
    prompts = MIXED[:4]
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=10), 6)
    assert all(out.num_draft_tokens == 2 for out in outs[1:])
    assert_matches_reference(models, "llama", prompts, seqs, 10)


def test_engine_without_draft_matches_target(models):
    target, _ = models.dirs("gpt2")
    engine = SpecEngine(EngineConfig(model=target, max_num_seqs=16, max_model_len=320, compile=models.compile))
    assert not engine.has_draft
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX]
    seqs, outs = run_to_end(engine, MIXED, params, 4)
    assert all(out.num_draft_tokens == 0 for out in outs[1:])
    assert_matches_reference(models, "gpt2", MIXED, seqs, MIXED_MAX)
