"""The paged KV: slot and block bookkeeping, admission limits, memory that follows the tokens held, the block
table and its null block, and the guarantee that K/V (and tokens) past a sequence's valid length are never
read, so rollback and block reuse need no copying or clearing."""

from __future__ import annotations

import pytest
import torch
from tests.support.driver import admit, run_to_end
from tests.support.models import EOS, random_prompts

from exspec.engine import CapacityError, InvalidRequestError, SamplingParams
from exspec.engine.kv_cache import SlotAllocator


def test_slot_allocator_hands_out_frees_and_reuses_slots():
    alloc = SlotAllocator(3)
    got = [alloc.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and alloc.num_free == 0 and alloc.num_used == 3
    with pytest.raises(CapacityError, match="all 3 KV slots are in use"):
        alloc.allocate()
    alloc.free(got[1])
    assert alloc.num_free == 1
    assert alloc.allocate() == got[1]  # the freed slot is handed out again
    with pytest.raises(CapacityError):
        alloc.allocate()


def test_admitting_more_than_max_num_seqs_raises_capacity_error(models):
    engine = models.engine("llama", max_num_seqs=2)
    a = admit(engine, [5, 6, 7], SamplingParams())
    b = admit(engine, [8, 9], SamplingParams())
    assert engine.num_free_slots == 0 and {a.slot, b.slot} == {0, 1}
    with pytest.raises(CapacityError, match="max_num_seqs"):
        admit(engine, [10, 11], SamplingParams())
    engine.free(a.seq_id)
    assert a.slot == -1 and engine.num_free_slots == 1
    c = admit(engine, [10, 11], SamplingParams())
    assert c.slot in (0, 1) and c.slot != b.slot
    engine.free(a.seq_id)  # freeing twice is harmless
    assert engine.num_free_slots == 0


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        (list(range(4, 4 + 40)), "maximum sequence length is 40"),
        (list(range(4, 4 + 57)), "57 tokens"),
        ([5, 320, 6], "must be in \\[0, 320\\)"),
        ([5, -1], "must be in"),
    ],
)
def test_prompts_that_can_never_run_are_rejected(models, prompt, message):
    engine = models.engine("llama", max_num_seqs=2, max_model_len=40)
    with pytest.raises(InvalidRequestError, match=message):
        admit(engine, prompt, SamplingParams())
    assert engine.num_free_slots == 2  # nothing leaked


@torch.inference_mode()  # the pools are inference tensors
def _poison(engine, live, gen: torch.Generator) -> None:
    """Overwrite everything no sequence may read: in each model's pools every row but each live sequence's
    valid positions (target: up to its pending token; draft: up to draft_len) — the null block, free blocks,
    and the tails of owned blocks included; each token buffer past its length; every free slot entirely.
    Values are huge (but finite, so a masked-out key multiplied by a zero weight stays zero)."""
    owned = {s.slot: s for s in live}
    bs = engine.block_size
    for runner, bound in ((engine.target, lambda s: s.length - 1), (engine.draft, lambda s: s.draft_len)):
        keep = torch.zeros((engine.num_blocks + 1) * bs, dtype=torch.bool)  # pool rows a live sequence reads
        for slot, s in owned.items():
            pos = torch.arange(bound(s))
            keep[torch.tensor(engine.blocks.blocks(slot), dtype=torch.long)[pos // bs] * bs + pos % bs] = True
        for pool in runner.cache.keys + runner.cache.values:
            flat = pool.view(-1, *pool.shape[2:])  # [(num_blocks + 1) * block_size, kv_heads, head_dim]
            flat[~keep] = torch.randn(flat[~keep].shape, generator=gen) * 1e4
    for slot in range(engine.token_buf.shape[0]):
        start = owned[slot].length if slot in owned else 0
        n = engine.token_buf.shape[1] - start
        engine.token_buf[slot, start:] = torch.randint(0, engine.vocab_size, (n,), generator=gen)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("variant", ["noisy", "same"])
def test_stale_kv_past_valid_length_is_never_read(models, arch, variant):
    """Poisoning every position a sequence must not read, before prefill and between all steps, changes
    nothing: rejected drafts' K/V and padding writes are dead."""
    prompts = random_prompts([1, 9, 40, 77, 120, 3, 55, 16], seed=51)
    params = [SamplingParams(max_tokens=m) for m in (20, 13, 20, 7, 20, 16, 20, 11)]
    gen = torch.Generator().manual_seed(0)
    ks = [4, 1, 0, 6, 3]

    clean, _ = run_to_end(models.engine(arch, variant), prompts, params, lambda i: ks[i % 5])
    engine = models.engine(arch, variant)
    _poison(engine, [], gen)
    poisoned, outs = run_to_end(
        engine, prompts, params, lambda i: ks[i % 5], before_step=lambda e, live: _poison(e, live, gen)
    )
    assert [s.output_token_ids for s in poisoned] == [s.output_token_ids for s in clean]
    for prompt, seq, prm in zip(prompts, poisoned, params):
        assert seq.output_token_ids == models.reference(arch, prompt, prm.max_tokens)
    assert sum(o.num_accepted for out in outs for o in out.outputs) > 0


def test_poisoning_valid_kv_does_change_outputs(models):
    """The control for the test above: the same poison one position lower (into valid K/V) is seen."""
    prompts = random_prompts([30, 31], seed=52)
    params = SamplingParams(max_tokens=10)
    clean, _ = run_to_end(models.engine("llama", "noisy"), prompts, params, 3)

    @torch.inference_mode()
    def poison_valid(engine, live):
        bs = engine.block_size
        for pool in engine.target.cache.keys + engine.target.cache.values:
            for s in live:
                p = s.length - 2
                pool[engine.blocks.blocks(s.slot)[p // bs], p % bs] = 1e4

    bad, _ = run_to_end(models.engine("llama", "noisy"), prompts, params, 3, before_step=poison_valid)
    assert [s.output_token_ids for s in bad] != [s.output_token_ids for s in clean]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reused_slot_gives_the_same_output_as_a_fresh_engine(models, arch):
    """A long sequence fills its slot's K/V far past where the next, shorter owner will ever reach; the
    next owner's output equals a fresh engine's."""
    long_prompt, short_prompt = random_prompts([180, 12], seed=53)
    engine = models.engine(arch, "noisy", max_num_seqs=1)
    (first,), _ = run_to_end(engine, [long_prompt], SamplingParams(max_tokens=24, ignore_eos=True), 5, free=False)
    slot = first.slot
    engine.free(first.seq_id)
    (second,), _ = run_to_end(engine, [short_prompt], SamplingParams(max_tokens=24), 5, free=False)
    assert second.slot == slot == 0
    fresh_engine = models.engine(arch, "noisy", max_num_seqs=1)
    (fresh,), _ = run_to_end(fresh_engine, [short_prompt], SamplingParams(max_tokens=24), 5)
    assert second.output_token_ids == fresh.output_token_ids == models.reference(arch, short_prompt, 24)


@pytest.mark.parametrize("k", [2, 8])
def test_sequences_reaching_max_model_len_finish_with_length(models, k):
    max_model_len = 48
    lengths = [20, 30, 40, 44, 46, 47]
    prompts = random_prompts(lengths, seed=54)
    engine = models.engine("qwen3", "same", max_model_len=max_model_len)
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=100), k)
    for prompt, seq in zip(prompts, seqs):
        room = max_model_len - len(prompt)
        ref = models.reference("qwen3", prompt, room)
        assert seq.output_token_ids == ref
        if ref[-1] != EOS:
            assert seq.finish_reason == "length" and seq.length == max_model_len
    assert seqs[-1].finish_reason == "length" and len(seqs[-1].output_token_ids) == 1  # 47 + 1 from prefill
    assert engine.num_free_slots == engine.num_slots
